// float16 instantiations of the hybrid-attention kernel (head_dim 64 and 128).
#include "attention_kernel.cuh"

namespace sarathi_rt {
namespace attn {
SARATHI_RT_INSTANTIATE_ATTENTION(__half, 64)
SARATHI_RT_INSTANTIATE_ATTENTION(__half, 128)
}  // namespace attn
}  // namespace sarathi_rt

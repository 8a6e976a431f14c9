// bfloat16 instantiations of the linear GEMMs (one file per dtype: parallel compiles).
#include <cutlass/bfloat16.h>

#include "gemm_kernels.cuh"

namespace sarathi_rt::gemm_detail {

Status run_bf16(const GemmParams& p, cudaStream_t stream) { return run_config<cutlass::bfloat16_t>(p, stream); }

}  // namespace sarathi_rt::gemm_detail

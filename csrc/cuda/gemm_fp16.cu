// float16 instantiations of the linear GEMMs (one file per dtype: parallel compiles).
#include <cutlass/half.h>

#include "gemm_kernels.cuh"

namespace sarathi_rt::gemm_detail {

Status run_fp16(const GemmParams& p, cudaStream_t stream) { return run_config<cutlass::half_t>(p, stream); }

}  // namespace sarathi_rt::gemm_detail

// bfloat16 instantiations of the unsplit linear GEMMs (one file per dtype and output:
// parallel compiles).
#include <cutlass/bfloat16.h>

#include "gemm_kernels.cuh"

namespace sarathi_rt::gemm_detail {

Status run_bf16(const GemmParams& p, cudaStream_t stream) {
  using T = cutlass::bfloat16_t;
  return with_config<T, T>(p.config_id, RunKernel<T>{p, direct_target<T>(p), stream});
}

Status occupancy_bf16(int32_t config_id, bool split_k, GemmKernelOccupancy* out) {
  if (split_k) return occupancy_bf16_split(config_id, out);  // in gemm_split_bf16.cu
  return with_config<cutlass::bfloat16_t, cutlass::bfloat16_t>(config_id, KernelOccupancy{out});
}

}  // namespace sarathi_rt::gemm_detail

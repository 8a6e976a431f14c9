// Paged KV write on the GPU: one CTA per token, 16-byte vectorized copies of each head row.
#include <cuda_runtime.h>

#include <string>

#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace {

// Each thread moves one Vec (16 bytes when rows allow it) of one head row, addressed in
// bytes so one kernel serves every dtype.
template <typename Vec>
__global__ void write_kv_kernel(WriteKVParams p, int64_t vecs_per_row) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  // Negative slots are padding; out-of-range slots were rejected on the host and are
  // skipped here so a stale mapping can never write outside the cache.
  if (slot < 0 || slot >= p.layout.num_slots()) return;
  const int64_t es = dtype_size(p.dtype);
  const int64_t elems_per_vec = static_cast<int64_t>(sizeof(Vec)) / es;
  const int64_t total = p.layout.num_kv_heads * vecs_per_row;
  for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t h = i / vecs_per_row;
    const int64_t e = (i % vecs_per_row) * elems_per_vec;  // element offset inside the head row
    const int64_t dst = (p.layout.slot_offset(slot, h) + e) * es;
    const int64_t ksrc = (t * p.key_token_stride + h * p.key_head_stride + e) * es;
    const int64_t vsrc = (t * p.value_token_stride + h * p.value_head_stride + e) * es;
    *reinterpret_cast<Vec*>(static_cast<char*>(p.k_cache) + dst) =
        *reinterpret_cast<const Vec*>(static_cast<const char*>(p.key) + ksrc);
    *reinterpret_cast<Vec*>(static_cast<char*>(p.v_cache) + dst) =
        *reinterpret_cast<const Vec*>(static_cast<const char*>(p.value) + vsrc);
  }
}

bool aligned16(const void* ptr, int64_t stride_bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && stride_bytes % 16 == 0;
}

}  // namespace

Status write_kv_cuda(const WriteKVParams& p, void* stream) {
  if (p.num_tokens == 0) return Status::Ok();
  const int es = dtype_size(p.dtype);
  const int64_t row_bytes = p.layout.head_dim * es;
  const bool vec16 = row_bytes % 16 == 0 && aligned16(p.key, p.key_token_stride * es) &&
                     aligned16(p.value, p.value_token_stride * es) && (p.key_head_stride * es) % 16 == 0 &&
                     (p.value_head_stride * es) % 16 == 0 && aligned16(p.k_cache, 16) && aligned16(p.v_cache, 16);
  const int threads = 128;
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  if (vec16) {
    write_kv_kernel<uint4><<<grid, threads, 0, s>>>(p, row_bytes / 16);
  } else if (es == 4) {
    write_kv_kernel<float><<<grid, threads, 0, s>>>(p, p.layout.head_dim);
  } else {
    write_kv_kernel<unsigned short><<<grid, threads, 0, s>>>(p, p.layout.head_dim);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::DeviceError(std::string("write_kv launch failed: ") + cudaGetErrorString(err));
  return Status::Ok();
}

}  // namespace sarathi_rt

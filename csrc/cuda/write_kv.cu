// Paged KV write on the GPU: one CTA per token, 16-byte vectorized copies of each head row.
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace {

constexpr int kMaxDevices = 64;

// Per device {token, slot} of the first out-of-range slot a kernel met, -1 when none: in
// mapped pinned host memory, so the host reads it without a copy once the kernel ran.
int64_t* bad_slot_status(int device) {
  static int64_t* status = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* host = nullptr;
    if (cudaHostAlloc(&host, sizeof(int64_t) * 2 * kMaxDevices, cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      return;
    }
    status = static_cast<int64_t*>(host);
    for (int i = 0; i < 2 * kMaxDevices; ++i) status[i] = -1;
  });
  return status == nullptr ? nullptr : status + 2 * device;
}

// Turns a recorded out-of-range slot into the CPU path's error, and clears it.
Status take_bad_slot(volatile int64_t* status, int64_t num_slots) {
  const int64_t token = status[0];
  if (token < 0) return Status::Ok();
  const int64_t slot = status[1];
  status[0] = -1;
  status[1] = -1;
  return Status::Invalid("slot_mapping[" + std::to_string(token) + "] = " + std::to_string(slot) +
                         " is outside the cache's " + std::to_string(num_slots) + " slots");
}

// Each thread moves one Vec (16 bytes when rows allow it) of one head row, addressed in
// bytes so one kernel serves every dtype.
template <typename Vec>
__global__ void write_kv_kernel(WriteKVParams p, int64_t vecs_per_row, int64_t* bad_slot) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;  // padding
  // An out-of-range slot is never written: it is recorded for the host to raise.
  if (slot >= p.layout.num_slots()) {
    // The first such token claims the slot word, then publishes its index: once the
    // host sees a token, its slot is there too.
    auto* claimed = reinterpret_cast<unsigned long long*>(bad_slot + 1);
    if (threadIdx.x == 0 && atomicCAS(claimed, ~0ull, static_cast<unsigned long long>(slot)) == ~0ull) {
      __threadfence_system();
      *static_cast<volatile int64_t*>(bad_slot) = t;
    }
    return;
  }
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
  if (p.device < 0 || p.device >= kMaxDevices) {
    return Status::Invalid("write_kv: CUDA device index " + std::to_string(p.device) + " is out of range");
  }
  int64_t* bad_slot = bad_slot_status(p.device);
  if (bad_slot == nullptr) return Status::DeviceError("write_kv: could not allocate its pinned status word");
  // A bad slot met by an earlier unchecked launch on this device fails this call.
  Status st = take_bad_slot(bad_slot, p.layout.num_slots());
  if (!st.ok() || p.num_tokens == 0) return st;
  const int es = dtype_size(p.dtype);
  const int64_t row_bytes = p.layout.head_dim * es;
  const bool vec16 = row_bytes % 16 == 0 && aligned16(p.key, p.key_token_stride * es) &&
                     aligned16(p.value, p.value_token_stride * es) && (p.key_head_stride * es) % 16 == 0 &&
                     (p.value_head_stride * es) % 16 == 0 && aligned16(p.k_cache, 16) && aligned16(p.v_cache, 16);
  const int threads = 128;
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  if (vec16) {
    write_kv_kernel<uint4><<<grid, threads, 0, s>>>(p, row_bytes / 16, bad_slot);
  } else if (es == 4) {
    write_kv_kernel<float><<<grid, threads, 0, s>>>(p, p.layout.head_dim, bad_slot);
  } else {
    write_kv_kernel<unsigned short><<<grid, threads, 0, s>>>(p, p.layout.head_dim, bad_slot);
  }
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && p.sync_check) err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) return Status::DeviceError(std::string("write_kv launch failed: ") + cudaGetErrorString(err));
  return p.sync_check ? take_bad_slot(bad_slot, p.layout.num_slots()) : Status::Ok();
}

}  // namespace sarathi_rt

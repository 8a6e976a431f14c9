// CPU write_kv: key/value and the cache share a dtype, so each token's head rows are a
// plain byte copy into its slot.
#include <cstring>

#include "cpu_simd.h"
#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace {

// n bytes in whole vectors of the level's register width, then the rest. A token's rows
// are 128 B to a few KB: inline vector moves, where a libc memcpy call per row (two per
// head) cost more than the copy.
template <int W>
SRT_SIMD_INLINE void copy_bytes(char* dst, const char* src, int64_t n) {
  constexpr int64_t kBytes = W * static_cast<int64_t>(sizeof(float));
  int64_t b = 0;
  for (; b + kBytes <= n; b += kBytes) {
    cpu::store(reinterpret_cast<float*>(dst + b), cpu::load<W>(reinterpret_cast<const float*>(src + b)));
  }
  if (b < n) std::memcpy(dst + b, src + b, n - b);
}

// Token t's key and value rows into its slot. The pages hold a token's heads side by side
// (PagedKVLayout::slot_offset), so where the source's heads are too (key_head_stride ==
// head_dim, as in a fused qkv buffer) all of them are one copy.
template <int W>
SRT_SIMD_INLINE void write_token(const WriteKVParams& p, int64_t t) {
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  const int64_t esize = dtype_size(p.dtype), dim = p.layout.head_dim, heads = p.layout.num_kv_heads;
  const int64_t dst = p.layout.slot_offset(slot, 0) * esize;
  const auto* key = static_cast<const char*>(p.key) + t * p.key_token_stride * esize;
  const auto* value = static_cast<const char*>(p.value) + t * p.value_token_stride * esize;
  auto* k_cache = static_cast<char*>(p.k_cache) + dst;
  auto* v_cache = static_cast<char*>(p.v_cache) + dst;
  if (p.key_head_stride == dim && p.value_head_stride == dim) {
    copy_bytes<W>(k_cache, key, heads * dim * esize);
    copy_bytes<W>(v_cache, value, heads * dim * esize);
    return;
  }
  for (int64_t h = 0; h < heads; ++h) {
    copy_bytes<W>(k_cache + h * dim * esize, key + h * p.key_head_stride * esize, dim * esize);
    copy_bytes<W>(v_cache + h * dim * esize, value + h * p.value_head_stride * esize, dim * esize);
  }
}

template <int W>
struct WriteToken {
  static SRT_SIMD_INLINE void run(const WriteKVParams& p, int64_t t) { write_token<W>(p, t); }
};

}  // namespace

Status write_kv_cpu(const WriteKVParams& p) {
  Status st = validate_slot_mapping(p);
  if (!st.ok()) return st;
  const int64_t row_bytes = p.layout.head_dim * dtype_size(p.dtype);
  cpu::for_each_token<WriteToken>(p, p.num_tokens * p.layout.num_kv_heads * row_bytes > (1 << 16));
  return Status::Ok();
}

}  // namespace sarathi_rt

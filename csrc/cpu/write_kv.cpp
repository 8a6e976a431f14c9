#include <cstring>

#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {

// key/value and the cache share a dtype, so a token's head row is a plain byte copy.
Status write_kv_cpu(const WriteKVParams& p) {
  Status st = validate_slot_mapping(p);
  if (!st.ok()) return st;
  const int64_t esize = dtype_size(p.dtype);
  const int64_t row_bytes = p.layout.head_dim * esize;
  const auto* key = static_cast<const char*>(p.key);
  const auto* value = static_cast<const char*>(p.value);
  auto* k_cache = static_cast<char*>(p.k_cache);
  auto* v_cache = static_cast<char*>(p.v_cache);
  const int64_t heads = p.layout.num_kv_heads;
#pragma omp parallel for schedule(static) if (p.num_tokens * heads * row_bytes > (1 << 16))
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = p.layout.slot_offset(slot, h) * esize;
      std::memcpy(k_cache + dst, key + (t * p.key_token_stride + h * p.key_head_stride) * esize, row_bytes);
      std::memcpy(v_cache + dst, value + (t * p.value_token_stride + h * p.value_head_stride) * esize, row_bytes);
    }
  }
  return Status::Ok();
}

}  // namespace sarathi_rt

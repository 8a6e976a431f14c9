// Host-side checks of index arrays: every out-of-range id becomes a clear error instead
// of an out-of-bounds read or write.
#include <string>

#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {

Status validate_slot_mapping(const WriteKVParams& p) {
  const int64_t num_slots = p.layout.num_slots();
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (p.slot_mapping[t] >= num_slots) {
      return Status::Invalid("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(p.slot_mapping[t]) +
                             " is outside the cache's " + std::to_string(num_slots) + " slots");
    }
  }
  return Status::Ok();
}

Status validate_attention_indices(const HybridAttentionParams& p) {
  if (p.cu_seqlens_q[0] != 0) return Status::Invalid("cu_seqlens_q[0] must be 0");
  if (p.cu_seqlens_q[p.batch] != p.total_q) {
    return Status::Invalid("cu_seqlens_q[-1] = " + std::to_string(p.cu_seqlens_q[p.batch]) +
                           " must equal q.shape[0] = " + std::to_string(p.total_q));
  }
  const int64_t capacity = p.max_blocks_per_seq * p.layout.block_size;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    const int64_t kv_len = p.seqlens_k[b];
    // The message is built only on failure: this loop runs on every layer's call.
    const auto at = [b] { return "[" + std::to_string(b) + "]"; };
    if (q_len < 0) return Status::Invalid("cu_seqlens_q must be non-decreasing (at " + at() + ")");
    if (kv_len < q_len) {
      return Status::Invalid("seqlens_k" + at() + " = " + std::to_string(kv_len) +
                             " is smaller than that request's query length " + std::to_string(q_len));
    }
    if (kv_len > capacity) {
      return Status::Invalid("seqlens_k" + at() + " = " + std::to_string(kv_len) +
                             " needs more blocks than block_tables has columns (" +
                             std::to_string(p.max_blocks_per_seq) + ")");
    }
    const int32_t* row = p.block_tables + b * p.max_blocks_per_seq;
    for (int64_t i = 0, n = ceil_div(kv_len, p.layout.block_size); i < n; ++i) {
      if (row[i] < 0 || row[i] >= p.layout.num_blocks) {
        return Status::Invalid("block_tables" + at() + "[" + std::to_string(i) + "] = " + std::to_string(row[i]) +
                               " is outside the cache's " + std::to_string(p.layout.num_blocks) + " blocks");
      }
    }
  }
  return Status::Ok();
}

}  // namespace sarathi_rt

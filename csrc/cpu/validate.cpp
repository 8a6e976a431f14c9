// Host-side checks of index arrays and of CPU attention plans: every out-of-range id
// becomes a clear error instead of an out-of-bounds read or write.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "sarathi_rt/attention_plan.h"
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

Status validate_attention_options(const HybridAttentionParams& p) {
  if (p.window < 0 || p.window > std::numeric_limits<int32_t>::max()) {
    return Status::Invalid("window must be in [0, 2^31 - 1] (0 = full attention), got " + std::to_string(p.window));
  }
  if (!std::isfinite(p.softcap) || p.softcap < 0.0f) {
    return Status::Invalid("softcap must be a finite number > 0 (0 = off), got " + std::to_string(p.softcap));
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

Status validate_cpu_attention_plan(const HybridAttentionParams& p, const int32_t* plan,
                                   const AttentionPlanCapacity& cap) {
  const auto mismatch = [](const std::string& what) {
    return Status::Invalid("plan does not match this call (" + what +
                           "); build it with plan_attention for this step's batch");
  };
  if (cap.kernel != AttentionKernel::kCpu || plan[kPlanKernel] != static_cast<int32_t>(AttentionKernel::kCpu)) {
    return Status::Invalid("plan was built for the CUDA kernel; plan_attention(..., kernel=\"cpu\") plans for this one");
  }
  // Items of a windowed plan skip the keys before the window: a plan made for another
  // window would drop keys that this call's rows see.
  if (plan[kPlanWindow] != p.window) {
    return Status::Invalid("plan was built for window " + std::to_string(plan[kPlanWindow]) + " but this call has " +
                           std::to_string(p.window) + " (0 = full attention); plan each window separately");
  }
  const int64_t num_items = plan[kPlanNumItems], num_merges = plan[kPlanNumMerges];
  const int64_t partial_rows = plan[kPlanNumPartialRows];
  if (plan[kPlanNumCtas] != cap.num_ctas || num_items < 0 || num_items > cap.max_items || num_merges < 0 ||
      num_merges > cap.max_merges || partial_rows < 0 || partial_rows > cap.max_partial_rows) {
    return mismatch("its header disagrees with its capacity");
  }
  const int32_t* begin = plan + cap.cta_begin_offset();
  if (begin[0] != 0 || begin[cap.num_ctas] != num_items) return mismatch("worker ranges");
  for (int64_t c = 0; c < cap.num_ctas; ++c) {
    if (begin[c + 1] < begin[c]) return mismatch("worker ranges");
  }
  const int64_t group = p.num_q_heads / p.layout.num_kv_heads;
  const int64_t max_rows = cpu_attention_max_rows(p.layout.num_kv_heads);
  const auto rows_ok = [&](int64_t kv_head, int64_t num_heads, int64_t row_begin, int64_t num_rows) {
    return kv_head >= 0 && num_heads >= 1 && kv_head + num_heads <= p.layout.num_kv_heads && row_begin >= 0 &&
           num_rows >= 1 && num_heads * num_rows <= max_rows && (num_heads == 1 || num_rows <= kCpuDirectRows);
  };
  const auto* items = reinterpret_cast<const AttentionWorkItem*>(plan + cap.items_offset());
  for (int64_t i = 0; i < num_items; ++i) {
    const AttentionWorkItem& w = items[i];
    // The message is built only on failure: this loop runs on every layer's call.
    const auto at = [i] { return "work item " + std::to_string(i); };
    if (w.request < 0 || w.request >= p.batch) return mismatch(at() + " names request " + std::to_string(w.request));
    const int64_t q_len = p.cu_seqlens_q[w.request + 1] - p.cu_seqlens_q[w.request];
    const int64_t kv_len = p.seqlens_k[w.request];
    if (w.q_token0 != p.cu_seqlens_q[w.request] || w.causal_offset != kv_len - q_len ||
        !rows_ok(w.kv_head, w.num_heads, w.row_begin, w.num_rows) ||
        w.row_begin + w.num_rows > q_len * group || w.kv_begin < 0 || w.kv_begin % kCpuKeyChunk != 0 ||
        w.kv_begin >= w.kv_end || w.kv_end > kv_len || w.partial < -1 ||
        (w.partial >= 0 && w.partial + static_cast<int64_t>(w.num_heads) * w.num_rows > partial_rows)) {
      return mismatch(at() + ", request " + std::to_string(w.request));
    }
  }
  const auto* merges = reinterpret_cast<const AttentionMergeItem*>(plan + cap.merges_offset());
  for (int64_t m = 0; m < num_merges; ++m) {
    const AttentionMergeItem& mg = merges[m];
    if (!rows_ok(mg.kv_head, mg.num_heads, mg.row_begin, mg.num_rows) || mg.q_token0 < 0 ||
        mg.q_token0 + (mg.row_begin + mg.num_rows - 1) / group >= p.total_q || mg.first_partial < 0 ||
        mg.num_partials < 1 ||
        mg.first_partial + static_cast<int64_t>(mg.num_partials) * mg.num_heads * mg.num_rows > partial_rows) {
      return mismatch("merge " + std::to_string(m));
    }
  }
  return Status::Ok();
}

}  // namespace sarathi_rt

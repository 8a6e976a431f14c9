// The hybrid-attention plan: built once per step on the host from cu_seqlens_q and
// seqlens_k, copied to the device once, and read by the attention launch of every layer.
//
// A request's query rows are flattened as row = query * group + head_in_group, so the
// query heads that share one KV head also share every K/V tile loaded from the pages.
// A work item is one tile of those rows (16 "narrow" rows, where the 4 warps of a CTA
// split the keys; or 64 "wide" rows, where the warps split the rows) against a range of
// keys. Decodes become narrow tiles; prefill chunks become wide tiles. When there are
// too few tiles to fill the GPU, long key ranges are split; each piece writes a partial
// result and its log-sum-exp, and a merge item combines the pieces of one tile.
//
// Every array has a capacity fixed when the plan is created, so the device buffers never
// move and a planned step can be captured in a CUDA graph.
#pragma once

#include <cstdint>

#include "sarathi_rt/common.h"
#include "sarathi_rt/kv_ops.h"
#include "sarathi_rt/paged_kv.h"

namespace sarathi_rt {

constexpr int32_t kNarrowTileRows = 16;
constexpr int32_t kWideTileRows = 64;
constexpr int32_t kKeysPerChunk = 64;    // keys loaded per pipeline stage of the kernel
constexpr int32_t kMinSplitChunks = 4;   // a split piece covers at least this many chunks

enum class TileKind : int32_t { kNarrow = 0, kWide = 1 };

struct AttentionWorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t q_token0;       // cu_seqlens_q[request]: the request's first row in q
  int32_t causal_offset;  // kv_len - q_len: query i sees keys [0, causal_offset + i]
  int32_t row_begin;      // first flattened row (query * group + head_in_group)
  int32_t num_rows;       // <= the tile's rows
  int32_t kv_begin;       // keys [kv_begin, kv_end) of this piece
  int32_t kv_end;
  int32_t kind;           // TileKind
  int32_t partial;        // -1: writes out directly; else its partial-result slot
};

// Combines the split pieces of one tile, whose partials sit in consecutive slots.
struct AttentionMergeItem {
  int32_t q_token0;
  int32_t kv_head;
  int32_t row_begin;
  int32_t num_rows;
  int32_t first_partial;
  int32_t num_partials;
};

// Words of the int32 header at the start of the plan buffer.
enum PlanHeaderField : int32_t {
  kPlanNumItems = 0,
  kPlanNumMerges = 1,
  kPlanNumPartials = 2,
  kPlanNumCtas = 3,
  kPlanHeaderWords = 8,
};

struct AttentionPlanCapacity {
  int64_t max_items = 0;
  int64_t max_merges = 0;
  int64_t max_partials = 0;
  int64_t num_ctas = 0;  // the fixed (persistent) grid of the attention kernel

  // int32 word offsets of each section inside one plan buffer; items and merges are
  // arrays of int32 structs, so 4-byte alignment is all they need.
  SRT_HOST_DEVICE int64_t cta_begin_offset() const { return kPlanHeaderWords; }
  SRT_HOST_DEVICE int64_t items_offset() const { return cta_begin_offset() + num_ctas + 1; }
  SRT_HOST_DEVICE int64_t merges_offset() const {
    return items_offset() + max_items * static_cast<int64_t>(sizeof(AttentionWorkItem) / 4);
  }
  SRT_HOST_DEVICE int64_t total_words() const {
    return merges_offset() + max_merges * static_cast<int64_t>(sizeof(AttentionMergeItem) / 4);
  }
};

// Worst-case sizes for any batch of at most max_batch requests and max_tokens query
// tokens: a request with R = q_len * group rows needs at most R / 64 + 1 tiles per KV
// head, and splitting happens only when there are fewer tiles than CTAs, where it makes
// fewer than two pieces per CTA.
AttentionPlanCapacity attention_plan_capacity(int64_t max_batch, int64_t max_tokens, int64_t num_q_heads,
                                              int64_t num_kv_heads, int64_t num_ctas);

struct AttentionPlanInputs {
  const int32_t* cu_seqlens_q = nullptr;  // host, [batch + 1]
  const int32_t* seqlens_k = nullptr;     // host, [batch]
  const int32_t* block_tables = nullptr;  // host, [batch, max_blocks_per_seq]
  int64_t batch = 0;
  int64_t total_q = 0;
  int64_t num_q_heads = 0;
  int64_t max_blocks_per_seq = 0;
  PagedKVLayout layout{};
};

// Validates the index arrays (errors name the argument) and fills `buffer` (capacity's
// total_words() int32 words) with the header, per-CTA item ranges, items and merges.
// Key ranges are split only when there are fewer tiles than CTAs.
Status build_attention_plan(const AttentionPlanInputs& in, const AttentionPlanCapacity& cap, int32_t* buffer);

}  // namespace sarathi_rt

#if defined(SARATHI_RT_WITH_CUDA)
namespace sarathi_rt {

// One planned step on the GPU. `p` holds device pointers (its cu_seqlens_q and seqlens_k
// are not read: the plan carries what the kernel needs); `plan` is the device copy of
// the buffer build_attention_plan filled. partial_out [max_partials, 64, head_dim] and
// partial_lse [max_partials, 64] (float32) hold split pieces until they are merged.
struct PlannedAttentionArgs {
  const int32_t* plan = nullptr;
  AttentionPlanCapacity capacity{};
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  int device = 0;  // the CUDA device every pointer lives on
};

Status hybrid_attention_cuda(const HybridAttentionParams& p, const PlannedAttentionArgs& plan, void* stream);

// CTAs of the attention kernel that fit on one SM of `device` (sizes the persistent grid).
Status attention_cuda_ctas_per_sm(int64_t head_dim, DType dtype, int device, int* ctas_per_sm);

}  // namespace sarathi_rt
#endif

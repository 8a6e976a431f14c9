// Host-side planner of the CUDA hybrid-attention launch (see attention_plan.h). Plain C++
// so the CPU tests cover the work list, split sizes and capacity errors.
#include "sarathi_rt/attention_plan.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace {

Status too_small(const char* what, int64_t needed, int64_t capacity) {
  return Status::Invalid(std::string("this batch needs ") + std::to_string(needed) + " " + what +
                         " but the plan holds " + std::to_string(capacity) +
                         "; create the plan with a larger max_batch / max_tokens");
}

int64_t tile_rows(TileKind kind) { return kind == TileKind::kNarrow ? kNarrowTileRows : kWideTileRows; }

// Relative run time of an item: keys streamed, twice for wide tiles (4x the math per
// key, partly hidden behind the loads), plus a fixed cost per CTA iteration.
int64_t item_cost(const AttentionWorkItem& w) {
  const int64_t chunks = ceil_div(w.kv_end - w.kv_begin, kKeysPerChunk);
  return chunks * (w.kind == static_cast<int32_t>(TileKind::kWide) ? 2 : 1) + 1;
}

std::vector<AttentionWorkItem> make_tiles(const AttentionPlanInputs& in) {
  const int64_t num_kv_heads = in.layout.num_kv_heads;
  const int64_t group = in.num_q_heads / num_kv_heads;
  std::vector<AttentionWorkItem> tiles;
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t q0 = in.cu_seqlens_q[b];
    const int64_t q_len = in.cu_seqlens_q[b + 1] - q0;
    const int64_t rows = q_len * group;
    if (rows == 0) continue;
    const TileKind kind = rows <= kNarrowTileRows ? TileKind::kNarrow : TileKind::kWide;
    const int64_t causal_offset = in.seqlens_k[b] - q_len;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t r = 0; r < rows; r += tile_rows(kind)) {
        const int64_t n = std::min(tile_rows(kind), rows - r);
        const int64_t last_query = (r + n - 1) / group;
        tiles.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(q0),
                         static_cast<int32_t>(causal_offset), static_cast<int32_t>(r), static_cast<int32_t>(n), 0,
                         static_cast<int32_t>(num_visible_keys(in.seqlens_k[b], q_len, last_query)),
                         static_cast<int32_t>(kind), -1});
      }
    }
  }
  return tiles;
}

// Splits long key ranges into chunk-aligned pieces of near-equal size so that about
// `target` items exist. Returns the pieces; fills merges and counts partial slots.
std::vector<AttentionWorkItem> split_tiles(const std::vector<AttentionWorkItem>& tiles, int64_t target,
                                           std::vector<AttentionMergeItem>& merges, int64_t& num_partials) {
  int64_t total_chunks = 0;
  for (const auto& t : tiles) total_chunks += ceil_div(t.kv_end, kKeysPerChunk);
  const int64_t split_chunks = std::max<int64_t>(kMinSplitChunks, ceil_div(total_chunks, target));
  std::vector<AttentionWorkItem> items;
  for (const auto& t : tiles) {
    const int64_t chunks = ceil_div(t.kv_end, kKeysPerChunk);
    const int64_t pieces = ceil_div(chunks, split_chunks);
    if (pieces <= 1) {
      items.push_back(t);
      continue;
    }
    const int64_t piece_keys = ceil_div(chunks, pieces) * kKeysPerChunk;
    const int32_t first = static_cast<int32_t>(num_partials);
    for (int64_t k0 = 0; k0 < t.kv_end; k0 += piece_keys) {
      AttentionWorkItem piece = t;
      piece.kv_begin = static_cast<int32_t>(k0);
      piece.kv_end = static_cast<int32_t>(std::min<int64_t>(k0 + piece_keys, t.kv_end));
      piece.partial = static_cast<int32_t>(num_partials++);
      items.push_back(piece);
    }
    merges.push_back({t.q_token0, t.kv_head, t.row_begin, t.num_rows, first,
                      static_cast<int32_t>(num_partials - first)});
  }
  return items;
}

// Longest-processing-time-first onto the CTAs; each CTA runs its items longest first.
void assign_to_ctas(std::vector<AttentionWorkItem>& items, int64_t num_ctas, int32_t* cta_begin) {
  std::vector<int64_t> cost(items.size());
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    cost[i] = item_cost(items[i]);
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  using Load = std::pair<int64_t, int64_t>;  // (load, cta): ties go to the lower CTA index
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap;
  for (int64_t c = 0; c < num_ctas; ++c) heap.push({0, c});
  std::vector<int64_t> cta_of(items.size());
  std::vector<int32_t> count(static_cast<size_t>(num_ctas), 0);
  for (size_t i : order) {
    auto [load, c] = heap.top();
    heap.pop();
    cta_of[i] = c;
    ++count[static_cast<size_t>(c)];
    heap.push({load + cost[i], c});
  }
  cta_begin[0] = 0;
  for (int64_t c = 0; c < num_ctas; ++c) cta_begin[c + 1] = cta_begin[c] + count[static_cast<size_t>(c)];
  std::vector<int32_t> next(cta_begin, cta_begin + num_ctas);
  std::vector<AttentionWorkItem> placed(items.size());
  for (size_t i : order) placed[static_cast<size_t>(next[static_cast<size_t>(cta_of[i])]++)] = items[i];
  items = std::move(placed);
}

}  // namespace

AttentionPlanCapacity attention_plan_capacity(int64_t max_batch, int64_t max_tokens, int64_t num_q_heads,
                                              int64_t num_kv_heads, int64_t num_ctas) {
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t max_tiles = num_kv_heads * (ceil_div(max_tokens * group, kWideTileRows) + max_batch);
  AttentionPlanCapacity cap;
  cap.num_ctas = num_ctas;
  cap.max_items = std::max(max_tiles, 2 * num_ctas);
  cap.max_merges = num_ctas;
  cap.max_partials = 2 * num_ctas;
  return cap;
}

Status build_attention_plan(const AttentionPlanInputs& in, const AttentionPlanCapacity& cap, int32_t* buffer) {
  if (in.num_q_heads <= 0 || in.layout.num_kv_heads <= 0 || in.num_q_heads % in.layout.num_kv_heads != 0) {
    return Status::Invalid("num_q_heads (" + std::to_string(in.num_q_heads) +
                           ") must be a positive multiple of the cache's num_kv_heads (" +
                           std::to_string(in.layout.num_kv_heads) + ")");
  }
  if (cap.num_ctas <= 0) return Status::Invalid("the plan needs at least one CTA");
  HybridAttentionParams p;
  p.cu_seqlens_q = in.cu_seqlens_q;
  p.seqlens_k = in.seqlens_k;
  p.block_tables = in.block_tables;
  p.batch = in.batch;
  p.total_q = in.total_q;
  p.num_q_heads = in.num_q_heads;
  p.max_blocks_per_seq = in.max_blocks_per_seq;
  p.layout = in.layout;
  Status st = validate_attention_indices(p);
  if (!st.ok()) return st;

  std::vector<AttentionWorkItem> items = make_tiles(in);
  if (static_cast<int64_t>(items.size()) > cap.max_items) return too_small("work items", items.size(), cap.max_items);
  std::vector<AttentionMergeItem> merges;
  int64_t num_partials = 0;
  if (!items.empty() && static_cast<int64_t>(items.size()) < cap.num_ctas) {
    items = split_tiles(items, cap.num_ctas, merges, num_partials);
  }
  if (static_cast<int64_t>(items.size()) > cap.max_items) return too_small("work items", items.size(), cap.max_items);
  if (static_cast<int64_t>(merges.size()) > cap.max_merges) return too_small("merges", merges.size(), cap.max_merges);
  if (num_partials > cap.max_partials) return too_small("partial slots", num_partials, cap.max_partials);

  assign_to_ctas(items, cap.num_ctas, buffer + cap.cta_begin_offset());
  std::copy(items.begin(), items.end(), reinterpret_cast<AttentionWorkItem*>(buffer + cap.items_offset()));
  std::copy(merges.begin(), merges.end(), reinterpret_cast<AttentionMergeItem*>(buffer + cap.merges_offset()));
  std::fill(buffer, buffer + kPlanHeaderWords, 0);
  buffer[kPlanNumItems] = static_cast<int32_t>(items.size());
  buffer[kPlanNumMerges] = static_cast<int32_t>(merges.size());
  buffer[kPlanNumPartials] = static_cast<int32_t>(num_partials);
  buffer[kPlanNumCtas] = static_cast<int32_t>(cap.num_ctas);
  return Status::Ok();
}

}  // namespace sarathi_rt

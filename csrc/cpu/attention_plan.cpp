// The one hybrid-attention planner (see attention_plan.h), for the CUDA and the CPU
// kernel alike. Plain C++ so the CPU tests cover the work list, split sizes, load balance
// and capacity errors of both.
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

// Splitting stops once the longest worker is within this factor of the mean: more pieces
// would buy little and cost merges.
constexpr double kGoodEnough = 0.95;

Status too_small(const char* what, int64_t needed, int64_t capacity) {
  return Status::Invalid(std::string("this batch needs ") + std::to_string(needed) + " " + what +
                         " but the plan holds " + std::to_string(capacity) +
                         "; create the plan with a larger max_batch / max_tokens");
}

int64_t chunk_cost(const AttentionTarget& t, const AttentionWorkItem& w) {
  return w.num_heads * (t.kind_cost[w.kind] + t.row_cost * w.num_rows);
}

int64_t item_cost(const AttentionTarget& t, const AttentionWorkItem& w) {
  return ceil_div(w.kv_end - w.kv_begin, t.key_chunk) * chunk_cost(t, w) + t.item_cost;
}

std::vector<AttentionWorkItem> make_tiles(const AttentionPlanInputs& in, const AttentionTarget& t) {
  const int64_t num_kv_heads = in.layout.num_kv_heads;
  const int64_t group = in.num_q_heads / num_kv_heads;
  std::vector<AttentionWorkItem> tiles;
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t q0 = in.cu_seqlens_q[b];
    const int64_t q_len = in.cu_seqlens_q[b + 1] - q0;
    const int64_t rows = q_len * group;
    if (rows == 0) continue;
    const TileKind kind = rows <= t.narrow_rows ? TileKind::kNarrow : TileKind::kWide;
    const int64_t step = kind == TileKind::kNarrow ? t.narrow_rows : t.wide_rows;
    const bool all_heads = kind == TileKind::kNarrow && t.narrow_spans_heads;
    const int64_t causal_offset = in.seqlens_k[b] - q_len;
    for (int64_t h = 0; h < num_kv_heads; h += all_heads ? num_kv_heads : 1) {
      for (int64_t r = 0; r < rows; r += step) {
        const int64_t n = std::min(step, rows - r);
        const int64_t last_query = (r + n - 1) / group;
        tiles.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h),
                         static_cast<int32_t>(all_heads ? num_kv_heads : 1), static_cast<int32_t>(q0),
                         static_cast<int32_t>(causal_offset), static_cast<int32_t>(r), static_cast<int32_t>(n), 0,
                         static_cast<int32_t>(num_visible_keys(in.seqlens_k[b], q_len, last_query)),
                         static_cast<int32_t>(kind), -1});
      }
    }
  }
  return tiles;
}

// One candidate work list and its assignment to the workers.
struct Candidate {
  std::vector<AttentionWorkItem> items;  // grouped by worker, each worker's longest first
  std::vector<AttentionMergeItem> merges;
  std::vector<int32_t> worker_begin;     // [workers + 1]
  int64_t num_partials = 0;
  int64_t max_load = 0;
  int64_t total_load = 0;
  double efficiency() const {
    const int64_t workers = static_cast<int64_t>(worker_begin.size()) - 1;
    return max_load == 0 ? 1.0 : static_cast<double>(total_load) / (static_cast<double>(workers) * max_load);
  }
};

// Cuts every tile that costs more than `piece_cost` into near-equal chunk-aligned key
// ranges (only the last one ragged), none shorter than min_split_chunks chunks. False
// when the pieces would not fit the plan's capacity.
bool split_tiles(const std::vector<AttentionWorkItem>& tiles, const AttentionTarget& t, int64_t piece_cost,
                 const AttentionPlanCapacity& cap, Candidate& c) {
  for (const auto& tile : tiles) {
    const int64_t chunks = ceil_div(tile.kv_end, t.key_chunk);
    const int64_t pieces = std::min(ceil_div(item_cost(t, tile), piece_cost), chunks / t.min_split_chunks);
    if (pieces <= 1) {
      c.items.push_back(tile);
      continue;
    }
    const int64_t piece_keys = ceil_div(chunks, pieces) * t.key_chunk;
    const int32_t first = static_cast<int32_t>(c.num_partials);
    for (int64_t k0 = 0; k0 < tile.kv_end; k0 += piece_keys) {
      AttentionWorkItem piece = tile;
      piece.kv_begin = static_cast<int32_t>(k0);
      piece.kv_end = static_cast<int32_t>(std::min<int64_t>(k0 + piece_keys, tile.kv_end));
      piece.partial = static_cast<int32_t>(c.num_partials++);
      c.items.push_back(piece);
    }
    c.merges.push_back({tile.q_token0, tile.kv_head, tile.num_heads, tile.row_begin, tile.num_rows, first,
                        static_cast<int32_t>(c.num_partials - first)});
    if (c.num_partials > cap.max_partials || static_cast<int64_t>(c.merges.size()) > cap.max_merges) return false;
  }
  return static_cast<int64_t>(c.items.size()) <= cap.max_items;
}

// Longest-processing-time-first onto the workers; each worker runs its items longest first.
void assign_to_workers(const AttentionTarget& t, Candidate& c) {
  std::vector<AttentionWorkItem>& items = c.items;
  std::vector<int64_t> cost(items.size());
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    cost[i] = item_cost(t, items[i]);
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  using Load = std::pair<int64_t, int64_t>;  // (load, worker): ties go to the lower index
  std::vector<Load> start(static_cast<size_t>(t.num_workers));
  for (int64_t w = 0; w < t.num_workers; ++w) start[static_cast<size_t>(w)] = {0, w};
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap(std::greater<Load>(), std::move(start));
  std::vector<int64_t> worker_of(items.size());
  std::vector<int32_t> count(static_cast<size_t>(t.num_workers), 0);
  c.total_load = 0;
  for (size_t i : order) {
    auto [load, w] = heap.top();
    heap.pop();
    worker_of[i] = w;
    ++count[static_cast<size_t>(w)];
    heap.push({load + cost[i], w});
    c.total_load += cost[i];
    c.max_load = std::max(c.max_load, load + cost[i]);
  }
  c.worker_begin.assign(static_cast<size_t>(t.num_workers) + 1, 0);
  for (int64_t w = 0; w < t.num_workers; ++w) {
    c.worker_begin[static_cast<size_t>(w) + 1] = c.worker_begin[static_cast<size_t>(w)] + count[static_cast<size_t>(w)];
  }
  std::vector<int32_t> next(c.worker_begin.begin(), c.worker_begin.end() - 1);
  std::vector<AttentionWorkItem> placed(items.size());
  for (size_t i : order) placed[static_cast<size_t>(next[static_cast<size_t>(worker_of[i])]++)] = items[i];
  items = std::move(placed);
}

}  // namespace

AttentionTarget attention_target(AttentionKernel kernel, int64_t num_workers) {
  AttentionTarget t;
  t.kernel = kernel;
  t.num_workers = num_workers;
  t.wide_rows = kWideTileRows;
  t.key_chunk = kKeysPerChunk;
  if (kernel == AttentionKernel::kCuda) {
    t.narrow_rows = kNarrowTileRows;
    t.min_split_chunks = kMinSplitChunks;
    t.kind_cost[0] = 1;
    t.kind_cost[1] = 2;  // 4x the math per key of a narrow tile, partly hidden behind the loads
    t.item_cost = 1;
  } else {
    t.narrow_rows = kCpuDirectRows;
    t.narrow_spans_heads = true;
    t.min_split_chunks = kCpuMinSplitChunks;
    t.kind_cost[0] = t.kind_cost[1] = 16;  // loading a chunk costs about as much as 16 rows' math
    t.row_cost = 1;
    t.item_cost = 16;
  }
  return t;
}

AttentionPlanCapacity attention_plan_capacity(int64_t max_batch, int64_t max_tokens, int64_t num_q_heads,
                                              int64_t num_kv_heads, const AttentionTarget& target) {
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t max_tiles = num_kv_heads * (ceil_div(max_tokens * group, target.wide_rows) + max_batch);
  AttentionPlanCapacity cap;
  cap.num_ctas = target.num_workers;
  cap.kernel = target.kernel;
  cap.max_partials = kMaxPiecesPerWorker * target.num_workers;
  cap.max_merges = cap.max_partials / 2;  // a split tile has at least two pieces
  cap.max_items = max_tiles + cap.max_partials;
  return cap;
}

Status build_attention_plan(const AttentionPlanInputs& in, const AttentionPlanCapacity& cap, int32_t* buffer) {
  if (in.num_q_heads <= 0 || in.layout.num_kv_heads <= 0 || in.num_q_heads % in.layout.num_kv_heads != 0) {
    return Status::Invalid("num_q_heads (" + std::to_string(in.num_q_heads) +
                           ") must be a positive multiple of the cache's num_kv_heads (" +
                           std::to_string(in.layout.num_kv_heads) + ")");
  }
  if (cap.num_ctas <= 0) return Status::Invalid("the plan needs at least one worker");
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

  const AttentionTarget t = attention_target(cap.kernel, cap.num_ctas);
  const std::vector<AttentionWorkItem> tiles = make_tiles(in, t);
  if (static_cast<int64_t>(tiles.size()) > cap.max_items) return too_small("work items", tiles.size(), cap.max_items);
  Candidate best;
  best.items = tiles;
  assign_to_workers(t, best);
  // Piece sizes total / (k * workers): k = 1 cuts every tile longer than a worker's share;
  // larger k trade more pieces (and merges) for whole waves of near-equal work.
  const int64_t total = best.total_load;
  size_t last_size = tiles.size();
  for (int64_t k = 1; k <= kMaxPiecesPerWorker && best.efficiency() < kGoodEnough; ++k) {
    Candidate c;
    if (!split_tiles(tiles, t, std::max<int64_t>(1, ceil_div(total, k * t.num_workers)), cap, c)) break;
    if (c.items.size() == last_size) continue;
    last_size = c.items.size();
    assign_to_workers(t, c);
    if (c.max_load < best.max_load) best = std::move(c);
  }

  std::copy(best.worker_begin.begin(), best.worker_begin.end(), buffer + cap.cta_begin_offset());
  std::copy(best.items.begin(), best.items.end(), reinterpret_cast<AttentionWorkItem*>(buffer + cap.items_offset()));
  std::copy(best.merges.begin(), best.merges.end(),
            reinterpret_cast<AttentionMergeItem*>(buffer + cap.merges_offset()));
  std::fill(buffer, buffer + kPlanHeaderWords, 0);
  buffer[kPlanNumItems] = static_cast<int32_t>(best.items.size());
  buffer[kPlanNumMerges] = static_cast<int32_t>(best.merges.size());
  buffer[kPlanNumPartials] = static_cast<int32_t>(best.num_partials);
  buffer[kPlanNumCtas] = static_cast<int32_t>(cap.num_ctas);
  buffer[kPlanKernel] = static_cast<int32_t>(cap.kernel);
  return Status::Ok();
}

AttentionPlanStats attention_plan_stats(const int32_t* buffer, const AttentionPlanCapacity& cap) {
  const AttentionTarget t = attention_target(cap.kernel, cap.num_ctas);
  const int32_t* begin = buffer + cap.cta_begin_offset();
  const auto* items = reinterpret_cast<const AttentionWorkItem*>(buffer + cap.items_offset());
  AttentionPlanStats s;
  s.num_items = buffer[kPlanNumItems];
  s.num_splits = buffer[kPlanNumMerges];
  s.num_partials = buffer[kPlanNumPartials];
  for (int64_t w = 0; w < cap.num_ctas; ++w) {
    int64_t load = 0;
    for (int32_t i = begin[w]; i < begin[w + 1]; ++i) load += item_cost(t, items[i]);
    s.max_load = std::max(s.max_load, load);
    s.total_load += load;
  }
  return s;
}

}  // namespace sarathi_rt

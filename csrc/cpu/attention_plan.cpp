// The one hybrid-attention planner (see attention_plan.h), for the CUDA and the CPU
// kernel alike. Plain C++ so the CPU tests cover the work list, split sizes, load balance
// and capacity errors of both.
#include "sarathi_rt/attention_plan.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace {

// Piece sizes tried: total / (k * workers). Dense where a few more pieces per worker
// change the wave count a lot, sparse beyond.
constexpr int64_t kPieceSteps[] = {1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64};

// The search stops once the costliest worker is within 1% of the mean: a finer split
// could gain less than that and costs planning time, merges and partial memory.
constexpr double kGoodEnough = 0.99;

bool good_enough(int64_t max_load, int64_t total_load, int64_t workers) {
  return static_cast<double>(total_load) >= kGoodEnough * static_cast<double>(workers) * static_cast<double>(max_load);
}

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

// Key chunks of a tile's range (kv_begin sits on a chunk boundary).
int64_t tile_chunks(const AttentionTarget& t, const AttentionWorkItem& w) {
  return ceil_div(w.kv_end - w.kv_begin, t.key_chunk);
}

// Narrow tiles carry `heads` KV heads each (heads divides num_kv_heads); wide tiles one.
std::vector<AttentionWorkItem> make_tiles(const AttentionPlanInputs& in, const AttentionTarget& t, int64_t heads) {
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
    const int64_t item_heads = kind == TileKind::kNarrow ? heads : 1;
    const int64_t causal_offset = in.seqlens_k[b] - q_len;
    for (int64_t h = 0; h < num_kv_heads; h += item_heads) {
      for (int64_t r = 0; r < rows; r += step) {
        const int64_t n = std::min(step, rows - r);
        const int64_t last_query = (r + n - 1) / group;
        // A window starts the tile at the chunk of its first query's first key (later
        // queries' windows start later): the keys before it are never read.
        const int64_t first_key =
            first_visible_key(num_visible_keys(in.seqlens_k[b], q_len, r / group), in.window);
        tiles.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(item_heads),
                         static_cast<int32_t>(q0), static_cast<int32_t>(causal_offset), static_cast<int32_t>(r),
                         static_cast<int32_t>(n), static_cast<int32_t>(first_key / t.key_chunk * t.key_chunk),
                         static_cast<int32_t>(num_visible_keys(in.seqlens_k[b], q_len, last_query)),
                         static_cast<int32_t>(kind), -1});
      }
    }
  }
  return tiles;
}

// One candidate work list and its assignment to the workers.
struct Candidate {
  std::vector<AttentionWorkItem> items;
  std::vector<AttentionMergeItem> merges;
  std::vector<int32_t> worker_of;  // per item, after assign_to_workers
  int64_t partial_rows = 0;
  int64_t max_load = 0;
  int64_t total_load = 0;

  // Lower max load first; then fewer partial rows (less memory, fewer merges); then fewer items.
  bool better_than(const Candidate& o) const {
    if (max_load != o.max_load) return max_load < o.max_load;
    if (partial_rows != o.partial_rows) return partial_rows < o.partial_rows;
    return items.size() < o.items.size();
  }
};

// How a piece cost cuts the tiles, counted before any item is written: every tile that
// costs more than `piece_cost` becomes that many key ranges (never shorter than
// min_split_chunks chunks), and the candidate's size, partial rows and load bounds follow.
struct SplitCounts {
  std::vector<int32_t> pieces;  // per tile; 1 = kept whole
  int64_t num_items = 0;
  int64_t num_pieces = 0;    // items of cut tiles
  int64_t num_merges = 0;    // cut tiles
  int64_t partial_rows = 0;
  int64_t total_load = 0;    // every cut adds one item_cost to the tiles' total
  int64_t max_item = 0;      // the costliest item: its worker carries at least this much
};

SplitCounts count_splits(const std::vector<AttentionWorkItem>& tiles, const AttentionTarget& t, int64_t piece_cost) {
  SplitCounts n;
  n.pieces.resize(tiles.size());
  for (size_t i = 0; i < tiles.size(); ++i) {
    const AttentionWorkItem& tile = tiles[i];
    const int64_t chunks = tile_chunks(t, tile);
    const int64_t cost = item_cost(t, tile);
    const int64_t pieces = std::max<int64_t>(1, std::min(ceil_div(cost, piece_cost), chunks / t.min_split_chunks));
    n.pieces[i] = static_cast<int32_t>(pieces);
    n.num_items += pieces;
    n.total_load += cost + (pieces - 1) * t.item_cost;
    // Pieces differ by at most one chunk: the longest has ceil(chunks / pieces).
    n.max_item = std::max(n.max_item, pieces == 1 ? cost : ceil_div(chunks, pieces) * chunk_cost(t, tile) + t.item_cost);
    if (pieces > 1) {
      n.num_pieces += pieces;
      n.num_merges += 1;
      n.partial_rows += pieces * tile.num_heads * tile.num_rows;
    }
  }
  return n;
}

// Whether the cut fits the plan's capacity (the planner only picks splits that fit).
bool fits(const SplitCounts& n, const AttentionTarget& t, const AttentionPlanCapacity& cap) {
  return n.partial_rows <= cap.max_partial_rows && n.num_pieces <= kMaxPiecesPerWorker * t.num_workers &&
         n.num_merges <= cap.max_merges && n.num_items <= cap.max_items;
}

// Writes the counted cut: near-equal whole chunks per piece (sizes differ by at most one
// chunk; the last one ends at the tile's last key), each piece with its partial rows.
void split_tiles(const std::vector<AttentionWorkItem>& tiles, const AttentionTarget& t, const SplitCounts& n,
                 Candidate& c) {
  c.items.reserve(static_cast<size_t>(n.num_items));
  c.merges.reserve(static_cast<size_t>(n.num_merges));
  for (size_t i = 0; i < tiles.size(); ++i) {
    const AttentionWorkItem& tile = tiles[i];
    const int64_t pieces = n.pieces[i];
    if (pieces == 1) {
      c.items.push_back(tile);
      continue;
    }
    const int64_t chunks = tile_chunks(t, tile);
    const int64_t rows = static_cast<int64_t>(tile.num_heads) * tile.num_rows;
    c.merges.push_back({tile.q_token0, tile.kv_head, tile.num_heads, tile.row_begin, tile.num_rows,
                        static_cast<int32_t>(c.partial_rows), static_cast<int32_t>(pieces)});
    for (int64_t p = 0; p < pieces; ++p) {
      AttentionWorkItem piece = tile;
      piece.kv_begin = static_cast<int32_t>(tile.kv_begin + p * chunks / pieces * t.key_chunk);
      piece.kv_end = p + 1 == pieces ? tile.kv_end
                                     : static_cast<int32_t>(tile.kv_begin + (p + 1) * chunks / pieces * t.key_chunk);
      piece.partial = static_cast<int32_t>(c.partial_rows);
      c.partial_rows += rows;
      c.items.push_back(piece);
    }
  }
}

// Longest-processing-time-first onto the workers (ties go to the lower index). Gives up,
// returning false, once a worker reaches `bound`: the candidate cannot beat the best one.
bool assign_to_workers(const AttentionTarget& t, Candidate& c, int64_t bound) {
  const std::vector<AttentionWorkItem>& items = c.items;
  std::vector<std::pair<int64_t, int32_t>> order(items.size());  // (cost, item)
  for (size_t i = 0; i < items.size(); ++i) order[i] = {item_cost(t, items[i]), static_cast<int32_t>(i)};
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  using Load = std::pair<int64_t, int64_t>;  // (load, worker)
  std::vector<Load> start(static_cast<size_t>(t.num_workers));
  for (int64_t w = 0; w < t.num_workers; ++w) start[static_cast<size_t>(w)] = {0, w};
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap(std::greater<Load>(), std::move(start));
  c.worker_of.assign(items.size(), 0);
  c.total_load = 0;
  c.max_load = 0;
  for (const auto& [cost, i] : order) {
    auto [load, w] = heap.top();
    heap.pop();
    c.worker_of[static_cast<size_t>(i)] = static_cast<int32_t>(w);
    heap.push({load + cost, w});
    c.total_load += cost;
    c.max_load = std::max(c.max_load, load + cost);
    if (c.max_load >= bound) return false;
  }
  return true;
}

// Writes the winner: items grouped by worker, each worker's longest first.
void write_plan(const AttentionTarget& t, const Candidate& c, const AttentionPlanCapacity& cap, int64_t window,
                int32_t* buffer) {
  std::vector<std::pair<int64_t, int32_t>> order(c.items.size());
  for (size_t i = 0; i < c.items.size(); ++i) order[i] = {item_cost(t, c.items[i]), static_cast<int32_t>(i)};
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  int32_t* begin = buffer + cap.cta_begin_offset();
  std::fill(begin, begin + t.num_workers + 1, 0);
  for (int32_t w : c.worker_of) ++begin[w + 1];
  for (int64_t w = 0; w < t.num_workers; ++w) begin[w + 1] += begin[w];
  std::vector<int32_t> next(begin, begin + t.num_workers);
  auto* items = reinterpret_cast<AttentionWorkItem*>(buffer + cap.items_offset());
  for (const auto& [cost, i] : order) items[next[static_cast<size_t>(c.worker_of[i])]++] = c.items[i];
  std::copy(c.merges.begin(), c.merges.end(), reinterpret_cast<AttentionMergeItem*>(buffer + cap.merges_offset()));
  std::fill(buffer, buffer + kPlanHeaderWords, 0);
  buffer[kPlanNumItems] = static_cast<int32_t>(c.items.size());
  buffer[kPlanNumMerges] = static_cast<int32_t>(c.merges.size());
  buffer[kPlanNumPartialRows] = static_cast<int32_t>(c.partial_rows);
  buffer[kPlanNumCtas] = static_cast<int32_t>(cap.num_ctas);
  buffer[kPlanKernel] = static_cast<int32_t>(cap.kernel);
  buffer[kPlanWindow] = static_cast<int32_t>(window);
}

}  // namespace

AttentionTarget attention_target(AttentionKernel kernel, int64_t num_workers) {
  AttentionTarget t;
  t.kernel = kernel;
  t.num_workers = num_workers;
  t.wide_rows = kWideTileRows;
  t.key_chunk = kKeysPerChunk;
  if (kernel == AttentionKernel::kCuda) {  // see the cost model in attention_plan.h
    t.narrow_rows = kNarrowTileRows;
    t.max_item_heads = 1;  // the kernel's tiles hold one KV head's rows
    t.min_split_chunks = kMinSplitChunks;
    t.kind_cost[0] = 3;  // K/V load 2 + one 16-row MMA tile
    t.kind_cost[1] = 6;  // K/V load 2 + four 16-row MMA tiles
    t.item_cost = 3;     // Q and the first stage before any math, the epilogue: about one narrow chunk
  } else {
    t.narrow_rows = kCpuDirectRows;
    t.max_item_heads = std::numeric_limits<int32_t>::max();
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
  // The most rows one piece can have: a wide tile, or a narrow item of every KV head it may carry.
  const int64_t rows_per_head = std::min(max_tokens * group, target.wide_rows);
  const int64_t piece_rows = std::max(rows_per_head, std::min(max_tokens * group, target.narrow_rows) *
                                                         std::min(num_kv_heads, target.max_item_heads));
  const int64_t max_pieces = kMaxPiecesPerWorker * target.num_workers;
  AttentionPlanCapacity cap;
  cap.num_ctas = target.num_workers;
  cap.kernel = target.kernel;
  cap.max_partial_rows = std::min(kPartialRowsPerWorker * target.num_workers, max_pieces * piece_rows);
  cap.max_merges = max_pieces / 2;  // a split tile has at least two pieces
  cap.max_items = max_tiles + max_pieces;
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
  p.window = in.window;
  Status st = validate_attention_options(p);
  if (st.ok()) st = validate_attention_indices(p);
  if (!st.ok()) return st;

  const AttentionTarget t = attention_target(cap.kernel, cap.num_ctas);
  const int64_t num_kv_heads = in.layout.num_kv_heads;
  Candidate best;
  bool have_best = false;
  // Coarsest head granularity first: at equal max load, fewer items win.
  for (int64_t heads = std::min(num_kv_heads, t.max_item_heads); heads >= 1; --heads) {
    if (num_kv_heads % heads != 0) continue;
    if (have_best && good_enough(best.max_load, best.total_load, t.num_workers)) break;
    const std::vector<AttentionWorkItem> tiles = make_tiles(in, t, heads);
    if (static_cast<int64_t>(tiles.size()) > cap.max_items) {
      if (heads == 1) return too_small("work items", tiles.size(), cap.max_items);
      continue;
    }
    Candidate whole;
    whole.items = tiles;
    assign_to_workers(t, whole, std::numeric_limits<int64_t>::max());
    const int64_t total = whole.total_load;  // piece sizes are shares of the unsplit work
    if (!have_best || whole.better_than(best)) best = std::move(whole), have_best = true;
    int64_t last_size = static_cast<int64_t>(tiles.size());
    for (int64_t k : kPieceSteps) {
      if (good_enough(best.max_load, best.total_load, t.num_workers)) break;
      const SplitCounts n = count_splits(tiles, t, std::max<int64_t>(1, ceil_div(total, k * t.num_workers)));
      if (!fits(n, t, cap)) break;  // finer cuts need more
      if (n.num_items == last_size) continue;
      last_size = n.num_items;
      // No assignment beats total / workers nor its costliest item. Finer cuts only add
      // item_cost to the total, so once the mean exceeds the best max load nothing finer
      // can win (this ends the search on most batches long before the finest steps, whose
      // thousands of pieces cost the most to assign); a costliest item above it rules out
      // only this cut. Both bounds are exact: they skip no candidate that could win.
      if (ceil_div(n.total_load, t.num_workers) > best.max_load) break;
      if (n.max_item > best.max_load) continue;
      Candidate c;
      split_tiles(tiles, t, n, c);
      if (assign_to_workers(t, c, best.max_load + 1) && c.better_than(best)) best = std::move(c);
    }
  }
  write_plan(t, best, cap, in.window, buffer);
  return Status::Ok();
}

int64_t attention_partial_row_floats(AttentionKernel kernel, int64_t head_dim) {
  return kernel == AttentionKernel::kCuda ? head_dim + 1 : ceil_div(head_dim, kCpuVectorLanes) * kCpuVectorLanes + 2;
}

int64_t attention_partial_bytes(AttentionKernel kernel, int64_t head_dim, int64_t partial_rows) {
  return partial_rows * attention_partial_row_floats(kernel, head_dim) * static_cast<int64_t>(sizeof(float));
}

AttentionPlanStats attention_plan_stats(const int32_t* buffer, const AttentionPlanCapacity& cap, int64_t head_dim) {
  const AttentionTarget t = attention_target(cap.kernel, cap.num_ctas);
  const int32_t* begin = buffer + cap.cta_begin_offset();
  const auto* items = reinterpret_cast<const AttentionWorkItem*>(buffer + cap.items_offset());
  AttentionPlanStats s;
  s.num_items = buffer[kPlanNumItems];
  s.num_splits = buffer[kPlanNumMerges];
  s.partial_rows = buffer[kPlanNumPartialRows];
  s.partial_bytes = attention_partial_bytes(cap.kernel, head_dim, s.partial_rows);
  const auto* merges = reinterpret_cast<const AttentionMergeItem*>(buffer + cap.merges_offset());
  for (int64_t m = 0; m < s.num_splits; ++m) s.num_partials += merges[m].num_partials;
  for (int64_t w = 0; w < cap.num_ctas; ++w) {
    int64_t load = 0;
    for (int32_t i = begin[w]; i < begin[w + 1]; ++i) load += item_cost(t, items[i]);
    s.max_load = std::max(s.max_load, load);
    s.total_load += load;
  }
  return s;
}

}  // namespace sarathi_rt

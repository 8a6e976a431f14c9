// The hybrid-attention plan: built once per step on the host from cu_seqlens_q and
// seqlens_k and read by the attention of every layer, on the GPU (copied to the device
// once) and on the CPU alike. One planner serves both kernels; an AttentionTarget
// describes the kernel that will run the plan (its tile shapes, its parallel workers and
// the cost model the planner balances them with).
//
// A request's query rows are flattened as row = query * group + head_in_group, so the
// query heads that share one KV head also share every K/V tile loaded from the pages.
// A work item is one tile of those rows, for one or more KV heads, against a range of
// keys. Requests with few rows per KV head (decodes) become "narrow" tiles; the others
// are cut into "wide" tiles. The planner chooses the granularity: how many KV heads a
// narrow item carries (where the kernel can run several) and into how many key ranges a
// tile is cut. Each piece of a cut tile writes a partial result and its log-sum-exp into
// a pool of partial rows, and a merge item combines the pieces of one tile.
//
// Cost model (the planner's only notion of time; stats() reports it). A work item costs
//
//   cost = item_cost + ceil(keys / key_chunk) * heads * (kind_cost[kind] + row_cost * rows)
//
// keys: the item's key range; heads: its KV heads; rows: its query rows per head.
//   CUDA (16/64-row tiles, 64-key chunks, one KV head per item): a chunk costs its K/V
//   load plus one MMA pass per 16-row tile: narrow = load 2 + 1 row tile = 3, wide = load
//   2 + 4 row tiles = 6, so row_cost = 0 (a tile pays for all its MMA rows, used or not).
//   Why load = 2 and an MMA row tile = 1: a 64-key chunk of one head at head_dim 128 is
//   32 KB of bf16 K and V; at an H100's ~3.3 TB/s shared by 264 CTAs that is ~2.6 us,
//   while one 16-row tile's QK^T and PV (0.5 MFLOP) takes ~0.15 us of a CTA's share of
//   peak tensor throughput, ~1 us at the mma.sync efficiency this kernel reaches with
//   K/V in shared memory; loads and math overlap only partly (two stages). A wide chunk
//   (4 row tiles) thus costs about twice a narrow one. item_cost = 3 (one narrow chunk):
//   loading Q and the first K/V stage before any math, and the epilogue (normalize,
//   store, the warp merge of narrow tiles), is about one chunk's latency.
//   CPU (items may carry every KV head; 8-row direct path): a chunk costs 16 for reading
//   a head's keys and values plus 1 per row (one dot product and one axpy per key), and
//   an item 16 (scratch setup); fitted on bench_attention's mixed batch.
// Only ratios matter: the planner minimizes the costliest worker. How this is checked on
// a GPU: bench/bench_attention_cost.py (run by bench/device_check.sh) times the planned
// kernel, in a CUDA graph, on batches of one item kind (all narrow or all wide), 1..64
// chunks per item and 1 or 4 items per CTA, and fits time = launch + a * items + b * chunks
// per kind over the costliest CTA; the model holds while b_wide / b_narrow stays within
// 1.5..2.5 and a / b_narrow within 0.5..2, the ratios its summary rows print against the
// model's own (see bench/RESULTS.md for the last measured fit). Outside that, change the
// constants in attention_target(), nothing else.
//
// The work list has a capacity fixed when the plan is created, so its device buffer never
// moves. The partial-result pool is sized from each plan (attention_partial_bytes): it is
// the caller's buffer (python/sarathi_rt/ops/attention_plan.py says how it grows and what
// a CUDA graph capture needs).
#pragma once

#include <cstdint>

#include "sarathi_rt/common.h"
#include "sarathi_rt/kv_ops.h"
#include "sarathi_rt/paged_kv.h"

namespace sarathi_rt {

// Tile shapes of the CUDA kernel (attention_kernel.cuh): 16 narrow rows, where the 4 warps
// of a CTA split the keys; 64 wide rows, where the warps split the rows.
constexpr int32_t kNarrowTileRows = 16;
constexpr int32_t kWideTileRows = 64;
constexpr int32_t kKeysPerChunk = 64;    // keys loaded per pipeline stage of the CUDA kernel
constexpr int32_t kMinSplitChunks = 4;   // a CUDA split piece covers at least this many chunks
constexpr int32_t kCpuDirectRows = 8;    // CPU: rows per KV head up to which pages are read directly
constexpr int32_t kCpuMinSplitChunks = 16;  // CPU: a split piece covers at least 1024 keys
// Split pieces per worker (bounds items and merges) and partial rows per worker (bounds the
// rows a plan may use; the pool holds what the plan uses, see attention_partial_bytes):
// the planner only picks splits that fit, and a batch needing more pieces than this per
// worker is already balanced by its unsplit tiles.
constexpr int64_t kMaxPiecesPerWorker = 32;
constexpr int64_t kPartialRowsPerWorker = 512;
constexpr int64_t kCpuVectorLanes = 16;  // the CPU kernel pads head_dim to this many floats
constexpr int64_t kCpuKeyChunk = 32;     // keys per online-softmax step of the CPU kernel

// Rows one CPU work item or merge may hold (the kernel's per-thread scratch is this tall):
// a wide tile, or the direct rows of every KV head of a decode item.
inline int64_t cpu_attention_max_rows(int64_t num_kv_heads) {
  return num_kv_heads * kCpuDirectRows > kWideTileRows ? num_kv_heads * kCpuDirectRows : kWideTileRows;
}

enum class TileKind : int32_t { kNarrow = 0, kWide = 1 };
enum class AttentionKernel : int32_t { kCuda = 0, kCpu = 1 };

// What the planner knows of the kernel that runs the plan.
struct AttentionTarget {
  AttentionKernel kernel = AttentionKernel::kCuda;
  int64_t num_workers = 0;      // CUDA: CTAs of the persistent grid; CPU: about the threads
  int64_t narrow_rows = 0;      // a request with at most this many rows per KV head is narrow
  int64_t wide_rows = 0;        // rows per wide tile
  int64_t max_item_heads = 1;   // KV heads one narrow item may carry (the CPU kernel reads token rows)
  int64_t key_chunk = 0;        // split pieces start at multiples of this many keys (the cost unit)
  int64_t min_split_chunks = 0;
  // Cost of an item: per chunk and KV head, kind_cost[kind] + row_cost * rows; plus item_cost.
  int64_t kind_cost[2] = {0, 0};
  int64_t row_cost = 0;
  int64_t item_cost = 0;
};

// CUDA: 16/64-row tiles, streaming 64-key chunks, wide tiles twice the cost of narrow
// ones. CPU: decodes read every KV head's keys in one item; a chunk costs a fixed part
// for loading it plus one per row (measured on bench_attention's mixed batch).
AttentionTarget attention_target(AttentionKernel kernel, int64_t num_workers);

// Workers of a CPU plan by default: two per OpenMP thread, so that a lone long decode is
// cut into a few pieces that threads take in turn (the CPU kernel schedules items
// dynamically; the workers size the splits).
int64_t cpu_attention_workers();

struct AttentionWorkItem {
  int32_t request;
  int32_t kv_head;        // first KV head
  int32_t num_heads;      // KV heads kv_head .. kv_head + num_heads (1 on CUDA)
  int32_t q_token0;       // cu_seqlens_q[request]: the request's first row in q
  int32_t causal_offset;  // kv_len - q_len: query i sees keys [0, causal_offset + i] (a window
                          // drops the early ones: first_visible_key)
  int32_t row_begin;      // first flattened row (query * group + head_in_group), per head
  int32_t num_rows;       // rows per head, <= the tile's rows
  int32_t kv_begin;       // keys [kv_begin, kv_end) of this piece
  int32_t kv_end;
  int32_t kind;           // TileKind
  int32_t partial;        // -1: writes out directly; else the first of its num_heads * num_rows
                          // partial rows (head-major, as ItemRows order them)
};

// Combines the split pieces of one tile: piece s holds partial rows
// first_partial + s * num_heads * num_rows onwards.
struct AttentionMergeItem {
  int32_t q_token0;
  int32_t kv_head;
  int32_t num_heads;
  int32_t row_begin;
  int32_t num_rows;
  int32_t first_partial;
  int32_t num_partials;
};

// Words of the int32 header at the start of the plan buffer.
enum PlanHeaderField : int32_t {
  kPlanNumItems = 0,
  kPlanNumMerges = 1,
  kPlanNumPartialRows = 2,
  kPlanNumCtas = 3,
  kPlanKernel = 4,  // the AttentionKernel it was built for
  kPlanWindow = 5,  // the sliding window it was built for (0 = full attention)
  kPlanHeaderWords = 8,
};

struct AttentionPlanCapacity {
  int64_t max_items = 0;
  int64_t max_merges = 0;
  int64_t max_partial_rows = 0;
  int64_t num_ctas = 0;  // workers: the fixed (persistent) grid of the CUDA kernel (see AttentionTarget)
  AttentionKernel kernel = AttentionKernel::kCuda;

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
// tokens: a request with R = q_len * group rows needs at most R / wide_rows + 1 tiles per
// KV head; splits use at most kMaxPiecesPerWorker pieces per worker, and partial rows for
// kPartialRowsPerWorker rows per worker or for that many pieces of the largest item the
// batch can have, whichever is less (the planner only picks splits that fit).
AttentionPlanCapacity attention_plan_capacity(int64_t max_batch, int64_t max_tokens, int64_t num_q_heads,
                                              int64_t num_kv_heads, const AttentionTarget& target);

struct AttentionPlanInputs {
  const int32_t* cu_seqlens_q = nullptr;  // host, [batch + 1]
  const int32_t* seqlens_k = nullptr;     // host, [batch]
  const int32_t* block_tables = nullptr;  // host, [batch, max_blocks_per_seq]
  int64_t batch = 0;
  int64_t total_q = 0;
  int64_t num_q_heads = 0;
  int64_t max_blocks_per_seq = 0;
  // Sliding window (0 = none): each tile's key range starts at the chunk holding the
  // first key its first query sees, so a decode over L keys with window W reads about W
  // keys, not L. The kernel masks each row to its own window inside that range.
  int64_t window = 0;
  PagedKVLayout layout{};
};

// Validates the index arrays (errors name the argument) and fills `buffer` (capacity's
// total_words() int32 words) with the header, per-worker item ranges, items and merges,
// for the target attention_target(cap.kernel, cap.num_ctas). The granularity is searched
// against the resulting max load: for each number of KV heads per narrow item the kernel
// allows, tiles are cut into near-equal key ranges no costlier than total / (k * workers)
// for k = 1, 2, 3, 4, 6, 8, ... (so pieces fill whole waves of workers), each candidate is
// assigned longest first to the least loaded worker, and the one with the lowest max load
// wins (ties: fewer partial rows, then fewer items). The search stops once the max load
// is within 1% of the mean, or once a cut's mean load (which finer cuts only raise: each
// piece adds item_cost) exceeds the best max load; a cut whose costliest item exceeds it
// is skipped. Both bounds only skip cuts that cannot win, so they change no plan, only
// the host time (they drop the finest cuts, thousands of pieces to assign).
Status build_attention_plan(const AttentionPlanInputs& in, const AttentionPlanCapacity& cap, int32_t* buffer);

// Float32 values one partial row holds in `kernel`'s pool. CUDA: the piece's normalized
// output (head_dim) in partial_out plus its log-sum-exp in partial_lse. CPU: the unnormalized
// accumulator padded to kCpuVectorLanes, then the running max and sum.
int64_t attention_partial_row_floats(AttentionKernel kernel, int64_t head_dim);

// Bytes of the partial pool a plan with `partial_rows` rows (its kPlanNumPartialRows) needs:
// what the caller allocates for this plan, far below the capacity's max_partial_rows for
// most batches (a batch with no split tile needs none).
int64_t attention_partial_bytes(AttentionKernel kernel, int64_t head_dim, int64_t partial_rows);

// The planner's cost model applied to a built plan: per-worker loads.
struct AttentionPlanStats {
  int64_t num_items = 0;
  int64_t num_splits = 0;  // tiles cut into pieces (one merge each)
  int64_t num_partials = 0;  // split pieces
  int64_t partial_rows = 0;  // rows of the partial pool they use
  int64_t partial_bytes = 0;  // attention_partial_bytes of those rows at the stats' head_dim
  int64_t max_load = 0;    // the costliest worker
  int64_t total_load = 0;  // all workers
};
AttentionPlanStats attention_plan_stats(const int32_t* buffer, const AttentionPlanCapacity& cap, int64_t head_dim);

// The CPU kernel running a plan built for AttentionKernel::kCpu (host buffer). Checks
// the indices and that every item lies inside this call's batch, so a stale plan is an
// error rather than a stray read.
Status hybrid_attention_cpu_planned(const HybridAttentionParams& p, const int32_t* plan,
                                    const AttentionPlanCapacity& cap);

// That check (validate.cpp): every item and merge of a CPU `plan` lies inside this call's
// batch and the kernel's scratch, so a plan built for another step (same shapes, other
// lengths) is an error naming what disagrees rather than an out-of-bounds read or write.
Status validate_cpu_attention_plan(const HybridAttentionParams& p, const int32_t* plan,
                                   const AttentionPlanCapacity& cap);

}  // namespace sarathi_rt

#if defined(SARATHI_RT_WITH_CUDA)
namespace sarathi_rt {

// One planned step on the GPU. `p` holds device pointers (its cu_seqlens_q and seqlens_k
// are not read: the plan carries what the kernel needs); `plan` is the device copy of
// the buffer build_attention_plan filled. partial_out [rows, head_dim] and partial_lse
// [rows] (float32, rows >= the plan's kPlanNumPartialRows) hold split pieces until they
// are merged; a plan with no split tile reads neither.
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

// CPU hybrid-batch attention over a paged KV cache: prefill chunks and decodes in one
// call, running the work items and merges of a plan from the one attention planner
// (attention_plan.h, target AttentionKernel::kCpu). An item covers one or (decodes) all
// KV heads; for each of them, the item's rows (queries x the query heads of that GQA
// group) share every key/value vector loaded. Per chunk of 32 keys and block of up to 4
// rows:
//   S = Q K^T   one dot product per (row, key), head_dim in vector lanes,
//   online softmax once per chunk and row (base 2: Q is pre-scaled by log2(e); with a
//   soft cap, Q is pre-scaled by 1 / cap and each score becomes cap log2(e) tanh(s)),
//   O += P V    one axpy per (row, key) over head_dim.
// Decodes are memory-bound: their items span all KV heads and read keys and values
// straight from the pages (half precision converted in registers). Prefill tiles have
// many rows per key, so each chunk is first converted to float32 once. Both paths run
// the same arithmetic, and chunk boundaries sit at absolute key positions (split pieces
// start at multiples of 64 keys), so a query's result depends neither on which tile or
// path computed it nor on how its prompt was chunked, as long as its keys are not split.
//
// bf16 caches at the avx512_bf16 level score with vdpbf16ps on bf16 pairs instead, in
// both paths: q stays in bf16 as it arrived (its bits copied, never rescaled, so it is
// rounded no further) and the keys are read from the pages as they are, the prefill path
// converting only the values; each score is then scaled once in float32 (scale log2(e),
// or scale / cap). Scaling q first would round q * scale to bf16 again, a relative error
// of up to 2^-9 per element that the float32 levels do not make. P V stays in float32:
// a bf16 P would round every probability to 8 bits.
//
// No call allocates in steady state. Where every buffer lives:
//   Scratch (q, q_bf16, k, v, s, acc, m, l, visible, first): one per OpenMP thread, thread_local,
//     refitted only when the shape (head_dim, rows per item) changes;
//   the item order and the split pieces' partial rows: thread_local in the calling thread,
//     grown only;
//   the plan: the caller's buffer, built once per step (hybrid_attention_cpu_planned), or
//     for hybrid_attention_cpu a thread_local one grown only (the planner's own working
//     lists are attention_plan.cpp's);
//   a chunk's key offsets and row pointers: on the stack.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"
#include "sarathi_rt/attention_plan.h"
#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace {

template <int W>
using vec = cpu::vec<W>;

// The vector width W is the ISA level's register width (run_item's entry points below):
// 4 floats at the base level, 8 with AVX2, 16 with AVX-512. Rows are padded to
// kCpuVectorLanes (as the planner sizes partial rows), a multiple of every W.
constexpr int64_t kMaxLanes = 16;
static_assert(kCpuVectorLanes % kMaxLanes == 0, "a padded row must hold whole vectors of every width");
constexpr int64_t kKeyChunk = kCpuKeyChunk;
static_assert(kKeyChunk % kMaxLanes == 0, "a softmax step scores whole vectors of keys");
constexpr int64_t kRowBlock = 4;   // rows sharing each loaded key/value vector
constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kDotLanes = 32;  // bf16 elements of one vdpbf16ps operand
static_assert(kKeysPerChunk % kKeyChunk == 0, "split pieces must start on a softmax step");

int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }

// Rows of an item or merge, in order: its KV heads, then that head's rows
// (query * group + head_in_group) from row_begin on.
struct ItemRows {
  int64_t kv_head, num_heads, row_begin, num_rows, group;
  int64_t count() const { return num_heads * num_rows; }
  int64_t flat(int64_t r) const { return row_begin + r % num_rows; }
  int64_t query(int64_t r) const { return flat(r) / group; }  // inside the request
  int64_t q_head(int64_t r) const { return (kv_head + r / num_rows) * group + flat(r) % group; }
};

// Sizes shared by every item of one call.
struct Shape {
  int64_t group, dim, dim_padded, max_rows;
  int64_t partial_floats;  // per partial row: the accumulator (dim_padded), then max and sum
};

// Per-thread buffers, kept by each (pooled) OpenMP thread across calls and zeroed when
// the shape they serve changes: only lanes d < dim of q are ever written, so its padding
// lanes stay zero (k and v are written whole, padding included). In steady state a call
// allocates nothing.
struct Scratch {
  std::vector<float, cpu::LineAllocator<float>> q, k, v, s, acc, m, l;
  // The bf16 bits of q's rows for vdpbf16ps scores, each padded with zeros to dim_pairs.
  std::vector<uint16_t, cpu::LineAllocator<uint16_t>> q_bf16;
  std::vector<int64_t> visible;  // per row: keys it sees, capped at the item's k_end
  std::vector<int64_t> first;    // per row: the first key its sliding window holds (0 without one)
  int64_t dim = -1, dim_padded = -1, max_rows = -1, dim_pairs = -1;

  void fit(const Shape& sh) {
    if (sh.dim == dim && sh.dim_padded == dim_padded && sh.max_rows == max_rows) return;
    dim = sh.dim, dim_padded = sh.dim_padded, max_rows = sh.max_rows, dim_pairs = round_up(sh.dim, kDotLanes);
    q.assign(sh.max_rows * sh.dim_padded, 0.0f);
    q_bf16.assign(sh.max_rows * dim_pairs, 0);
    k.assign(kKeyChunk * sh.dim_padded, 0.0f);
    v.assign(kKeyChunk * sh.dim_padded, 0.0f);
    s.assign(sh.max_rows * kKeyChunk, 0.0f);
    acc.assign(sh.max_rows * sh.dim_padded, 0.0f);
    m.assign(sh.max_rows, 0.0f);
    l.assign(sh.max_rows, 0.0f);
    visible.assign(sh.max_rows, 0);
    first.assign(sh.max_rows, 0);
  }
};

// Keys j0 .. j0 + n for the item's heads: the key and value rows of its first head, `len`
// valid elements each, and those of head h (h - first) * head_stride further on: the
// pages hold a token's heads side by side (PagedKVLayout::slot_offset); a float32 copy
// holds one head, zero-padded to dim_padded. (The bf16 dot path's prefill chunks pair
// keys from the pages with float32 values, `len` = dim for both.)
template <typename KT, typename VT = KT>
struct Chunk {
  // The caller sets the row pointers of the chunk's n keys; the rest stay unset, not
  // zeroed (a 512-byte fill per chunk, a decode's largest fixed cost after the softmax).
  Chunk(int64_t j0, int64_t n, int64_t len, int64_t heads, int64_t head_stride)
      : j0(j0), n(n), len(len), heads(heads), head_stride(head_stride) {}
  const KT* k[kKeyChunk];
  const VT* v[kKeyChunk];
  int64_t j0, n, len, heads, head_stride;
};

// Element offsets of one KV head at consecutive positions of a sequence, from `pos` on:
// one block-table read per page instead of a division per key.
class PageWalk {
 public:
  PageWalk(const PagedKVLayout& layout, const int32_t* table, int64_t pos, int64_t head)
      : layout_(layout), table_(table), head_(head), block_(pos / layout.block_size), in_block_(pos % layout.block_size) {}
  int64_t next() {
    const int64_t off = layout_.slot_offset(table_[block_] * layout_.block_size + in_block_, head_);
    if (++in_block_ == layout_.block_size) {
      in_block_ = 0;
      ++block_;
    }
    return off;
  }

 private:
  const PagedKVLayout& layout_;
  const int32_t* table_;
  int64_t head_, block_, in_block_;
};

// A block of rows of an item's scratch, starting at row r.
struct RowBlock {
  const float* q;
  const uint16_t* q_bf16;
  float *s, *acc;
  int64_t dim_padded, dim_pairs;
  RowBlock(Scratch& t, int64_t r, int64_t Dp)
      : q(t.q.data() + r * Dp),
        q_bf16(t.q_bf16.data() + r * t.dim_pairs),
        s(t.s.data() + r * kKeyChunk),
        acc(t.acc.data() + r * Dp),
        dim_padded(Dp),
        dim_pairs(t.dim_pairs) {}
};

// Online softmax for one row over the chunk's n keys: those before `first` (its sliding
// window's start) or at or past `visible` (relative to the chunk) are masked. Turns the
// row's scores into probabilities relative to the new running max, rescaling the row's
// accumulator only when that max grew.
template <int W>
SRT_SIMD_INLINE void softmax_step(float* s, int64_t n, int64_t first, int64_t visible, float& m, float& l, float* acc,
                                  int64_t dim_padded) {
  // A key range this row cannot see (a slice of a split item, or one before its window):
  // at least one lane must be left, or the running max would stay at -inf.
  if (visible <= 0 || first >= kKeyChunk || first >= visible) {
    std::fill(s, s + kKeyChunk, 0.0f);
    return;
  }
  const int32_t lo = static_cast<int32_t>(std::max<int64_t>(first, 0));
  // Only the vectors holding the chunk's n keys: the rest would be masked to -inf and add
  // exp2(-inf) = 0 to the sum, and accumulate_pv reads no key past the chunk's last (so a
  // decode's last chunk of a few keys computes no 32 exponentials).
  constexpr int kVecs = kKeyChunk / W;
  const int live = static_cast<int>(ceil_div(n, W));
  const vec<W> neg_inf = cpu::splat<W>(-std::numeric_limits<float>::infinity());
  vec<W> x[kVecs];
  vec<W> top = neg_inf;
  for (int h = 0; h < kVecs; ++h) {
    if (h < live) {
      const cpu::ivec<W> lane = cpu::iota<W>() + static_cast<int32_t>(h * W);
      x[h] = (lane < static_cast<int32_t>(visible)) & (lane >= lo) ? cpu::load<W>(s + h * W) : neg_inf;
      top = x[h] > top ? x[h] : top;
    }
  }
  const float chunk_max = cpu::reduce_max<W>(top);
  if (chunk_max > m) {
    const float correction = std::exp2(m - chunk_max);  // 0 on the first chunk
    l *= correction;
    for (int64_t d = 0; d < dim_padded; d += W) cpu::store(acc + d, cpu::load<W>(acc + d) * correction);
    m = chunk_max;
  }
  vec<W> sum{};
  for (int h = 0; h < kVecs; ++h) {
    if (h < live) {
      const vec<W> p = cpu::exp2_nonpositive<W>(x[h] - m);
      cpu::store(s + h * W, p);
      sum += p;
    }
  }
  l += cpu::reduce_add<W>(sum);
}

// s[i][j] = q[i] . key j for the block's rows and the chunk's keys of the head whose key
// rows start `head` elements into the chunk's: per lane a running sum over head_dim, then
// reduce_addN's tree (W keys at once), so a score's bits depend neither on the rows or
// keys beside it nor on where its key was read. Lanes past the chunk's keys score 0
// (softmax_step masks them).
//
// Only the vectors holding the row's len elements are read: the padding's products are
// +0, which leaves a sum started at +0 as it is. Tail: len is not a multiple of W, and
// its last vector is a partial load. The loop without one keeps no cold path whose call
// would push the sums out of registers.
template <int R, int W, bool Tail, typename KT>
SRT_SIMD_INLINE void score_keys_of(const Chunk<KT>& c, int64_t head, const RowBlock& b) {
  const int64_t Dp = b.dim_padded, full = c.len - c.len % W;
  for (int64_t g = 0; g < c.n; g += W) {
    vec<W> dot[R][W];
    const int64_t m = std::min<int64_t>(W, c.n - g);
    for (int64_t j = 0; j < m; ++j) {
      const KT* key = c.k[g + j] + head;
      vec<W> sum[R] = {};
      for (int64_t d = 0; d < full; d += W) {
        const vec<W> k = cpu::load<W>(key + d);
        for (int i = 0; i < R; ++i) sum[i] += cpu::load<W>(b.q + i * Dp + d) * k;
      }
      if constexpr (Tail) {
        const vec<W> k = cpu::load_partial<W>(key + full, c.len - full);
        for (int i = 0; i < R; ++i) sum[i] += cpu::load<W>(b.q + i * Dp + full) * k;
      }
      for (int i = 0; i < R; ++i) dot[i][j] = sum[i];
    }
    for (int64_t j = m; j < W; ++j) {
      for (int i = 0; i < R; ++i) dot[i][j] = vec<W>{};
    }
    for (int i = 0; i < R; ++i) cpu::store(b.s + i * kKeyChunk + g, cpu::reduce_addN<W>(dot[i]));
  }
}
template <int R, int W, typename KT>
SRT_SIMD_INLINE void score_keys(const Chunk<KT>& c, int64_t head, const RowBlock& b) {
  if (c.len % W == 0) {
    score_keys_of<R, W, false>(c, head, b);
  } else {
    score_keys_of<R, W, true>(c, head, b);
  }
}

#if SRT_ISA_LEVELS
// score_keys with vdpbf16ps (avx512_bf16 level, bf16 caches): per lane a running sum of
// bf16 pairs over head_dim (32 elements a step; q's rows are zero past dim, a key's lanes
// past dim are loaded as zeros, never read), then the same tree over 16 keys at once,
// then the score scale. The key is read where it lies, so a decode row (keys from the
// pages) and a prefill row (keys from the pages too) get the same bits.
//
// The tree folds each key's sums as they come (cpu::AddTree, over the 16 keys unrolled)
// instead of keeping 16 vectors per row for reduce_addN: those went through the stack,
// and at head_dim 16 (one vdpbf16ps per key and row) the stores and reloads were most of
// the scoring (64 decodes of the tiny preset: 161 -> 144 us a call). The float32 scores
// keep reduce_addN: their 16 unrolled copies of the head_dim loop ran 25% slower at
// head_dim 64 (bench/RESULTS.md).
template <int R, typename VT>
SRT_SIMD_INLINE void score_keys_bf16(const Chunk<cpu::bf16, VT>& c, int64_t head, const RowBlock& b, float scale) {
  constexpr int W = cpu::kWidthV4;
  const int64_t full = c.len - c.len % kDotLanes;
  const auto dot = [&](const cpu::bf16* key, vec<W>* sum) SRT_SIMD_INLINE_LAMBDA {
    for (int64_t d = 0; d < full; d += kDotLanes) {
      const cpu::vbf16 k = cpu::load_bf16_pairs(key + d);
      for (int i = 0; i < R; ++i) {
        sum[i] = cpu::dot_bf16(sum[i], cpu::load_bf16_pairs(b.q_bf16 + i * b.dim_pairs + d), k);
      }
    }
    if (full < c.len) {
      const cpu::vbf16 k = cpu::load_bf16_pairs_partial(key + full, c.len - full);
      for (int i = 0; i < R; ++i) {
        sum[i] = cpu::dot_bf16(sum[i], cpu::load_bf16_pairs(b.q_bf16 + i * b.dim_pairs + full), k);
      }
    }
  };
  for (int64_t g = 0; g < c.n; g += W) {
    const int64_t m = std::min<int64_t>(W, c.n - g);
    cpu::AddTree<W> tree[R];
    cpu::unroll<W>([&](auto j) SRT_SIMD_INLINE_LAMBDA {
      vec<W> sum[R] = {};
      if (j < m) dot(c.k[g + j] + head, sum);
      for (int i = 0; i < R; ++i) tree[i].template add<j>(sum[i]);
    });
    for (int i = 0; i < R; ++i) cpu::store(b.s + i * kKeyChunk + g, tree[i].sums() * scale);
  }
}
#endif

// acc[i] += sum_j p[i][j] v[j] over the chunk's keys in order, for the head whose value
// rows start `head` elements into the chunk's.
//
// DB vectors of head_dim at a time, so each probability is broadcast once per DB vectors
// of value, not once per vector (at AVX2's 8 lanes and head_dim 16 the broadcasts were a
// third of the loop's instructions). R x DB accumulators, R broadcasts and a value fit
// every level's registers at R = 4, DB = 2. Each lane still adds its keys in order, so
// the bits are those of one vector at a time. As in score_keys, only the vectors holding
// the row's len elements are read (the accumulator's lanes past them stay 0), and a
// partial last one runs in a loop of its own (Tail).
template <int R, int W, int DB, bool Tail, typename KT, typename VT>
SRT_SIMD_INLINE void accumulate_pv_block(const Chunk<KT, VT>& c, int64_t head, const RowBlock& b, int64_t d) {
  static_assert(!Tail || DB == 1, "a partial vector runs alone");
  const int64_t Dp = b.dim_padded;
  vec<W> a[R][DB];
  for (int i = 0; i < R; ++i) {
    for (int e = 0; e < DB; ++e) a[i][e] = cpu::load<W>(b.acc + i * Dp + d + e * W);
  }
  for (int64_t j = 0; j < c.n; ++j) {
    // scalar * vector: one broadcast from memory per row (GCC 12 builds splat()'s
    // vector lane by lane here once the rows' scores sit 32 floats apart)
    float p[R];
    for (int i = 0; i < R; ++i) p[i] = b.s[i * kKeyChunk + j];
    for (int e = 0; e < DB; ++e) {
      const VT* v = c.v[j] + head + d + e * W;
      const vec<W> value = Tail ? cpu::load_partial<W>(v, c.len - d) : cpu::load<W>(v);
      for (int i = 0; i < R; ++i) a[i][e] += p[i] * value;
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int e = 0; e < DB; ++e) cpu::store(b.acc + i * Dp + d + e * W, a[i][e]);
  }
}
template <int R, int W, typename KT, typename VT>
SRT_SIMD_INLINE void accumulate_pv(const Chunk<KT, VT>& c, int64_t head, const RowBlock& b) {
  constexpr int DB = 2;
  const int64_t full = c.len - c.len % W;
  int64_t d = 0;
  for (; d + DB * W <= full; d += DB * W) accumulate_pv_block<R, W, DB, false>(c, head, b, d);
  for (; d < full; d += W) accumulate_pv_block<R, W, 1, false>(c, head, b, d);
  if (full < c.len) accumulate_pv_block<R, W, 1, true>(c, head, b, full);
}

// One chunk for all rows of the item (per_head rows for each of its heads), in blocks of
// up to kRowBlock rows that share each loaded key/value vector. softcap_log2: cap log2(e)
// when scores are soft-capped (Q then carries scale / cap), 0 when they are not. With
// Dot (bf16 keys), scores come from score_keys_bf16, scaled by q_scale there.
template <int W, bool Dot, typename KT, typename VT>
SRT_SIMD_INLINE void attend_chunk(const Chunk<KT, VT>& c, int64_t per_head, int64_t Dp, float q_scale,
                                  float softcap_log2, Scratch& t) {
  for (int64_t h = 0; h < c.heads; ++h) {
    for (int64_t r = h * per_head, end = r + per_head; r < end; r += kRowBlock) {
      const RowBlock b(t, r, Dp);
      if constexpr (Dot) {
#if SRT_ISA_LEVELS
        switch (std::min(kRowBlock, end - r)) {
          case 4: score_keys_bf16<4>(c, h * c.head_stride, b, q_scale); break;
          case 3: score_keys_bf16<3>(c, h * c.head_stride, b, q_scale); break;
          case 2: score_keys_bf16<2>(c, h * c.head_stride, b, q_scale); break;
          default: score_keys_bf16<1>(c, h * c.head_stride, b, q_scale); break;
        }
#endif
      } else {
        switch (std::min(kRowBlock, end - r)) {
          case 4: score_keys<4, W>(c, h * c.head_stride, b); break;
          case 3: score_keys<3, W>(c, h * c.head_stride, b); break;
          case 2: score_keys<2, W>(c, h * c.head_stride, b); break;
          default: score_keys<1, W>(c, h * c.head_stride, b); break;
        }
      }
    }
  }
  if (softcap_log2 > 0.0f) {
    for (int64_t r = 0; r < c.heads * per_head; ++r) {
      float* s = t.s.data() + r * kKeyChunk;
      for (int64_t j = 0; j < c.n; ++j) s[j] = softcap_log2 * std::tanh(s[j]);
    }
  }
  for (int64_t r = 0; r < c.heads * per_head; ++r) {
    softmax_step<W>(t.s.data() + r * kKeyChunk, c.n, t.first[r] - c.j0, t.visible[r] - c.j0, t.m[r], t.l[r],
                    t.acc.data() + r * Dp, Dp);
  }
  for (int64_t h = 0; h < c.heads; ++h) {
    for (int64_t r = h * per_head, end = r + per_head; r < end; r += kRowBlock) {
      const RowBlock b(t, r, Dp);
      switch (std::min(kRowBlock, end - r)) {
        case 4: accumulate_pv<4, W>(c, h * c.head_stride, b); break;
        case 3: accumulate_pv<3, W>(c, h * c.head_stride, b); break;
        case 2: accumulate_pv<2, W>(c, h * c.head_stride, b); break;
        default: accumulate_pv<1, W>(c, h * c.head_stride, b); break;
      }
    }
  }
}

// Dot: score with vdpbf16ps (T is bf16, W the AVX-512 width; see the header comment).
template <typename T, int W, bool Dot = false>
SRT_SIMD_INLINE void run_item(const HybridAttentionParams& p, const Shape& sh, const AttentionWorkItem& w, Scratch& t,
                             float* partials) {
  const ItemRows ir{w.kv_head, w.num_heads, w.row_begin, w.num_rows, sh.group};
  const int64_t rows = ir.count(), per_head = w.num_rows;
  const int64_t Dp = sh.dim_padded;
  const int32_t* table = p.block_tables + static_cast<int64_t>(w.request) * p.max_blocks_per_seq;

  const auto* q = static_cast<const T*>(p.q);
  const bool capped = p.softcap > 0.0f;
  const float q_scale = capped ? p.scale / p.softcap : p.scale * kLog2e;
  const float softcap_log2 = capped ? p.softcap * kLog2e : 0.0f;
  // Whole vectors, then the tail: its lanes past dim load as zeros, and the rest of the
  // padded row was zeroed by Scratch::fit and is never written.
  const int64_t q_full = sh.dim - sh.dim % W, q_tail = sh.dim - q_full;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (w.q_token0 + ir.query(r)) * p.q_token_stride + ir.q_head(r) * p.q_head_stride;
    if constexpr (Dot) {  // lanes past dim stay zero, as in q
      std::memcpy(t.q_bf16.data() + r * t.dim_pairs, src, sh.dim * sizeof(T));
    } else {
      float* qr = t.q.data() + r * Dp;
      for (int64_t d = 0; d < q_full; d += W) cpu::store(qr + d, cpu::load<W>(src + d) * q_scale);
      if (q_tail > 0) cpu::store(qr + q_full, cpu::load_partial<W>(src + q_full, q_tail) * q_scale);
    }
    const int64_t visible = w.causal_offset + ir.query(r) + 1;
    t.visible[r] = std::min<int64_t>(visible, w.kv_end);
    t.first[r] = first_visible_key(visible, p.window);
  }
  std::fill(t.acc.begin(), t.acc.begin() + rows * Dp, 0.0f);
  std::fill(t.m.begin(), t.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(t.l.begin(), t.l.begin() + rows, 0.0f);

  const auto* k_cache = static_cast<const T*>(p.k_cache);
  const auto* v_cache = static_cast<const T*>(p.v_cache);
  const int64_t k_stop = *std::max_element(t.visible.begin(), t.visible.begin() + rows);
  // Key offsets one chunk ahead of the chunk computed, their key and value rows (all the
  // item's heads) requested as they are found: a page's rows are contiguous but pages are
  // scattered, which no hardware prefetcher follows, and a decode has nothing to hide
  // the wait behind but the previous chunk's math.
  const int64_t row_bytes = w.num_heads * sh.dim * static_cast<int64_t>(sizeof(T));
  PageWalk walk(p.layout, table, w.kv_begin, w.kv_head);
  int64_t offsets[2][kKeyChunk];
  const auto find_chunk = [&](int64_t j0, int64_t* off) {
    for (int64_t j = 0, n = std::min(kKeyChunk, k_stop - j0); j < n; ++j) {
      off[j] = walk.next();
      cpu::prefetch_l2(k_cache + off[j], row_bytes);
      cpu::prefetch_l2(v_cache + off[j], row_bytes);
    }
  };
  find_chunk(w.kv_begin, offsets[0]);
  for (int64_t j0 = w.kv_begin, at = 0; j0 < k_stop; j0 += kKeyChunk, at ^= 1) {
    const int64_t n = std::min(kKeyChunk, k_stop - j0);
    if (j0 + kKeyChunk < k_stop) find_chunk(j0 + kKeyChunk, offsets[at ^ 1]);
    const int64_t* off = offsets[at];
    if (per_head <= kCpuDirectRows) {
      Chunk<T> c(j0, n, sh.dim, w.num_heads, sh.dim);
      for (int64_t j = 0; j < n; ++j) {
        c.k[j] = k_cache + off[j];
        c.v[j] = v_cache + off[j];
      }
      attend_chunk<W, Dot>(c, per_head, Dp, q_scale, softcap_log2, t);
    } else if constexpr (Dot) {  // many rows share each key: convert the values to float32 once (one head)
      Chunk<T, float> c(j0, n, sh.dim, 1, Dp);
      for (int64_t j = 0; j < n; ++j) {
        float* v = t.v.data() + j * Dp;
        for (int64_t d = 0; d < Dp; d += W) cpu::store(v + d, cpu::load_row<W>(v_cache + off[j], d, sh.dim));
        c.k[j] = k_cache + off[j];
        c.v[j] = v;
      }
      attend_chunk<W, Dot>(c, per_head, Dp, q_scale, softcap_log2, t);
    } else {  // many rows share each key: convert the chunk to float32 once (one head)
      Chunk<float> c(j0, n, Dp, 1, Dp);
      for (int64_t j = 0; j < n; ++j) {
        float* k = t.k.data() + j * Dp;
        float* v = t.v.data() + j * Dp;
        for (int64_t d = 0; d < Dp; d += W) {
          cpu::store(k + d, cpu::load_row<W>(k_cache + off[j], d, sh.dim));
          cpu::store(v + d, cpu::load_row<W>(v_cache + off[j], d, sh.dim));
        }
        c.k[j] = k;
        c.v[j] = v;
      }
      attend_chunk<W, Dot>(c, per_head, Dp, q_scale, softcap_log2, t);
    }
  }

  if (w.partial >= 0) {  // a piece of a split tile: the merge normalizes
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = partials + (w.partial + r) * sh.partial_floats;
      std::copy(t.acc.begin() + r * Dp, t.acc.begin() + (r + 1) * Dp, dst);
      dst[Dp] = t.m[r];
      dst[Dp + 1] = t.l[r];
    }
    return;
  }
  auto* out = static_cast<T*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (w.q_token0 + ir.query(r)) * p.out_token_stride + ir.q_head(r) * p.out_head_stride;
    const float inv = t.l[r] > 0.0f ? 1.0f / t.l[r] : 0.0f;
    const float* acc = t.acc.data() + r * Dp;
    for (int64_t d = 0; d < sh.dim; d += W) cpu::store_row<T, W>(dst, d, sh.dim, cpu::load<W>(acc + d) * inv);
  }
}

// Combines the pieces of one split tile (in key order, so results are deterministic):
// row r of piece i is partial row first_partial + i * rows + r. The row's sum builds up in
// the thread's accumulator, whole vectors of W lanes up to dim rounded up to W (inside the
// padded row; lanes past dim only ever meet zeros and are never stored).
template <typename T, int W>
SRT_SIMD_INLINE void merge_pieces(const HybridAttentionParams& p, const Shape& sh, const AttentionMergeItem& mg,
                                  const float* partials, Scratch& t) {
  const ItemRows ir{mg.kv_head, mg.num_heads, mg.row_begin, mg.num_rows, sh.group};
  const int64_t Dp = sh.dim_padded, stride = sh.partial_floats, rows = ir.count(), dim_w = round_up(sh.dim, W);
  auto* out = static_cast<T*>(p.out);
  float* o = t.acc.data();
  for (int64_t r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < mg.num_partials; ++i) {
      m = std::max(m, partials[(mg.first_partial + i * rows + r) * stride + Dp]);
    }
    float l = 0.0f;
    for (int64_t d = 0; d < dim_w; d += W) cpu::store(o + d, vec<W>{});
    for (int64_t i = 0; i < mg.num_partials; ++i) {
      const float* piece = partials + (mg.first_partial + i * rows + r) * stride;
      const float weight = std::exp2(piece[Dp] - m);  // 0 for a piece the row cannot see
      l += weight * piece[Dp + 1];
      for (int64_t d = 0; d < dim_w; d += W) cpu::store(o + d, cpu::load<W>(o + d) + weight * cpu::load<W>(piece + d));
    }
    T* dst = out + (mg.q_token0 + ir.query(r)) * p.out_token_stride + ir.q_head(r) * p.out_head_stride;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < sh.dim; d += W) cpu::store_row<T, W>(dst, d, sh.dim, cpu::load<W>(o + d) * inv);
  }
}

// run_item and merge_pieces compiled at each ISA level's register width, chosen once per call.
template <typename T>
using ItemFn = void (*)(const HybridAttentionParams&, const Shape&, const AttentionWorkItem&, Scratch&, float*);
template <typename T>
using MergeFn = void (*)(const HybridAttentionParams&, const Shape&, const AttentionMergeItem&, const float*, Scratch&);
#if SRT_ISA_LEVELS
SRT_TARGET_V4_BF16 void run_item_v4_bf16(const HybridAttentionParams& p, const Shape& sh, const AttentionWorkItem& w,
                                         Scratch& t, float* partials) {
  run_item<cpu::bf16, cpu::kWidthV4, true>(p, sh, w, t, partials);
}
#endif
template <typename T>
SRT_TARGET_V4 void run_item_v4(const HybridAttentionParams& p, const Shape& sh, const AttentionWorkItem& w, Scratch& t,
                               float* partials) {
  run_item<T, cpu::kWidthV4>(p, sh, w, t, partials);
}
template <typename T>
SRT_TARGET_V3 void run_item_v3(const HybridAttentionParams& p, const Shape& sh, const AttentionWorkItem& w, Scratch& t,
                               float* partials) {
  run_item<T, cpu::kWidthV3>(p, sh, w, t, partials);
}
template <typename T>
void run_item_base(const HybridAttentionParams& p, const Shape& sh, const AttentionWorkItem& w, Scratch& t,
                   float* partials) {
  run_item<T, cpu::kWidthBase>(p, sh, w, t, partials);
}
template <typename T>
SRT_TARGET_V4 void merge_v4(const HybridAttentionParams& p, const Shape& sh, const AttentionMergeItem& mg,
                            const float* partials, Scratch& t) {
  merge_pieces<T, cpu::kWidthV4>(p, sh, mg, partials, t);
}
template <typename T>
SRT_TARGET_V3 void merge_v3(const HybridAttentionParams& p, const Shape& sh, const AttentionMergeItem& mg,
                            const float* partials, Scratch& t) {
  merge_pieces<T, cpu::kWidthV3>(p, sh, mg, partials, t);
}
template <typename T>
void merge_base(const HybridAttentionParams& p, const Shape& sh, const AttentionMergeItem& mg, const float* partials,
                Scratch& t) {
  merge_pieces<T, cpu::kWidthBase>(p, sh, mg, partials, t);
}

Shape shape_of(const HybridAttentionParams& p) {
  return Shape{p.num_q_heads / p.layout.num_kv_heads, p.layout.head_dim, round_up(p.layout.head_dim, kCpuVectorLanes),
               cpu_attention_max_rows(p.layout.num_kv_heads),
               attention_partial_row_floats(AttentionKernel::kCpu, p.layout.head_dim)};
}

// Threads take the plan's items one at a time (dynamically: a thread that another process
// delays costs only its current item), in rounds over the workers' lists, which the
// planner filled longest first: the k-th item of every worker, then the (k+1)-th, ... so
// the long items start first. Then the merges, once every piece is written.
template <typename T>
void run_plan(const HybridAttentionParams& p, const Shape& sh, const int32_t* plan, const AttentionPlanCapacity& cap) {
  const int32_t* begin = plan + cap.cta_begin_offset();
  const auto* items = reinterpret_cast<const AttentionWorkItem*>(plan + cap.items_offset());
  const auto* merges = reinterpret_cast<const AttentionMergeItem*>(plan + cap.merges_offset());
  const int64_t num_merges = plan[kPlanNumMerges];
  // The calling thread's buffers, kept across calls (every layer of every step calls
  // this): cleared, not freed, so their capacity stays.
  thread_local std::vector<int32_t> order;
  thread_local std::vector<float, cpu::LineAllocator<float>> partial_rows;
  order.clear();
  for (int32_t k = 0; static_cast<int64_t>(order.size()) < plan[kPlanNumItems]; ++k) {
    for (int64_t c = 0; c < cap.num_ctas; ++c) {
      if (begin[c] + k < begin[c + 1]) order.push_back(begin[c] + k);
    }
  }
  // Sized from this plan's partial rows, not the capacity; grown only.
  const auto partial_floats = static_cast<size_t>(plan[kPlanNumPartialRows] * sh.partial_floats);
  if (partial_rows.size() < partial_floats) partial_rows.resize(partial_floats);
  // Plain pointers into the calling thread's buffers: inside the parallel region the
  // names `order` and `partial_rows` would mean each worker thread's own (empty) ones.
  const int32_t* item_order = order.data();
  const auto num_items = static_cast<int64_t>(order.size());
  float* partials = partial_rows.data();
  ItemFn<T> run = cpu::pick_isa<ItemFn<T>>(run_item_v4<T>, run_item_v3<T>, run_item_base<T>);
#if SRT_ISA_LEVELS
  if constexpr (std::is_same_v<T, cpu::bf16>) {
    if (cpu::isa_level() == cpu::IsaLevel::kV4Bf16) run = run_item_v4_bf16;
  }
#endif
  const MergeFn<T> merge = cpu::pick_isa<MergeFn<T>>(merge_v4<T>, merge_v3<T>, merge_base<T>);

#pragma omp parallel
  {
    thread_local Scratch scratch;
    scratch.fit(sh);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) run(p, sh, items[item_order[i]], scratch, partials);
#pragma omp for schedule(dynamic, 1)
    for (int64_t m = 0; m < num_merges; ++m) merge(p, sh, merges[m], partials, scratch);
  }
}

void run_plan(const HybridAttentionParams& p, const int32_t* plan, const AttentionPlanCapacity& cap) {
  const Shape sh = shape_of(p);
  switch (p.dtype) {
    case DType::kFloat32: run_plan<float>(p, sh, plan, cap); break;
    case DType::kFloat16: run_plan<cpu::f16>(p, sh, plan, cap); break;
    case DType::kBFloat16: run_plan<cpu::bf16>(p, sh, plan, cap); break;
  }
}

}  // namespace

int64_t cpu_attention_workers() { return 2 * static_cast<int64_t>(cpu::max_threads()); }

Status hybrid_attention_cpu(const HybridAttentionParams& p) {
  AttentionPlanInputs in;
  in.cu_seqlens_q = p.cu_seqlens_q;
  in.seqlens_k = p.seqlens_k;
  in.block_tables = p.block_tables;
  in.batch = p.batch;
  in.total_q = p.total_q;
  in.num_q_heads = p.num_q_heads;
  in.max_blocks_per_seq = p.max_blocks_per_seq;
  in.layout = p.layout;
  in.window = p.window;
  const AttentionPlanCapacity cap =
      attention_plan_capacity(p.batch, p.total_q, p.num_q_heads, p.layout.num_kv_heads,
                              attention_target(AttentionKernel::kCpu, cpu_attention_workers()));
  // The calling thread's plan buffer, grown only (write_plan rewrites every word it reads).
  thread_local std::vector<int32_t> plan;
  if (plan.size() < static_cast<size_t>(cap.total_words())) plan.resize(static_cast<size_t>(cap.total_words()));
  Status st = validate_attention_options(p);
  if (st.ok()) st = build_attention_plan(in, cap, plan.data());  // validates the indices
  if (!st.ok()) return st;
  run_plan(p, plan.data(), cap);
  return Status::Ok();
}

Status hybrid_attention_cpu_planned(const HybridAttentionParams& p, const int32_t* plan,
                                    const AttentionPlanCapacity& cap) {
  // q and out may have rows past the batch's last token: a step padded up to a compiled
  // bucket (python/sarathi_rt/engine/compiled_forward.py). No work item of the plan names
  // them, so they are neither read nor written; the checks see the batch's own rows.
  HybridAttentionParams rows = p;
  if (p.total_q > p.cu_seqlens_q[p.batch] && p.cu_seqlens_q[p.batch] >= 0) rows.total_q = p.cu_seqlens_q[p.batch];
  Status st = validate_attention_options(rows);
  if (st.ok()) st = validate_attention_indices(rows);
  if (st.ok()) st = validate_cpu_attention_plan(rows, plan, cap);
  if (!st.ok()) return st;
  run_plan(rows, plan, cap);
  return Status::Ok();
}

}  // namespace sarathi_rt

// CPU hybrid-batch attention over a paged KV cache: prefill chunks and decodes in one
// call. A work item is (request, KV heads, tile of queries, range of keys); for each of
// its KV heads, the query heads of that GQA group and the tile's queries form rows that
// share every key/value vector loaded. Per chunk of 32 keys and block of up to 4 rows:
//   S = Q K^T   one dot product per (row, key), head_dim in vector lanes,
//   online softmax once per chunk and row (base 2: Q is pre-scaled by log2(e)),
//   O += P V    one axpy per (row, key) over head_dim.
// Decodes are memory-bound: their items span all KV heads and read keys and values
// straight from the pages (half precision converted in registers). Prefill tiles have
// many rows per key, so each chunk is first converted to float32 once. Both paths run
// the same arithmetic, and chunk boundaries sit at absolute key positions, so a query's
// result does not depend on which tile, path or prefill chunk computed it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_simd.h"
#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace {

using cpu::kLanes;
using cpu::vf;

constexpr int64_t kKeyChunk = 2 * kLanes;  // keys per online-softmax step
constexpr int64_t kRowBlock = 4;           // rows sharing each loaded key/value vector
constexpr int64_t kMaxDirectRows = 8;      // rows per KV head up to which pages are read directly
constexpr int64_t kTileRows = 64;          // target rows (queries x group heads) per item
constexpr int64_t kMinSplitKeys = 1024;    // a key range worth a thread of its own
constexpr float kLog2e = 1.4426950408889634f;

int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }

// Rows of an item, in order: its KV heads, then its queries, then the query heads of
// that KV head's group. Requests with few rows per KV head (decodes) take every KV head
// in one item, so that each key chunk is read as whole token rows (a token's heads are
// contiguous in the cache) rather than as head_dim-sized pieces a token stride apart.
struct WorkItem {
  int32_t request;
  int32_t head_begin, head_end;  // KV heads
  int32_t q_begin, q_end;        // query indices inside the request
  int32_t k_begin, k_end;        // key positions; k_begin is a multiple of kKeyChunk
  int64_t partial = -1;          // >= 0: a slice of a split item, written unnormalized here
  int64_t cost = 0;

  int64_t rows_per_head(int64_t group) const { return (q_end - q_begin) * group; }
  int64_t rows(int64_t group) const { return rows_per_head(group) * (head_end - head_begin); }
  int64_t query(int64_t r, int64_t group) const { return q_begin + r % rows_per_head(group) / group; }
  int64_t q_head(int64_t r, int64_t group) const {
    return (head_begin + r / rows_per_head(group)) * group + r % group;
  }
};

// Sizes shared by every item of one call.
struct Shape {
  int64_t group, dim, dim_padded, max_rows;
  int64_t partial_floats() const { return max_rows * (dim_padded + 2); }
};

// Per-thread buffers, zeroed once: only lanes d < dim of q are ever written, so its
// padding lanes stay zero (k and v are written whole, padding included).
struct Scratch {
  std::vector<float, cpu::LineAllocator<float>> q, k, v, s, acc, m, l;
  std::vector<int64_t> visible;  // per row: keys it sees, capped at the item's k_end
  explicit Scratch(const Shape& sh)
      : q(sh.max_rows * sh.dim_padded), k(kKeyChunk * sh.dim_padded), v(kKeyChunk * sh.dim_padded),
        s(sh.max_rows * kKeyChunk), acc(sh.max_rows * sh.dim_padded), m(sh.max_rows), l(sh.max_rows),
        visible(sh.max_rows) {}
};

// Keys j0 .. j0 + n for the item's heads: the key and value rows of its first head, `len`
// valid elements each, and those of head h (h - first) * head_stride further on: the
// pages hold a token's heads side by side (PagedKVLayout::slot_offset); a float32 copy
// holds one head, zero-padded to dim_padded.
template <typename KT>
struct Chunk {
  const KT* k[kKeyChunk];
  const KT* v[kKeyChunk];
  int64_t j0, n, len, heads, head_stride;
  int64_t row_bytes;  // of a token's value row, all the item's heads
};

// A block of rows of an item's scratch, starting at row r.
struct RowBlock {
  const float* q;
  float *s, *acc;
  int64_t dim_padded;
  RowBlock(Scratch& t, int64_t r, int64_t Dp)
      : q(t.q.data() + r * Dp), s(t.s.data() + r * kKeyChunk), acc(t.acc.data() + r * Dp), dim_padded(Dp) {}
};

// Online softmax for one row: keys at or past `visible` are masked. Turns the row's
// scores into probabilities relative to the new running max, rescaling the row's
// accumulator only when that max grew.
SRT_SIMD_INLINE void softmax_step(float* s, int64_t visible, float& m, float& l, float* acc, int64_t dim_padded) {
  if (visible <= 0) {  // a key range this row cannot see (a slice of a split item)
    std::fill(s, s + kKeyChunk, 0.0f);
    return;
  }
  const vf neg_inf = cpu::splat(-std::numeric_limits<float>::infinity());
  vf x[2];
  for (int64_t h = 0; h < 2; ++h) {
    const cpu::vi lane = cpu::kIota + static_cast<int32_t>(h * kLanes);
    x[h] = lane < static_cast<int32_t>(visible) ? cpu::load(s + h * kLanes) : neg_inf;
  }
  const float chunk_max = cpu::reduce_max(x[0] > x[1] ? x[0] : x[1]);
  if (chunk_max > m) {
    const float correction = std::exp2(m - chunk_max);  // 0 on the first chunk
    l *= correction;
    for (int64_t d = 0; d < dim_padded; d += kLanes) cpu::store(acc + d, cpu::load(acc + d) * correction);
    m = chunk_max;
  }
  const vf p0 = cpu::exp2_nonpositive(x[0] - m), p1 = cpu::exp2_nonpositive(x[1] - m);
  cpu::store(s, p0);
  cpu::store(s + kLanes, p1);
  l += cpu::reduce_add(p0 + p1);
}

// s[i][j] = q[i] . key for the block's rows: per lane a running sum over head_dim, then
// reduce_add's tree, so a score's bits depend neither on the rows beside it nor on where
// its key was read.
template <int R, typename KT>
SRT_SIMD_INLINE void score_key(const KT* key, int64_t len, int64_t j, const RowBlock& b) {
  const int64_t Dp = b.dim_padded;
  vf dot[R] = {};
  for (int64_t d = 0; d < Dp; d += kLanes) {
    const vf k = cpu::load_row(key, d, len);
    for (int i = 0; i < R; ++i) dot[i] += cpu::load(b.q + i * Dp + d) * k;
  }
  for (int i = 0; i < R; ++i) b.s[i * kKeyChunk + j] = cpu::reduce_add(dot[i]);
}

// acc[i] += sum_j p[i][j] v[j] over the chunk's keys in order, for the head whose value
// rows start `head` elements into the chunk's.
template <int R, typename KT>
SRT_SIMD_INLINE void accumulate_pv(const Chunk<KT>& c, int64_t head, const RowBlock& b) {
  const int64_t Dp = b.dim_padded;
  for (int64_t d = 0; d < Dp; d += kLanes) {
    vf a[R];
    for (int i = 0; i < R; ++i) a[i] = cpu::load(b.acc + i * Dp + d);
    for (int64_t j = 0; j < c.n; ++j) {
      const vf value = cpu::load_row(c.v[j] + head, d, c.len);
      for (int i = 0; i < R; ++i) a[i] += cpu::splat(b.s[i * kKeyChunk + j]) * value;
    }
    for (int i = 0; i < R; ++i) cpu::store(b.acc + i * Dp + d, a[i]);
  }
}

// One chunk for all rows of the item (per_head rows for each of its heads), in blocks of
// up to kRowBlock rows that share each loaded key/value vector. Scores go key by key,
// every head of a token before the next token, so the keys are read in address order
// (which hardware prefetchers follow), and each token's value row is requested as soon
// as its key is scored, long before P V reads it head by head.
template <typename KT>
SRT_SIMD_INLINE void attend_chunk(const Chunk<KT>& c, int64_t per_head, int64_t Dp, Scratch& t) {
  for (int64_t j = 0; j < c.n; ++j) {
    cpu::prefetch(c.v[j], c.row_bytes);
    for (int64_t h = 0; h < c.heads; ++h) {
      const KT* key = c.k[j] + h * c.head_stride;
      for (int64_t r = h * per_head, end = r + per_head; r < end; r += kRowBlock) {
        const RowBlock b(t, r, Dp);
        switch (std::min(kRowBlock, end - r)) {
          case 4: score_key<4>(key, c.len, j, b); break;
          case 3: score_key<3>(key, c.len, j, b); break;
          case 2: score_key<2>(key, c.len, j, b); break;
          default: score_key<1>(key, c.len, j, b); break;
        }
      }
    }
  }
  for (int64_t r = 0; r < c.heads * per_head; ++r) {
    softmax_step(t.s.data() + r * kKeyChunk, t.visible[r] - c.j0, t.m[r], t.l[r], t.acc.data() + r * Dp, Dp);
  }
  for (int64_t h = 0; h < c.heads; ++h) {
    for (int64_t r = h * per_head, end = r + per_head; r < end; r += kRowBlock) {
      const RowBlock b(t, r, Dp);
      switch (std::min(kRowBlock, end - r)) {
        case 4: accumulate_pv<4>(c, h * c.head_stride, b); break;
        case 3: accumulate_pv<3>(c, h * c.head_stride, b); break;
        case 2: accumulate_pv<2>(c, h * c.head_stride, b); break;
        default: accumulate_pv<1>(c, h * c.head_stride, b); break;
      }
    }
  }
}

template <typename T>
SRT_CPU_CLONES void run_item(const HybridAttentionParams& p, const Shape& sh, const WorkItem& w, Scratch& t,
                             float* partials) {
  const int64_t q0 = p.cu_seqlens_q[w.request];
  const int64_t q_len = p.cu_seqlens_q[w.request + 1] - q0;
  const int64_t kv_len = p.seqlens_k[w.request];
  const int64_t rows = w.rows(sh.group), per_head = w.rows_per_head(sh.group);
  const int64_t Dp = sh.dim_padded;
  const int32_t* table = p.block_tables + w.request * p.max_blocks_per_seq;

  const auto* q = static_cast<const T*>(p.q);
  const float q_scale = p.scale * kLog2e;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (q0 + w.query(r, sh.group)) * p.q_token_stride + w.q_head(r, sh.group) * p.q_head_stride;
    for (int64_t d = 0; d < sh.dim; ++d) t.q[r * Dp + d] = cpu::to_float(src[d]) * q_scale;
    t.visible[r] = std::min<int64_t>(num_visible_keys(kv_len, q_len, w.query(r, sh.group)), w.k_end);
  }
  std::fill(t.acc.begin(), t.acc.begin() + rows * Dp, 0.0f);
  std::fill(t.m.begin(), t.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(t.l.begin(), t.l.begin() + rows, 0.0f);

  const auto* k_cache = static_cast<const T*>(p.k_cache);
  const auto* v_cache = static_cast<const T*>(p.v_cache);
  const int64_t k_stop = *std::max_element(t.visible.begin(), t.visible.begin() + rows);
  const int64_t row_bytes = (w.head_end - w.head_begin) * sh.dim * static_cast<int64_t>(sizeof(T));
  for (int64_t j0 = w.k_begin; j0 < k_stop; j0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, k_stop - j0);
    if (per_head <= kMaxDirectRows) {
      Chunk<T> c{{}, {}, j0, n, sh.dim, w.head_end - w.head_begin, sh.dim, row_bytes};
      for (int64_t j = 0; j < n; ++j) {
        const int64_t off = p.layout.position_offset(table, j0 + j, w.head_begin);
        c.k[j] = k_cache + off;
        c.v[j] = v_cache + off;
      }
      attend_chunk(c, per_head, Dp, t);
    } else {  // many rows share each key: convert the chunk to float32 once (one head)
      Chunk<float> c{{}, {}, j0, n, Dp, 1, Dp, Dp * static_cast<int64_t>(sizeof(float))};
      for (int64_t j = 0; j < n; ++j) {
        const int64_t off = p.layout.position_offset(table, j0 + j, w.head_begin);
        float* k = t.k.data() + j * Dp;
        float* v = t.v.data() + j * Dp;
        for (int64_t d = 0; d < Dp; d += kLanes) {
          cpu::store(k + d, cpu::load_row(k_cache + off, d, sh.dim));
          cpu::store(v + d, cpu::load_row(v_cache + off, d, sh.dim));
        }
        c.k[j] = k;
        c.v[j] = v;
      }
      attend_chunk(c, per_head, Dp, t);
    }
  }

  if (w.partial >= 0) {  // a slice of a split item: the merge normalizes
    float* dst = partials + w.partial * sh.partial_floats();
    std::copy(t.acc.begin(), t.acc.begin() + rows * Dp, dst);
    std::copy(t.m.begin(), t.m.begin() + rows, dst + sh.max_rows * Dp);
    std::copy(t.l.begin(), t.l.begin() + rows, dst + sh.max_rows * (Dp + 1));
    return;
  }
  auto* out = static_cast<T*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (q0 + w.query(r, sh.group)) * p.out_token_stride + w.q_head(r, sh.group) * p.out_head_stride;
    const float inv = t.l[r] > 0.0f ? 1.0f / t.l[r] : 0.0f;
    for (int64_t d = 0; d < sh.dim; ++d) dst[d] = cpu::from_float<T>(t.acc[r * Dp + d] * inv);
  }
}

// Combines the slices of one split item (in slice order, so results are deterministic).
template <typename T>
void merge_slices(const HybridAttentionParams& p, const Shape& sh, const WorkItem& w, int64_t first, int64_t count,
                  const float* partials) {
  const int64_t q0 = p.cu_seqlens_q[w.request];
  const int64_t Dp = sh.dim_padded, stride = sh.partial_floats();
  auto* out = static_cast<T*>(p.out);
  std::vector<float> o(sh.dim);
  for (int64_t r = 0, rows = w.rows(sh.group); r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < count; ++i) m = std::max(m, partials[(first + i) * stride + sh.max_rows * Dp + r]);
    float l = 0.0f;
    std::fill(o.begin(), o.end(), 0.0f);
    for (int64_t i = 0; i < count; ++i) {
      const float* slice = partials + (first + i) * stride;
      const float weight = std::exp2(slice[sh.max_rows * Dp + r] - m);  // 0 for a slice the row cannot see
      l += weight * slice[sh.max_rows * (Dp + 1) + r];
      for (int64_t d = 0; d < sh.dim; ++d) o[d] += weight * slice[r * Dp + d];
    }
    T* dst = out + (q0 + w.query(r, sh.group)) * p.out_token_stride + w.q_head(r, sh.group) * p.out_head_stride;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < sh.dim; ++d) dst[d] = cpu::from_float<T>(o[d] * inv);
  }
}

int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// One item per request with at most kMaxDirectRows rows per KV head (decodes), else one
// per (request, KV head, query tile); costliest first so that the dynamic schedule does
// not end on one long prefill tile.
std::vector<WorkItem> plan_items(const HybridAttentionParams& p, const Shape& sh) {
  const int64_t tile = std::max<int64_t>(1, kTileRows / sh.group);
  const int32_t heads = static_cast<int32_t>(p.layout.num_kv_heads);
  std::vector<WorkItem> items;
  auto add = [&](int32_t b, int32_t h0, int32_t h1, int64_t q, int64_t q_end, int64_t q_len) {
    const int64_t keys = num_visible_keys(p.seqlens_k[b], q_len, q_end - 1);
    items.push_back({b, h0, h1, static_cast<int32_t>(q), static_cast<int32_t>(q_end), 0, static_cast<int32_t>(keys),
                     -1, (q_end - q) * sh.group * (h1 - h0) * keys});
  };
  for (int32_t b = 0; b < p.batch; ++b) {
    const int64_t q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    if (q_len == 0) continue;
    if (q_len * sh.group <= kMaxDirectRows) {
      add(b, 0, heads, 0, q_len, q_len);
      continue;
    }
    for (int32_t h = 0; h < heads; ++h) {
      for (int64_t q = 0; q < q_len; q += tile) add(b, h, h + 1, q, std::min(q + tile, q_len), q_len);
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <typename T>
void run_all(const HybridAttentionParams& p, const Shape& sh, const std::vector<WorkItem>& items) {
  // With fewer items than threads (a few long decodes), long items are cut into key
  // ranges computed in parallel and merged afterwards.
  const int64_t threads = max_threads();
  std::vector<WorkItem> work;
  std::vector<std::pair<size_t, int64_t>> merges;  // (item, number of slices); slices are consecutive
  int64_t num_slices = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const WorkItem& w = items[i];
    const int64_t want = static_cast<int64_t>(items.size()) < threads ? threads / static_cast<int64_t>(items.size()) : 1;
    const int64_t slices = std::min(want, w.k_end / kMinSplitKeys);
    if (slices <= 1) {
      work.push_back(w);
      continue;
    }
    const int64_t step = round_up(ceil_div(w.k_end, slices), kKeyChunk);
    int64_t count = 0;
    for (int64_t k = 0; k < w.k_end; k += step, ++count) {
      WorkItem slice = w;
      slice.k_begin = static_cast<int32_t>(k);
      slice.k_end = static_cast<int32_t>(std::min<int64_t>(k + step, w.k_end));
      slice.partial = num_slices + count;
      work.push_back(slice);
    }
    merges.emplace_back(i, count);
    num_slices += count;
  }
  std::vector<float> partials(static_cast<size_t>(num_slices * sh.partial_floats()));

#pragma omp parallel
  {
    Scratch scratch(sh);
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < work.size(); ++i) run_item<T>(p, sh, work[i], scratch, partials.data());
  }
  int64_t first = 0;
  for (const auto& [item, count] : merges) {
    merge_slices<T>(p, sh, items[item], first, count, partials.data());
    first += count;
  }
}

}  // namespace

Status hybrid_attention_cpu(const HybridAttentionParams& p) {
  Status st = validate_attention_indices(p);
  if (!st.ok()) return st;
  const int64_t group = p.num_q_heads / p.layout.num_kv_heads;
  const int64_t tile = std::max<int64_t>(1, kTileRows / group);
  const Shape sh{group, p.layout.head_dim, round_up(p.layout.head_dim, kLanes),
                 std::max(tile * group, kMaxDirectRows * p.layout.num_kv_heads)};
  const std::vector<WorkItem> items = plan_items(p, sh);
  switch (p.dtype) {
    case DType::kFloat32: run_all<float>(p, sh, items); break;
    case DType::kFloat16: run_all<cpu::f16>(p, sh, items); break;
    case DType::kBFloat16: run_all<cpu::bf16>(p, sh, items); break;
  }
  return Status::Ok();
}

}  // namespace sarathi_rt

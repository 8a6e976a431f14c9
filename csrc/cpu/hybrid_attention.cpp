// CPU hybrid-batch attention over a paged KV cache: prefill chunks and decodes in one
// call. A work item is (request, KV head, tile of queries, range of keys): the query
// heads of one GQA group and a tile of queries form the rows of a small matrix that
// shares every key/value chunk loaded from the pages. Per chunk of 32 keys:
//   S = Q K^T   keys packed transposed so that keys sit in vector lanes,
//   online softmax once per chunk and row (base 2: Q is pre-scaled by log2(e)),
//   O += P V    rows in blocks of 4 sharing each loaded value vector.
// Chunk boundaries sit at absolute key positions, so a query's result does not depend
// on which tile (or prefill chunk) it was computed in.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_dtype.h"
#include "cpu_simd.h"
#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace {

using cpu::kLanes;
using cpu::vf;

constexpr int64_t kKeyChunk = 2 * kLanes;  // keys per online-softmax step
constexpr int64_t kRowBlock = 4;           // rows sharing each loaded key/value vector
constexpr int64_t kTileRows = 64;          // target rows (queries x group heads) per item
constexpr int64_t kMinSplitKeys = 1024;    // a key range worth a thread of its own
constexpr float kLog2e = 1.4426950408889634f;

int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }

struct WorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t q_begin, q_end;  // query indices inside the request
  int32_t k_begin, k_end;  // key positions; k_begin is a multiple of kKeyChunk
  int64_t partial = -1;    // >= 0: a slice of a split item, written unnormalized here
  int64_t cost = 0;
};

// Sizes shared by every item of one call.
struct Shape {
  int64_t group, dim, dim_padded, max_rows;
  int64_t rows_padded(int64_t rows) const { return round_up(rows, kRowBlock); }
  int64_t partial_floats() const { return max_rows * (dim_padded + 2); }
};

// Per-thread buffers, zeroed once so that the padding lanes (d >= dim) stay zero.
struct Scratch {
  std::vector<float> q, kt, v, s, acc, m, l;
  explicit Scratch(const Shape& sh)
      : q(sh.max_rows * sh.dim_padded), kt(sh.dim_padded * kKeyChunk), v(kKeyChunk * sh.dim_padded),
        s(sh.max_rows * kKeyChunk), acc(sh.max_rows * sh.dim_padded), m(sh.max_rows), l(sh.max_rows) {}
};

// Keys j0..j0+n of one head: K transposed to kt[d][j], V as v[j][d], both float32; key
// columns n..kKeyChunk of kt are zeroed so their scores are finite (they are masked).
template <typename T>
SRT_SIMD_INLINE void pack_chunk(const HybridAttentionParams& p, const int32_t* table, int64_t head, int64_t j0,
                                int64_t n, const Shape& sh, float* kt, float* v) {
  const auto* kc = static_cast<const T*>(p.k_cache);
  const auto* vc = static_cast<const T*>(p.v_cache);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t off = p.layout.position_offset(table, j0 + j, head);
    for (int64_t d = 0; d < sh.dim; ++d) kt[d * kKeyChunk + j] = cpu::to_float(kc[off + d]);
    for (int64_t d = 0; d < sh.dim; ++d) v[j * sh.dim_padded + d] = cpu::to_float(vc[off + d]);
  }
  if (n < kKeyChunk) {
    for (int64_t d = 0; d < sh.dim; ++d) std::fill(kt + d * kKeyChunk + n, kt + (d + 1) * kKeyChunk, 0.0f);
  }
}

// s[r][0..kKeyChunk) = q[r] . k[j] for `rows` (a multiple of kRowBlock) rows.
SRT_SIMD_INLINE void chunk_scores(const float* q, const float* kt, int64_t rows, int64_t dim_padded, float* s) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    vf c[kRowBlock][2] = {};
    for (int64_t d = 0; d < dim_padded; ++d) {
      const vf k0 = cpu::load(kt + d * kKeyChunk), k1 = cpu::load(kt + d * kKeyChunk + kLanes);
      for (int64_t i = 0; i < kRowBlock; ++i) {
        const vf qv = cpu::splat(q[(r0 + i) * dim_padded + d]);
        c[i][0] += qv * k0;
        c[i][1] += qv * k1;
      }
    }
    for (int64_t i = 0; i < kRowBlock; ++i) {
      cpu::store(s + (r0 + i) * kKeyChunk, c[i][0]);
      cpu::store(s + (r0 + i) * kKeyChunk + kLanes, c[i][1]);
    }
  }
}

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

// acc[r] += sum_j p[r][j] v[j] over the chunk's n keys.
SRT_SIMD_INLINE void accumulate_pv(const float* p, const float* v, int64_t n, int64_t rows, int64_t dim_padded,
                                   float* acc) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    for (int64_t d = 0; d < dim_padded; d += kLanes) {
      vf a[kRowBlock];
      for (int64_t i = 0; i < kRowBlock; ++i) a[i] = cpu::load(acc + (r0 + i) * dim_padded + d);
      for (int64_t j = 0; j < n; ++j) {
        const vf vv = cpu::load(v + j * dim_padded + d);
        for (int64_t i = 0; i < kRowBlock; ++i) a[i] += cpu::splat(p[(r0 + i) * kKeyChunk + j]) * vv;
      }
      for (int64_t i = 0; i < kRowBlock; ++i) cpu::store(acc + (r0 + i) * dim_padded + d, a[i]);
    }
  }
}

// Row r of an item is (query w.q_begin + r / group, head w.kv_head * group + r % group);
// padding rows up to a multiple of kRowBlock repeat the last query's visibility.
template <typename T>
SRT_CPU_CLONES void run_item(const HybridAttentionParams& p, const Shape& sh, const WorkItem& w, Scratch& t,
                             float* partials) {
  const int64_t q0 = p.cu_seqlens_q[w.request];
  const int64_t q_len = p.cu_seqlens_q[w.request + 1] - q0;
  const int64_t kv_len = p.seqlens_k[w.request];
  const int64_t rows = (w.q_end - w.q_begin) * sh.group;
  const int64_t rows_padded = sh.rows_padded(rows);
  const int64_t Dp = sh.dim_padded;
  const int32_t* table = p.block_tables + w.request * p.max_blocks_per_seq;

  const auto* q = static_cast<const T*>(p.q);
  const float q_scale = p.scale * kLog2e;
  std::fill(t.q.begin(), t.q.begin() + rows_padded * Dp, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (q0 + w.q_begin + r / sh.group) * p.q_token_stride +
                   (w.kv_head * sh.group + r % sh.group) * p.q_head_stride;
    for (int64_t d = 0; d < sh.dim; ++d) t.q[r * Dp + d] = cpu::to_float(src[d]) * q_scale;
  }
  std::fill(t.acc.begin(), t.acc.begin() + rows_padded * Dp, 0.0f);
  std::fill(t.m.begin(), t.m.begin() + rows_padded, -std::numeric_limits<float>::infinity());
  std::fill(t.l.begin(), t.l.begin() + rows_padded, 0.0f);

  auto visible = [&](int64_t r) {
    const int64_t qi = w.q_begin + std::min(r / sh.group, int64_t{w.q_end - w.q_begin - 1});
    return std::min<int64_t>(num_visible_keys(kv_len, q_len, qi), w.k_end);
  };
  const int64_t k_stop = std::min<int64_t>(visible(rows - 1), w.k_end);
  for (int64_t j0 = w.k_begin; j0 < k_stop; j0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, k_stop - j0);
    pack_chunk<T>(p, table, w.kv_head, j0, n, sh, t.kt.data(), t.v.data());
    chunk_scores(t.q.data(), t.kt.data(), rows_padded, Dp, t.s.data());
    for (int64_t r = 0; r < rows_padded; ++r) {
      softmax_step(t.s.data() + r * kKeyChunk, visible(r) - j0, t.m[r], t.l[r], t.acc.data() + r * Dp, Dp);
    }
    accumulate_pv(t.s.data(), t.v.data(), n, rows_padded, Dp, t.acc.data());
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
    T* dst = out + (q0 + w.q_begin + r / sh.group) * p.out_token_stride +
             (w.kv_head * sh.group + r % sh.group) * p.out_head_stride;
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
  for (int64_t r = 0, rows = (w.q_end - w.q_begin) * sh.group; r < rows; ++r) {
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
    T* dst = out + (q0 + w.q_begin + r / sh.group) * p.out_token_stride +
             (w.kv_head * sh.group + r % sh.group) * p.out_head_stride;
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

// One item per (request, KV head, query tile), costliest first so that the dynamic
// schedule does not end on one long prefill tile.
std::vector<WorkItem> plan_items(const HybridAttentionParams& p, const Shape& sh) {
  const int64_t tile = std::max<int64_t>(1, kTileRows / sh.group);
  std::vector<WorkItem> items;
  for (int32_t b = 0; b < p.batch; ++b) {
    const int64_t q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    const int64_t kv_len = p.seqlens_k[b];
    for (int32_t h = 0; h < p.layout.num_kv_heads; ++h) {
      for (int64_t q = 0; q < q_len; q += tile) {
        const int64_t q_end = std::min(q + tile, q_len);
        const int64_t keys = num_visible_keys(kv_len, q_len, q_end - 1);
        items.push_back({b, h, static_cast<int32_t>(q), static_cast<int32_t>(q_end), 0,
                         static_cast<int32_t>(keys), -1, sh.rows_padded((q_end - q) * sh.group) * keys});
      }
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
  const Shape sh{group, p.layout.head_dim, round_up(p.layout.head_dim, kLanes), round_up(tile * group, kRowBlock)};
  const std::vector<WorkItem> items = plan_items(p, sh);
  switch (p.dtype) {
    case DType::kFloat32: run_all<float>(p, sh, items); break;
    case DType::kFloat16: run_all<cpu::f16>(p, sh, items); break;
    case DType::kBFloat16: run_all<cpu::bf16>(p, sh, items); break;
  }
  return Status::Ok();
}

}  // namespace sarathi_rt

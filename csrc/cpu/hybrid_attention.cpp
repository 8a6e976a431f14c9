// CPU hybrid-batch attention over a paged KV cache: prefill chunks and decodes in one
// call. Work item = (request, KV head, tile of queries): the query heads of one GQA
// group and a tile of queries share every key/value chunk loaded from the pages.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_dtype.h"
#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace {

constexpr int64_t kQueryTile = 16;  // queries per work item
constexpr int64_t kKeyChunk = 64;   // keys converted to float at a time

struct WorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t q_begin;  // query index inside the request
  int32_t q_end;
};

template <typename T>
void run_item(const HybridAttentionParams& p, const WorkItem& w, std::vector<float>& scratch) {
  const PagedKVLayout& L = p.layout;
  const int64_t D = L.head_dim;
  const int64_t group = p.num_q_heads / L.num_kv_heads;
  const int64_t q0 = p.cu_seqlens_q[w.request];
  const int64_t q_len = p.cu_seqlens_q[w.request + 1] - q0;
  const int64_t kv_len = p.seqlens_k[w.request];
  const int64_t rows = (w.q_end - w.q_begin) * group;
  const int32_t* table = p.block_tables + w.request * p.max_blocks_per_seq;

  scratch.resize(static_cast<size_t>(2 * kKeyChunk * D + rows * (D + 2) + kKeyChunk));
  float* kbuf = scratch.data();
  float* vbuf = kbuf + kKeyChunk * D;
  float* acc = vbuf + kKeyChunk * D;  // [rows, D]
  float* m = acc + rows * D;          // running max per row
  float* l = m + rows;                // running denominator per row
  float* s = l + rows;                // scores of one row against the chunk
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0f);

  // Row r = (query qi, head-in-group hg); its q row, pre-scaled, lives in qf.
  std::vector<float> qf(static_cast<size_t>(rows * D));
  const auto* q = static_cast<const T*>(p.q);
  for (int64_t qi = w.q_begin; qi < w.q_end; ++qi) {
    for (int64_t hg = 0; hg < group; ++hg) {
      const T* src = q + (q0 + qi) * p.q_token_stride + (w.kv_head * group + hg) * p.q_head_stride;
      float* dst = qf.data() + ((qi - w.q_begin) * group + hg) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = cpu::to_float(src[d]) * p.scale;
    }
  }

  const int64_t last_visible = num_visible_keys(kv_len, q_len, w.q_end - 1);
  const auto* kc = static_cast<const T*>(p.k_cache);
  const auto* vc = static_cast<const T*>(p.v_cache);
  for (int64_t j0 = 0; j0 < last_visible; j0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, last_visible - j0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t off = L.position_offset(table, j0 + j, w.kv_head);
      for (int64_t d = 0; d < D; ++d) {
        kbuf[j * D + d] = cpu::to_float(kc[off + d]);
        vbuf[j * D + d] = cpu::to_float(vc[off + d]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qi = w.q_begin + r / group;
      const int64_t visible = std::min(n, num_visible_keys(kv_len, q_len, qi) - j0);
      if (visible <= 0) continue;
      const float* qr = qf.data() + r * D;
      float chunk_max = m[r];
      for (int64_t j = 0; j < visible; ++j) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kbuf[j * D + d];
        s[j] = dot;
        chunk_max = std::max(chunk_max, dot);
      }
      const float correction = std::exp(m[r] - chunk_max);
      float* ar = acc + r * D;
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
      for (int64_t j = 0; j < visible; ++j) {
        const float pj = std::exp(s[j] - chunk_max);
        sum += pj;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += pj * vbuf[j * D + d];
      }
      l[r] = l[r] * correction + sum;
      m[r] = chunk_max;
    }
  }

  auto* out = static_cast<T*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qi = w.q_begin + r / group;
    const int64_t h = w.kv_head * group + r % group;
    T* dst = out + (q0 + qi) * p.out_token_stride + h * p.out_head_stride;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = cpu::from_float<T>(acc[r * D + d] * inv);
  }
}

template <typename T>
void run_all(const HybridAttentionParams& p, const std::vector<WorkItem>& items) {
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) run_item<T>(p, items[i], scratch);
  }
}

}  // namespace

Status hybrid_attention_cpu(const HybridAttentionParams& p) {
  Status st = validate_attention_indices(p);
  if (!st.ok()) return st;
  std::vector<WorkItem> items;
  for (int32_t b = 0; b < p.batch; ++b) {
    const int32_t q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    for (int32_t h = 0; h < p.layout.num_kv_heads; ++h) {
      for (int32_t q = 0; q < q_len; q += kQueryTile) {
        items.push_back({b, h, q, static_cast<int32_t>(std::min<int64_t>(q + kQueryTile, q_len))});
      }
    }
  }
  // Longest work first, so the dynamic schedule does not end on one long prefill tile.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return p.seqlens_k[a.request] > p.seqlens_k[b.request];
  });
  switch (p.dtype) {
    case DType::kFloat32: run_all<float>(p, items); break;
    case DType::kFloat16: run_all<cpu::f16>(p, items); break;
    case DType::kBFloat16: run_all<cpu::bf16>(p, items); break;
  }
  return Status::Ok();
}

}  // namespace sarathi_rt

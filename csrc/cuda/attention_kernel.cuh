// The fused hybrid-batch attention kernel: one persistent launch runs every work item of
// a plan (attention_plan.h), prefill tiles and decode tiles alike. Flash-attention style:
// tensor-core mma (CuTe's SM80 atoms, also used on sm90a) for Q.K^T and P.V, online
// softmax in registers, paged K/V streamed through a two-stage cp.async pipeline of
// 16-byte copies. Included by one .cu per dtype, which instantiates head_dim 64 and 128.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <limits>
#include <string>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "sarathi_rt/attention_plan.h"
#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace attn {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
struct MmaTraits;

template <>
struct MmaTraits<__half> {
  using Atom = cute::SM80_16x8x16_F32F16F16F32_TN;
  __device__ static uint32_t pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct MmaTraits<__nv_bfloat16> {
  using Atom = cute::SM80_16x8x16_F32BF16BF16F32_TN;
  __device__ static uint32_t pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <int D>
constexpr int shared_bytes() {
  return 5 * kWideTileRows * D * 2;  // Q tile + two stages of K and V, 2-byte elements
}

// Element index of (row, col) in a [rows][D] shared tile. 16-byte chunk c of row r is
// stored at chunk c ^ (r % 8): the 8 rows one ldmatrix reads fall in 8 distinct bank
// groups, with no padding (padding would cost the second CTA per SM on an A100).
template <int D>
__device__ __forceinline__ int swizzle(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

__device__ __forceinline__ void copy16(void* smem, const void* gmem, bool valid) {
  // Invalid rows are zero-filled: padded keys and values must be finite, not stale data.
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(*static_cast<const cute::uint128_t*>(gmem),
                                                              *static_cast<cute::uint128_t*>(smem), valid);
}

template <typename T>
__device__ __forceinline__ void ldsm(const T* smem, uint32_t (&r)[4]) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}

template <typename T>
__device__ __forceinline__ void ldsm_trans(const T* smem, uint32_t (&r)[4]) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}

template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  MmaTraits<T>::Atom::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1, c[0], c[1], c[2], c[3]);
}

// Flattened row -> (token in q, query head); rows are query * group + head_in_group.
struct RowMap {
  int group;
  int64_t window;  // sliding window, 0 = none
  __device__ int64_t token(const AttentionWorkItem& w, int row) const { return w.q_token0 + (w.row_begin + row) / group; }
  __device__ int64_t head(const AttentionWorkItem& w, int row) const {
    return static_cast<int64_t>(w.kv_head) * group + (w.row_begin + row) % group;
  }
  // Keys [0, limit) are visible to this row inside the item's range.
  __device__ int limit(const AttentionWorkItem& w, int row) const {
    if (row >= w.num_rows) return w.kv_end;
    return min(w.kv_end, w.causal_offset + (w.row_begin + row) / group + 1);
  }
  // Keys before this one are outside the row's sliding window.
  __device__ int first(const AttentionWorkItem& w, int row) const {
    if (row >= w.num_rows) return 0;
    return static_cast<int>(first_visible_key(w.causal_offset + (w.row_begin + row) / group + 1, window));
  }
};

template <typename T, int D>
__device__ __forceinline__ void load_kv_chunk(const HybridAttentionParams& p, const AttentionWorkItem& w, int start,
                                              T* sk, T* sv) {
  constexpr int kVecs = D / 8;
  const int32_t* table = p.block_tables + static_cast<int64_t>(w.request) * p.max_blocks_per_seq;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  for (int v = threadIdx.x; v < kKeysPerChunk * kVecs; v += kThreads) {
    const int r = v / kVecs, col = (v % kVecs) * 8;
    const bool valid = start + r < w.kv_end;
    const int64_t off = valid ? p.layout.position_offset(table, start + r, w.kv_head) + col : 0;
    copy16(sk + swizzle<D>(r, col), kc + off, valid);
    copy16(sv + swizzle<D>(r, col), vc + off, valid);
  }
}

// Writes one finished row value pair (columns col, col+1) to out or to the partial slot.
template <typename T, int D>
__device__ __forceinline__ void store_pair(const HybridAttentionParams& p, const PlannedAttentionArgs& plan,
                                           const AttentionWorkItem& w, const RowMap& map, int row, int col, float a,
                                           float b) {
  if (w.partial < 0) {
    T* dst = static_cast<T*>(p.out) + map.token(w, row) * p.out_token_stride + map.head(w, row) * p.out_head_stride;
    *reinterpret_cast<uint32_t*>(dst + col) = MmaTraits<T>::pack(a, b);
  } else {
    float* dst = plan.partial_out + (static_cast<int64_t>(w.partial) + row) * D;  // the piece's rows of the pool
    *reinterpret_cast<float2*>(dst + col) = make_float2(a, b);
  }
}

// Scores in the log2 domain: s * scale log2(e), or with a soft cap
// cap log2(e) tanh(s * scale / cap). The host folds the constants: score_scale is
// scale log2(e) or scale / cap, softcap_log2 is cap log2(e) or 0 (off).
struct ScoreMap {
  float score_scale;
  float softcap_log2;
  __device__ __forceinline__ float operator()(float s) const {
    return softcap_log2 > 0.0f ? softcap_log2 * tanhf(s * score_scale) : s * score_scale;
  }
};

// One work item. Narrow tiles: 16 rows, warp w scores keys [16w, 16w + 16) of every
// chunk, and the 4 partial softmax states are merged at the end. Wide tiles: 64 rows,
// warp w owns rows [16w, 16w + 16) against all 64 keys of every chunk.
template <typename T, int D, bool kNarrow>
__device__ void run_item(const HybridAttentionParams& p, const PlannedAttentionArgs& plan, const AttentionWorkItem& w,
                         const ScoreMap& score, T* sq, T* sk, T* sv) {
  constexpr int kRows = kNarrow ? kNarrowTileRows : kWideTileRows;
  constexpr int kWarpKeys = kNarrow ? kKeysPerChunk / kWarps : kKeysPerChunk;
  constexpr int kScoreTiles = kWarpKeys / 8;
  constexpr int kOutTiles = D / 8;
  constexpr int kSteps = D / 16;
  constexpr int kVecs = D / 8;
  constexpr int kStage = kKeysPerChunk * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad_row = lane / 4, quad_col = (lane % 4) * 2;
  const int row0 = kNarrow ? 0 : warp * 16;
  const int key0 = kNarrow ? warp * kWarpKeys : 0;
  const RowMap map{static_cast<int>(p.num_q_heads / p.layout.num_kv_heads), p.window};

  for (int v = threadIdx.x; v < kRows * kVecs; v += kThreads) {
    const int r = v / kVecs, col = (v % kVecs) * 8;
    const bool valid = r < w.num_rows;
    const int rr = valid ? r : 0;
    const T* src = static_cast<const T*>(p.q) + map.token(w, rr) * p.q_token_stride + map.head(w, rr) * p.q_head_stride;
    copy16(sq + swizzle<D>(r, col), src + col, valid);
  }
  load_kv_chunk<T, D>(p, w, w.kv_begin, sk, sv);
  cute::cp_async_fence();

  float acc[kOutTiles][4] = {};
  float m[2] = {kNegInf, kNegInf};
  float l[2] = {0.0f, 0.0f};
  const int limit[2] = {map.limit(w, row0 + quad_row), map.limit(w, row0 + quad_row + 8)};
  const int first[2] = {map.first(w, row0 + quad_row), map.first(w, row0 + quad_row + 8)};
  uint32_t qf[kSteps][4];

  const int num_chunks = (w.kv_end - w.kv_begin + kKeysPerChunk - 1) / kKeysPerChunk;
  for (int c = 0; c < num_chunks; ++c) {
    const int start = w.kv_begin + c * kKeysPerChunk;
    if (c + 1 < num_chunks) {
      load_kv_chunk<T, D>(p, w, start + kKeysPerChunk, sk + ((c + 1) & 1) * kStage, sv + ((c + 1) & 1) * kStage);
      cute::cp_async_fence();
      cute::cp_async_wait<1>();
    } else {
      cute::cp_async_wait<0>();
    }
    __syncthreads();
    if (c == 0) {
      #pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int m8 = lane / 8;
        ldsm(sq + swizzle<D>(row0 + (m8 % 2) * 8 + lane % 8, s * 16 + (m8 / 2) * 8), qf[s]);
      }
    }
    const T* kt = sk + (c & 1) * kStage;
    const T* vt = sv + (c & 1) * kStage;

    float s[kScoreTiles][4] = {};
    #pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      #pragma unroll
      for (int n = 0; n < kScoreTiles; n += 2) {
        uint32_t b[4];
        const int m8 = lane / 8;
        ldsm(kt + swizzle<D>(key0 + n * 8 + (m8 / 2) * 8 + lane % 8, st * 16 + (m8 % 2) * 8), b);
        mma<T>(s[n], qf[st], b[0], b[1]);
        mma<T>(s[n + 1], qf[st], b[2], b[3]);
      }
    }

    // Online softmax in the log2 domain; a thread holds rows quad_row and quad_row + 8.
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = kNegInf;
      #pragma unroll
      for (int n = 0; n < kScoreTiles; ++n) {
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int key = start + key0 + n * 8 + quad_col + j;
          const float x = key < limit[i] && key >= first[i] ? score(s[n][2 * i + j]) : kNegInf;
          s[n][2 * i + j] = x;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[i], mx);
      const float m_use = m_new == kNegInf ? 0.0f : m_new;  // a row with no key yet stays at 0
      const float alpha = exp2f(m[i] - m_use);
      m[i] = m_new;
      float sum = 0.0f;
      #pragma unroll
      for (int n = 0; n < kScoreTiles; ++n) {
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float e = exp2f(s[n][2 * i + j] - m_use);
          s[n][2 * i + j] = e;
          sum += e;
        }
      }
      l[i] = l[i] * alpha + sum;  // per-thread partial sum; the quad is reduced at the end
      #pragma unroll
      for (int d = 0; d < kOutTiles; ++d) {
        acc[d][2 * i] *= alpha;
        acc[d][2 * i + 1] *= alpha;
      }
    }

    // P.V: the score accumulators are already laid out as the A operand of the next mma.
    #pragma unroll
    for (int kj = 0; kj < kWarpKeys / 16; ++kj) {
      const uint32_t a[4] = {MmaTraits<T>::pack(s[2 * kj][0], s[2 * kj][1]),
                             MmaTraits<T>::pack(s[2 * kj][2], s[2 * kj][3]),
                             MmaTraits<T>::pack(s[2 * kj + 1][0], s[2 * kj + 1][1]),
                             MmaTraits<T>::pack(s[2 * kj + 1][2], s[2 * kj + 1][3])};
      #pragma unroll
      for (int dn = 0; dn < kOutTiles; dn += 2) {
        uint32_t b[4];
        const int m8 = lane / 8;
        ldsm_trans(vt + swizzle<D>(key0 + kj * 16 + (m8 % 2) * 8 + lane % 8, dn * 8 + (m8 / 2) * 8), b);
        mma<T>(acc[dn], a, b[0], b[1]);
        mma<T>(acc[dn + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }
  cute::cp_async_wait<0>();

  #pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }

  if constexpr (!kNarrow) {
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = row0 + quad_row + 8 * i;
      if (row >= w.num_rows) continue;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      #pragma unroll
      for (int d = 0; d < kOutTiles; ++d) {
        store_pair<T, D>(p, plan, w, map, row, d * 8 + quad_col, acc[d][2 * i] * inv, acc[d][2 * i + 1] * inv);
      }
      if (w.partial >= 0 && lane % 4 == 0) {
        plan.partial_lse[static_cast<int64_t>(w.partial) + row] =
            l[i] > 0.0f ? m[i] + log2f(l[i]) : kNegInf;
      }
    }
  } else {
    // Merge the 4 warps' states of the same 16 rows through the now idle K/V stages.
    float* red = reinterpret_cast<float*>(sk);   // [warp][row][D], scaled accumulators
    float* stats = reinterpret_cast<float*>(sq);  // [warp][row] maxima, then [warp][row] sums
    if (lane % 4 == 0) {
      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        stats[warp * 16 + quad_row + 8 * i] = m[i];
        stats[kWarps * 16 + warp * 16 + quad_row + 8 * i] = l[i];
      }
    }
    __syncthreads();
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = quad_row + 8 * i;
      float mx = kNegInf;
      #pragma unroll
      for (int q = 0; q < kWarps; ++q) mx = fmaxf(mx, stats[q * 16 + row]);
      const float f = m[i] == kNegInf ? 0.0f : exp2f(m[i] - mx);
      #pragma unroll
      for (int d = 0; d < kOutTiles; ++d) {
        *reinterpret_cast<float2*>(red + (warp * 16 + row) * D + d * 8 + quad_col) =
            make_float2(acc[d][2 * i] * f, acc[d][2 * i + 1] * f);
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < w.num_rows * D / 2; e += kThreads) {
      const int row = (2 * e) / D, col = (2 * e) % D;
      float mx = kNegInf;
      #pragma unroll
      for (int q = 0; q < kWarps; ++q) mx = fmaxf(mx, stats[q * 16 + row]);
      float sum = 0.0f, a = 0.0f, b = 0.0f;
      #pragma unroll
      for (int q = 0; q < kWarps; ++q) {
        const float wm = stats[q * 16 + row];
        sum += wm == kNegInf ? 0.0f : stats[kWarps * 16 + q * 16 + row] * exp2f(wm - mx);
        a += red[(q * 16 + row) * D + col];
        b += red[(q * 16 + row) * D + col + 1];
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      store_pair<T, D>(p, plan, w, map, row, col, a * inv, b * inv);
      if (w.partial >= 0 && col == 0) {
        plan.partial_lse[static_cast<int64_t>(w.partial) + row] =
            sum > 0.0f ? mx + log2f(sum) : kNegInf;
      }
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2)
    hybrid_attention_kernel(HybridAttentionParams p, PlannedAttentionArgs plan, ScoreMap score) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* sq = reinterpret_cast<T*>(smem);
  T* sk = sq + kWideTileRows * D;
  T* sv = sk + 2 * kKeysPerChunk * D;
  const int32_t* cta_begin = plan.plan + plan.capacity.cta_begin_offset();
  const auto* items = reinterpret_cast<const AttentionWorkItem*>(plan.plan + plan.capacity.items_offset());
  for (int i = cta_begin[blockIdx.x]; i < cta_begin[blockIdx.x + 1]; ++i) {
    const AttentionWorkItem w = items[i];
    if (w.kind == static_cast<int32_t>(TileKind::kNarrow)) {
      run_item<T, D, true>(p, plan, w, score, sq, sk, sv);
    } else {
      run_item<T, D, false>(p, plan, w, score, sq, sk, sv);
    }
    __syncthreads();  // the next item reuses shared memory
  }
}

template <typename T, int D>
Status launch_hybrid_attention(const HybridAttentionParams& p, const PlannedAttentionArgs& plan, cudaStream_t stream) {
  auto kernel = hybrid_attention_kernel<T, D>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes<D>());
  if (err == cudaSuccess) {
    const bool capped = p.softcap > 0.0f;
    const ScoreMap score{capped ? p.scale / p.softcap : p.scale * kLog2e, capped ? p.softcap * kLog2e : 0.0f};
    kernel<<<static_cast<unsigned>(plan.capacity.num_ctas), kThreads, shared_bytes<D>(), stream>>>(
        p, plan, score);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) return Status::DeviceError(std::string("hybrid_attention launch failed: ") + cudaGetErrorString(err));
  return Status::Ok();
}

template <typename T, int D>
Status ctas_per_sm(int* out) {
  auto kernel = hybrid_attention_kernel<T, D>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes<D>());
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, kernel, kThreads, shared_bytes<D>());
  if (err != cudaSuccess) return Status::DeviceError(std::string("occupancy query failed: ") + cudaGetErrorString(err));
  return Status::Ok();
}

// Explicit instantiations live in attention_{fp16,bf16}.cu, one dtype per file.
#define SARATHI_RT_INSTANTIATE_ATTENTION(T, D)                                                            \
  template Status launch_hybrid_attention<T, D>(const HybridAttentionParams&, const PlannedAttentionArgs&, \
                                                 cudaStream_t);                                            \
  template Status ctas_per_sm<T, D>(int*);

}  // namespace attn
}  // namespace sarathi_rt

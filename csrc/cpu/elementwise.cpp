// CPU kernels of the fused elementwise ops: one token row per OpenMP iteration, float32
// math, one rounding to the storage dtype per stored value (plus the ones HF's RMSNorm
// makes, which rms_norm reproduces on purpose).
#include <cmath>
#include <limits>
#include <string>

#include "cpu_simd.h"
#include "sarathi_rt/elementwise.h"

namespace sarathi_rt {
namespace {

// Below this many elements the OpenMP fork costs more than the work.
constexpr int64_t kParallelElems = 1 << 14;

template <int W>
using vec = cpu::vec<W>;

// One token row of rms_norm, at the level's register width W. The (rounded) sum is the
// new residual and what gets normalized, as in HF, where `hidden = hidden + residual`
// happens in the storage dtype; the normalized value is rounded to the storage dtype
// before the weight multiplies it, as HF's cast does. Whole vectors first, then the tail
// on its own (see silu_and_mul_row). The sum of squares runs per lane then through
// reduce_add's fixed tree, so a row's result does not depend on the rows beside it.
template <typename T, int W>
SRT_SIMD_INLINE void rms_norm_row(const RMSNormParams& p, int64_t t) {
  const int64_t H = p.hidden, full = H - H % W, tail = H - full;
  const T* x = static_cast<const T*>(p.x) + t * p.x_stride;
  const T* w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + t * p.out_stride;
  const T* src = x;
  if (p.residual != nullptr) {
    const T* res = static_cast<const T*>(p.residual) + t * p.residual_stride;
    T* res_out = static_cast<T*>(p.residual_out) + t * p.residual_out_stride;
    for (int64_t i = 0; i < full; i += W) cpu::store_as<T, W>(res_out + i, cpu::load<W>(x + i) + cpu::load<W>(res + i));
    if (tail > 0) {
      const vec<W> sum = cpu::load_partial<W>(x + full, tail) + cpu::load_partial<W>(res + full, tail);
      cpu::store_row<T, W>(res_out, full, H, sum);
    }
    src = res_out;
  }
  vec<W> sum_sq{};
  for (int64_t i = 0; i < full; i += W) {
    const vec<W> v = cpu::load<W>(src + i);
    sum_sq += v * v;
  }
  if (tail > 0) {
    const vec<W> v = cpu::load_partial<W>(src + full, tail);
    sum_sq += v * v;
  }
  const float inv_rms = 1.0f / std::sqrt(cpu::reduce_add<W>(sum_sq) / static_cast<float>(H) + p.eps);
  for (int64_t i = 0; i < full; i += W) {
    cpu::store_as<T, W>(out + i, cpu::round_to<T, W>(cpu::load<W>(src + i) * inv_rms) * cpu::load<W>(w + i));
  }
  if (tail > 0) {
    const vec<W> normed = cpu::round_to<T, W>(cpu::load_partial<W>(src + full, tail) * inv_rms);
    cpu::store_row<T, W>(out, full, H, normed * cpu::load_partial<W>(w + full, tail));
  }
}

// Both halves of a head (x1 = x[i..], x2 = x[half + i..]) rotated in place, each value
// rounded once: (x1 cos - x2 sin, x2 cos + x1 sin). Whole vectors, then the tail.
template <typename T, int W>
SRT_SIMD_INLINE void rotate_head(T* x, const float* cos, const float* sin, int64_t half) {
  const int64_t full = half - half % W, tail = half - full;
  for (int64_t i = 0; i < full; i += W) {
    const vec<W> x1 = cpu::load<W>(x + i), x2 = cpu::load<W>(x + half + i);
    const vec<W> c = cpu::load<W>(cos + i), s = cpu::load<W>(sin + i);
    cpu::store_as<T, W>(x + i, x1 * c - x2 * s);
    cpu::store_as<T, W>(x + half + i, x2 * c + x1 * s);
  }
  if (tail > 0) {
    const vec<W> x1 = cpu::load_partial<W>(x + full, tail), x2 = cpu::load_partial<W>(x + half + full, tail);
    const vec<W> c = cpu::load_partial<W>(cos + full, tail), s = cpu::load_partial<W>(sin + full, tail);
    cpu::store_row<T, W>(x, full, half, x1 * c - x2 * s);
    cpu::store_row<T, W>(x + half, full, half, x2 * c + x1 * s);
  }
}

// Every q and k head of token t, at the level's register width W.
template <typename T, int W>
SRT_SIMD_INLINE void rotary_token(const RotaryParams& p, int64_t t) {
  const int64_t half = p.rotary_dim / 2;
  const float* cos = p.cos_sin_cache + p.positions[t] * p.rotary_dim;
  const float* sin = cos + half;
  T* q = static_cast<T*>(p.q) + t * p.q_token_stride;
  T* k = static_cast<T*>(p.k) + t * p.k_token_stride;
  for (int64_t h = 0; h < p.num_q_heads; ++h) rotate_head<T, W>(q + h * p.q_head_stride, cos, sin, half);
  for (int64_t h = 0; h < p.num_kv_heads; ++h) rotate_head<T, W>(k + h * p.k_head_stride, cos, sin, half);
}

// silu(g) = g * sigmoid(g), with sigmoid from one 2^x of a non-positive argument
// (e^-|g|), so it never overflows: 1 / (1 + t) for g >= 0, t / (1 + t) below.
template <int W>
SRT_SIMD_INLINE vec<W> silu(const vec<W>& g) {
  const cpu::ivec<W> negative = cpu::less<W>(g, cpu::splat<W>(0.0f));
  const vec<W> neg_abs = cpu::select<W>(negative, g, -g);
  const vec<W> t = cpu::exp2_nonpositive<W>(neg_abs * 1.4426950408889634f);  // log2(e)
  const vec<W> sigmoid = cpu::select<W>(negative, t, cpu::splat<W>(1.0f)) / (1.0f + t);
  return g * sigmoid;
}

// Token t's row in W-float vectors (cpu::for_each_token compiles it per level). Whole
// vectors first, then the tail on its own: with load_row's tail branch inside the loop
// GCC ran every load through memory (2.5x the loop's time). Each lane is computed on its
// own, so the width does not change a bit of the result.
template <typename T, int W>
SRT_SIMD_INLINE void silu_and_mul_row(const SiluAndMulParams& p, int64_t t) {
  const int64_t I = p.intermediate;
  const T* gate = static_cast<const T*>(p.x) + t * p.x_stride;
  const T* up = gate + I;
  T* o = static_cast<T*>(p.out) + t * p.out_stride;
  int64_t i = 0;
  for (; i + W <= I; i += W) {
    cpu::store_row<T, W>(o, i, I, silu<W>(cpu::load<W>(gate + i)) * cpu::load<W>(up + i));
  }
  if (i < I) {
    cpu::store_row<T, W>(o, i, I, silu<W>(cpu::load_partial<W>(gate + i, I - i)) * cpu::load_partial<W>(up + i, I - i));
  }
}

// (v, i) beats (best, at) as torch.argmax ranks them: a NaN beats every number; between
// two NaNs or two equal values the lower index wins.
SRT_SIMD_INLINE bool beats(float v, int64_t i, float best, int64_t at) {
  if (std::isnan(best)) return std::isnan(v) && i < at;
  return std::isnan(v) || v > best || (v == best && i < at);
}

// Row t's argmax, at the level's register width W: each lane keeps the first index of its
// largest value (a later one replaces it only when strictly larger, or a NaN over a
// number), then the lanes pick their winner and the tail is ranked against it by
// `beats` (a row shorter than four vectors: all of it). Four such (value, index)
// vectors take turns, as one's compare-and-blend chain is several cycles a vector; any
// of them may take any later vector, as its lanes still see increasing indices. torch's
// argmax reads a row one element at a time: 24 us for 64 rows of 512 logits on one core,
// 3% of a tiny decode step.
template <typename T, int W>
SRT_SIMD_INLINE void argmax_row(const ArgmaxParams& p, int64_t t) {
  constexpr int kPairs = 4;
  const T* x = static_cast<const T*>(p.x) + t * p.x_stride;
  float best = cpu::to_float(x[0]);
  int64_t at = 0, i = 1;
  if (p.n >= kPairs * W) {
    vec<W> top[kPairs];
    cpu::ivec<W> index[kPairs];
    const auto update = [&](int a, int64_t from) SRT_SIMD_INLINE_LAMBDA {
      const vec<W> v = cpu::load<W>(x + from);
      const cpu::ivec<W> take = (v > top[a]) | ((v != v) & (top[a] == top[a]));
      top[a] = cpu::select<W>(take, v, top[a]);
      index[a] = (take & (cpu::iota<W>() + static_cast<int32_t>(from))) | (~take & index[a]);
    };
    for (int a = 0; a < kPairs; ++a) {
      top[a] = cpu::load<W>(x + a * W);
      index[a] = cpu::iota<W>() + a * W;
    }
    for (i = kPairs * W; i + kPairs * W <= p.n; i += kPairs * W) {
      for (int a = 0; a < kPairs; ++a) update(a, i + a * W);
    }
    for (; i + W <= p.n; i += W) update(0, i);
    // The winner among the lanes, without a branch per lane (ranking them one by one with
    // `beats` cost more than the loop): the lowest index holding a NaN if any lane holds
    // one, else the lowest holding the largest value.
    cpu::ivec<W> nan = top[0] != top[0];
    for (int a = 1; a < kPairs; ++a) nan |= top[a] != top[a];
    bool any_nan = false;
    for (int l = 0; l < W; ++l) any_nan |= nan[l] != 0;
    cpu::ivec<W> wanted[kPairs];
    if (any_nan) {
      for (int a = 0; a < kPairs; ++a) wanted[a] = top[a] != top[a];
    } else {
      vec<W> largest = top[0];
      for (int a = 1; a < kPairs; ++a) largest = cpu::select<W>(top[a] > largest, top[a], largest);
      const vec<W> m = cpu::splat<W>(cpu::reduce_max<W>(largest));
      for (int a = 0; a < kPairs; ++a) wanted[a] = top[a] == m;
    }
    const cpu::ivec<W> none = cpu::ivec<W>{} + std::numeric_limits<int32_t>::max();
    cpu::ivec<W> lowest = none;
    for (int a = 0; a < kPairs; ++a) {
      const cpu::ivec<W> candidate = (wanted[a] & index[a]) | (~wanted[a] & none);
      const cpu::ivec<W> lower = candidate < lowest;
      lowest = (lower & candidate) | (~lower & lowest);
    }
    at = lowest[0];
    for (int l = 1; l < W; ++l) at = std::min<int64_t>(at, lowest[l]);
    best = cpu::to_float(x[at]);
  }
  for (; i < p.n; ++i) {
    const float v = cpu::to_float(x[i]);
    if (beats(v, i, best, at)) best = v, at = i;
  }
  p.out[t] = at;
}

template <template <typename> class Fn, typename P>
void dispatch(const P& p) {
  switch (p.dtype) {
    case DType::kFloat32: Fn<float>::run(p); break;
    case DType::kFloat16: Fn<cpu::f16>::run(p); break;
    case DType::kBFloat16: Fn<cpu::bf16>::run(p); break;
  }
}

template <typename T>
struct RMSNormFn {
  template <int W>
  struct Row {
    static SRT_SIMD_INLINE void run(const RMSNormParams& p, int64_t t) { rms_norm_row<T, W>(p, t); }
  };
  static void run(const RMSNormParams& p) { cpu::for_each_token<Row>(p, p.num_tokens * p.hidden > kParallelElems); }
};
template <typename T>
struct RotaryFn {
  template <int W>
  struct Row {
    static SRT_SIMD_INLINE void run(const RotaryParams& p, int64_t t) { rotary_token<T, W>(p, t); }
  };
  static void run(const RotaryParams& p) {
    cpu::for_each_token<Row>(p, p.num_tokens * (p.num_q_heads + p.num_kv_heads) * p.rotary_dim > kParallelElems);
  }
};
template <typename T>
struct SiluAndMulFn {
  template <int W>
  struct Row {
    static SRT_SIMD_INLINE void run(const SiluAndMulParams& p, int64_t t) { silu_and_mul_row<T, W>(p, t); }
  };
  static void run(const SiluAndMulParams& p) {
    cpu::for_each_token<Row>(p, p.num_tokens * p.intermediate > kParallelElems);
  }
};

template <typename T>
struct ArgmaxFn {
  // At most 8 lanes: GCC 12 lowers the 16-lane compare-and-blend of argmax_row to scalar
  // code in the AVX-512 clone (62 us for 64 rows of 512 logits, against 6 at 8 lanes).
  template <int W>
  struct Row {
    static SRT_SIMD_INLINE void run(const ArgmaxParams& p, int64_t t) { argmax_row<T, (W < 8 ? W : 8)>(p, t); }
  };
  static void run(const ArgmaxParams& p) { cpu::for_each_token<Row>(p, p.num_tokens * p.n > kParallelElems); }
};

}  // namespace

Status rms_norm_cpu(const RMSNormParams& p) {
  if (p.hidden <= 0) return Status::Invalid("rms_norm: hidden size must be positive, got " + std::to_string(p.hidden));
  if (p.residual != nullptr && p.residual_out == nullptr) {
    return Status::Invalid("rms_norm: residual given without residual_out");
  }
  dispatch<RMSNormFn>(p);
  return Status::Ok();
}

Status rotary_embedding_cpu(const RotaryParams& p) {
  if (p.rotary_dim <= 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim) {
    return Status::Invalid("rotary_embedding: rotary_dim must be even and in [2, head_dim=" +
                           std::to_string(p.head_dim) + "], got " + std::to_string(p.rotary_dim));
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (!rotary_position_ok(p.positions[t], p.max_position)) {
      return Status::Invalid("positions[" + std::to_string(t) + "] = " + std::to_string(p.positions[t]) +
                             " is outside [0, " + std::to_string(p.max_position) + ") covered by cos_sin_cache");
    }
  }
  dispatch<RotaryFn>(p);
  return Status::Ok();
}

Status silu_and_mul_cpu(const SiluAndMulParams& p) {
  if (p.intermediate <= 0) {
    return Status::Invalid("silu_and_mul: intermediate size must be positive, got " + std::to_string(p.intermediate));
  }
  dispatch<SiluAndMulFn>(p);
  return Status::Ok();
}

Status argmax_rows_cpu(const ArgmaxParams& p) {
  if (p.n <= 0) return Status::Invalid("argmax: rows must have at least one element, got " + std::to_string(p.n));
  if (p.n > std::numeric_limits<int32_t>::max()) {  // the lanes keep their indices in int32
    return Status::Invalid("argmax: rows of at most 2^31 - 1 elements, got " + std::to_string(p.n));
  }
  dispatch<ArgmaxFn>(p);
  return Status::Ok();
}

}  // namespace sarathi_rt

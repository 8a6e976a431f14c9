// CPU kernels of the fused elementwise ops: one token row per OpenMP iteration, float32
// math, one rounding to the storage dtype per stored value (plus the ones HF's RMSNorm
// makes, which rms_norm reproduces on purpose).
#include <cmath>
#include <string>

#include "cpu_simd.h"
#include "sarathi_rt/elementwise.h"

namespace sarathi_rt {
namespace {

// Below this many elements the OpenMP fork costs more than the work.
constexpr int64_t kParallelElems = 1 << 14;

template <typename T>
T round_to(float x) {
  return cpu::from_float<T>(x);
}

template <typename T>
void rms_norm_rows(const RMSNormParams& p) {
  const auto* x = static_cast<const T*>(p.x);
  const auto* res = static_cast<const T*>(p.residual);
  const auto* w = static_cast<const T*>(p.weight);
  auto* out = static_cast<T*>(p.out);
  auto* res_out = static_cast<T*>(p.residual_out);
  const int64_t H = p.hidden;
#pragma omp parallel for schedule(static) if (p.num_tokens * H > kParallelElems)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const T* xr = x + t * p.x_stride;
    T* outr = out + t * p.out_stride;
    // The (rounded) sum is the new residual and what gets normalized, as in HF, where
    // `hidden = hidden + residual` happens in the storage dtype.
    const T* src = xr;
    if (res != nullptr) {
      const T* rr = res + t * p.residual_stride;
      T* ro = res_out + t * p.residual_out_stride;
      for (int64_t i = 0; i < H; ++i) ro[i] = round_to<T>(cpu::to_float(xr[i]) + cpu::to_float(rr[i]));
      src = ro;
    }
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < H; ++i) {
      const float v = cpu::to_float(src[i]);
      sum_sq += v * v;
    }
    const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(H) + p.eps);
    for (int64_t i = 0; i < H; ++i) {
      const float normed = cpu::to_float(round_to<T>(cpu::to_float(src[i]) * inv_rms));
      outr[i] = round_to<T>(normed * cpu::to_float(w[i]));
    }
  }
}

template <typename T>
void rotate_head(T* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = cpu::to_float(x[i]);
    const float x2 = cpu::to_float(x[i + half]);
    x[i] = round_to<T>(x1 * cos[i] - x2 * sin[i]);
    x[i + half] = round_to<T>(x2 * cos[i] + x1 * sin[i]);
  }
}

template <typename T>
void rotary_rows(const RotaryParams& p) {
  auto* q = static_cast<T*>(p.q);
  auto* k = static_cast<T*>(p.k);
  const int64_t half = p.rotary_dim / 2;
  const int64_t work = p.num_tokens * (p.num_q_heads + p.num_kv_heads) * p.rotary_dim;
#pragma omp parallel for schedule(static) if (work > kParallelElems)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const float* cos = p.cos_sin_cache + p.positions[t] * p.rotary_dim;
    const float* sin = cos + half;
    for (int64_t h = 0; h < p.num_q_heads; ++h) rotate_head(q + t * p.q_token_stride + h * p.q_head_stride, cos, sin, half);
    for (int64_t h = 0; h < p.num_kv_heads; ++h) rotate_head(k + t * p.k_token_stride + h * p.k_head_stride, cos, sin, half);
  }
}

// silu(g) = g * sigmoid(g), with sigmoid from one 2^x of a non-positive argument
// (e^-|g|), so it never overflows: 1 / (1 + t) for g >= 0, t / (1 + t) below.
SRT_SIMD_INLINE cpu::vf silu(const cpu::vf& g) {
  const cpu::vi negative = cpu::less(g, cpu::splat(0.0f));
  const cpu::vf neg_abs = cpu::select(negative, g, -g);
  const cpu::vf t = cpu::exp2_nonpositive(neg_abs * 1.4426950408889634f);  // log2(e)
  const cpu::vf sigmoid = cpu::select(negative, t, cpu::splat(1.0f)) / (1.0f + t);
  return g * sigmoid;
}

// One row, compiled per ISA level. The level is picked outside the OpenMP loop and the
// compiled row called inside it: GCC outlines a parallel loop's body into a function of
// its own that no target attribute reaches, so a compiled function holding the loop runs
// its vectors at the baseline ISA (SSE2) on every CPU (2-4x the time of AVX2 here).
// Whole vectors first, then the tail on its own: with load_row's tail branch inside
// the loop GCC ran every load through memory (2.5x the loop's time).
template <typename T>
SRT_SIMD_INLINE void silu_and_mul_row(const T* gate, T* o, int64_t I) {
  const T* up = gate + I;
  int64_t i = 0;
  for (; i + cpu::kLanes <= I; i += cpu::kLanes) {
    cpu::store_row(o, i, I, silu(cpu::load(gate + i)) * cpu::load(up + i));
  }
  if (i < I) cpu::store_row(o, i, I, silu(cpu::load_partial(gate + i, I - i)) * cpu::load_partial(up + i, I - i));
}
template <typename T>
using SiluRowFn = void (*)(const T*, T*, int64_t);
template <typename T>
SRT_TARGET_V4 void silu_and_mul_row_v4(const T* gate, T* o, int64_t I) { silu_and_mul_row(gate, o, I); }
template <typename T>
SRT_TARGET_V3 void silu_and_mul_row_v3(const T* gate, T* o, int64_t I) { silu_and_mul_row(gate, o, I); }
template <typename T>
void silu_and_mul_row_base(const T* gate, T* o, int64_t I) { silu_and_mul_row(gate, o, I); }

template <typename T>
void silu_and_mul_rows(const SiluAndMulParams& p) {
  const auto* x = static_cast<const T*>(p.x);
  auto* out = static_cast<T*>(p.out);
  const int64_t I = p.intermediate;
  const SiluRowFn<T> row = cpu::pick_isa<SiluRowFn<T>>(silu_and_mul_row_v4<T>, silu_and_mul_row_v3<T>,
                                                       silu_and_mul_row_base<T>);
#pragma omp parallel for schedule(static) if (p.num_tokens * I > kParallelElems)
  for (int64_t t = 0; t < p.num_tokens; ++t) row(x + t * p.x_stride, out + t * p.out_stride, I);
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
  static void run(const RMSNormParams& p) { rms_norm_rows<T>(p); }
};
template <typename T>
struct RotaryFn {
  static void run(const RotaryParams& p) { rotary_rows<T>(p); }
};
template <typename T>
struct SiluAndMulFn {
  static void run(const SiluAndMulParams& p) { silu_and_mul_rows<T>(p); }
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

}  // namespace sarathi_rt

// Portable 16-float vectors for the CPU kernels. GCC/Clang vector extensions lower them
// to whatever the target has (4 SSE registers, 2 AVX2 registers or 1 AVX-512 register),
// so one source serves every clone that SRT_CPU_CLONES asks for.
#pragma once

#include <cstdint>
#include <cstring>

// Compiles the hot function once per ISA level and picks one at load time (ifunc), so
// the wheel runs on any x86-64 yet uses AVX2/FMA/F16C or AVX-512 where present. The
// x86-64-v3/v4 levels are chosen by CPU features; a named arch (haswell, ...) would be
// chosen by CPU model and so never on AMD.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SRT_CPU_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define SRT_CPU_CLONES
#endif

// Helpers are always inlined so that each clone compiles them for its own ISA; for the
// same reason no vector crosses a call boundary, and GCC's note that passing one would
// depend on the ISA (-Wpsabi) does not apply.
#define SRT_SIMD_INLINE inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"

namespace sarathi_rt::cpu {

constexpr int64_t kLanes = 16;
using vf = float __attribute__((vector_size(kLanes * sizeof(float))));
using vi = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
constexpr vi kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

SRT_SIMD_INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
SRT_SIMD_INLINE void store(float* p, const vf& v) { std::memcpy(p, &v, sizeof(v)); }
SRT_SIMD_INLINE vf splat(float x) { return vf{} + x; }

SRT_SIMD_INLINE float reduce_add(const vf& v) {
  float s = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
SRT_SIMD_INLINE float reduce_max(const vf& v) {
  float m = v[0];
  for (int64_t i = 1; i < kLanes; ++i) m = m > v[i] ? m : v[i];
  return m;
}

// 2^x for x <= 0: n = nearest integer, 2^(x - n) by its Taylor series (|x - n| <= 1/2,
// relative error ~1e-7), times 2^n built in the exponent bits. Below -126 the result is
// exactly 0, so masked (-inf) scores contribute nothing; NaN stays NaN.
SRT_SIMD_INLINE vf exp2_nonpositive(const vf& x) {
  const vf clamped = x < -126.0f ? splat(-126.0f) : x;
  const vi n = __builtin_convertvector(clamped - 0.5f, vi);  // truncation rounds toward 0
  const vf r = clamped - __builtin_convertvector(n, vf);
  vf p = splat(1.5403530393381606e-4f);  // ln2^6 / 6!
  p = p * r + 1.3333558146428443e-3f;
  p = p * r + 9.6181291076284772e-3f;
  p = p * r + 5.5504108664821580e-2f;
  p = p * r + 2.4022650695910071e-1f;
  p = p * r + 6.9314718055994531e-1f;
  p = p * r + 1.0f;
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -126.0f ? vf{} : p * scale;
}

}  // namespace sarathi_rt::cpu

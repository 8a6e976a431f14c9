// Portable 16-float vectors for the CPU kernels. GCC/Clang vector extensions lower them
// to whatever the target has (4 SSE registers, 2 AVX2 registers or 1 AVX-512 register),
// so one source serves every clone that SRT_CPU_CLONES asks for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>

#include "cpu_dtype.h"

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

// Whether SRT_CPU_CLONES runs its x86-64-v4 clone here (AVX-512: 32 vector registers,
// each holding a whole vf), for kernels that size register blocks to the register file.
inline bool runs_avx512_clone() {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
  return __builtin_cpu_supports("x86-64-v4");
#else
  return false;
#endif
}

constexpr int64_t kLanes = 16;
using vf = float __attribute__((vector_size(kLanes * sizeof(float))));
using vi = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
constexpr vi kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

using vu16 = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
using vu32 = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));
using vh = f16 __attribute__((vector_size(kLanes * sizeof(f16))));

// kLanes elements from p as float32; half-precision converts in registers (exactly), so
// keys and values can be read straight from the cache pages.
SRT_SIMD_INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
SRT_SIMD_INLINE vf load(const f16* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vf);
}
SRT_SIMD_INLINE vf load(const bf16* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32 bits = __builtin_convertvector(h, vu32) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
// The first n (< kLanes) elements, zeros after them; never reads past p + n.
template <typename T>
SRT_SIMD_INLINE vf load_partial(const T* p, int64_t n) {
  T tail[kLanes] = {};
  std::memcpy(tail, p, n * sizeof(T));
  return load(tail);
}
// Lanes d .. d + kLanes of a row holding `len` valid elements (d is a multiple of kLanes).
template <typename T>
SRT_SIMD_INLINE vf load_row(const T* row, int64_t d, int64_t len) {
  return d + kLanes <= len ? load(row + d) : load_partial(row + d, len - d);
}
SRT_SIMD_INLINE void store(float* p, const vf& v) { std::memcpy(p, &v, sizeof(v)); }
// from_float<bf16> of every lane: round to nearest even, NaN to a quiet NaN.
SRT_SIMD_INLINE vu16 bf16_bits(const vf& v) {
  vu32 u;
  std::memcpy(&u, &v, sizeof(u));
  const vu32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu32 bits = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
  return __builtin_convertvector(bits, vu16);
}
// Lanes d .. d + kLanes of v into a row of `len` elements (d a multiple of kLanes), each
// rounded to T as from_float rounds it, without writing past row + len.
template <typename T>
SRT_SIMD_INLINE void store_row(T* row, int64_t d, int64_t len, const vf& v) {
  const int64_t n = d + kLanes <= len ? kLanes : len - d;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(row + d, &v, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, f16>) {
    const vh h = __builtin_convertvector(v, vh);
    std::memcpy(row + d, &h, n * sizeof(f16));
  } else {
    const vu16 h = bf16_bits(v);
    std::memcpy(row + d, &h, n * sizeof(uint16_t));
  }
}
// Asks for every cache line of [p, p + bytes) ahead of its use.
SRT_SIMD_INLINE void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}
// Lane 0 shuffled to every lane: one broadcast, which AVX-512 folds into an FMA's memory
// operand. (vf{} + x costs a scalar add first, as x + 0 is not x when x is -0, and a
// braced list of x made GCC 12 insert lane by lane.)
static_assert(kLanes == 16, "splat's shuffle names every lane");
SRT_SIMD_INLINE vf splat(float x) {
  const vf v = {x};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}

// Pairwise halving tree: a fixed order (so results are reproducible) that costs four
// vector adds instead of fifteen dependent scalar ones.
SRT_SIMD_INLINE float reduce_add(const vf& v) {
  using v8 = float __attribute__((vector_size(8 * sizeof(float))));
  using v4 = float __attribute__((vector_size(4 * sizeof(float))));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
// reduce_add of sixteen vectors at once: lane j of the result is reduce_add(v[j]), bit for
// bit (each level adds the same pairs, two vectors' worth per vector add), in 15 vector
// adds instead of 16 separate trees with their scalar tails.
SRT_SIMD_INLINE vf reduce_add16(const vf (&v)[kLanes]) {
  vf a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k) {  // a[k]: lanes i and i + 8 of v[2k] (lanes 0-7), v[2k+1] (8-15)
    a[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int k = 0; k < 4; ++k) {  // b[k]: a's lanes i and i + 4, four sources of four lanes
    b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int k = 0; k < 2; ++k) {  // c[k]: (b0 + b2, b1 + b3) of eight sources
    c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * k], b[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
// Any order gives the same maximum; the halving tree keeps it in vector registers.
SRT_SIMD_INLINE float reduce_max(const vf& v) {
  using v8 = float __attribute__((vector_size(8 * sizeof(float))));
  using v4 = float __attribute__((vector_size(4 * sizeof(float))));
  const v8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 a = lo > hi ? lo : hi;
  const v4 a0 = __builtin_shufflevector(a, a, 0, 1, 2, 3), a1 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const v4 b = a0 > a1 ? a0 : a1;
  const float m0 = b[0] > b[2] ? b[0] : b[2], m1 = b[1] > b[3] ? b[1] : b[3];
  return m0 > m1 ? m0 : m1;
}

// For std::vector: cache-line-aligned storage, so that no vector load or store of a
// buffer indexed in multiples of kLanes splits across two lines.
template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  bool operator==(const LineAllocator&) const { return true; }
  bool operator!=(const LineAllocator&) const { return false; }
};

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

// Portable 16-float vectors for the CPU kernels. GCC/Clang vector extensions lower them
// to whatever the target has (4 SSE registers, 2 AVX2 registers or 1 AVX-512 register),
// so one source serves every clone that SRT_CPU_CLONES asks for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#include "cpu_dtype.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>  // declares the AVX512-BF16 builtin and type dot_bf16 uses
#endif

// A hot function is compiled once per ISA level (SRT_TARGET_V3/V4 on a wrapper around an
// always-inlined body) and picked at run time by isa_level(), so the wheel runs on any
// x86-64 yet uses AVX2/FMA/F16C or AVX-512 where present, and a test (or
// SARATHI_RT_CPU_ISA) can run a lower level's code on a higher CPU. The x86-64-v3/v4
// levels are chosen by CPU features; a named arch (haswell, ...) would be chosen by CPU
// model and so never on AMD. Elsewhere every level compiles to the baseline.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SRT_ISA_LEVELS 1
#define SRT_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#define SRT_TARGET_V4 __attribute__((target("arch=x86-64-v4")))
#define SRT_TARGET_V4_BF16 __attribute__((target("arch=x86-64-v4,avx512bf16")))
#else
#define SRT_ISA_LEVELS 0
#define SRT_TARGET_V3
#define SRT_TARGET_V4
#define SRT_TARGET_V4_BF16
#endif

// Helpers are always inlined so that each clone compiles them for its own ISA; for the
// same reason no vector crosses a call boundary, and GCC's note that passing one would
// depend on the ISA (-Wpsabi) does not apply.
#define SRT_SIMD_INLINE inline __attribute__((always_inline))
// The same for a lambda's body (a lambda is a function of its own, with no target).
#define SRT_SIMD_INLINE_LAMBDA __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"

namespace sarathi_rt::cpu {

// The ISA level the kernels run: the CPU's own (the levels compiled for), unless
// set_isa_cap() lowered it. kV4Bf16 is x86-64-v4 with AVX512-BF16: only the bf16
// attention kernel has code of its own there (vdpbf16ps scores); every other kernel runs
// its kV4 code at that level.
enum class IsaLevel { kBase, kV3, kV4, kV4Bf16 };
IsaLevel native_isa_level();
IsaLevel isa_level();
// Caps isa_level() at `cap` (a level above the CPU's runs the CPU's); set by Python when
// the core loads (SARATHI_RT_CPU_ISA) and by the tests of each level.
void set_isa_cap(IsaLevel cap);
// The threads an OpenMP parallel region runs on (1 in a build without OpenMP).
int max_threads();
// Ends the OpenMP worker threads the calling thread started (its next parallel region
// starts new ones). libgomp keeps a team of workers per thread that ran a parallel region
// and, once more workers exist than cores, makes every worker sleep as soon as its region
// ends, so each region then waits for its workers to be woken: a thread handing the
// kernels over to another one calls this (engine/async_engine.py).
void release_threads();

// The register width, in floats, each level's clone of a kernel computes in: GCC keeps a
// vector wider than the target's registers in memory (see VecTypes below).
constexpr int kWidthV4 = 16, kWidthV3 = 8, kWidthBase = 4;

// The function of the running level among three compilations of one body (kV4Bf16 runs
// the v4 one).
template <typename Fn>
Fn pick_isa(Fn v4, Fn v3, Fn base) {
  switch (isa_level()) {
    case IsaLevel::kV4Bf16:
    case IsaLevel::kV4: return v4;
    case IsaLevel::kV3: return v3;
    case IsaLevel::kBase: break;
  }
  return base;
}

// Row<W>::run(p, t) (always inlined) for every token t < p.num_tokens, OpenMP-parallel
// when `parallel`, compiled once per ISA level at its register width W. The level is
// picked outside the OpenMP loop and the compiled row called inside it: GCC outlines a
// parallel loop's body into a function of its own that no target attribute reaches, so
// a compiled function holding the loop would run its vectors at the baseline ISA (SSE2).
template <template <int> class Row, typename P>
SRT_TARGET_V4 void token_row_v4(const P& p, int64_t t) { Row<kWidthV4>::run(p, t); }
template <template <int> class Row, typename P>
SRT_TARGET_V3 void token_row_v3(const P& p, int64_t t) { Row<kWidthV3>::run(p, t); }
template <template <int> class Row, typename P>
void token_row_base(const P& p, int64_t t) { Row<kWidthBase>::run(p, t); }
template <template <int> class Row, typename P>
void for_each_token(const P& p, bool parallel) {
  using Fn = void (*)(const P&, int64_t);
  const Fn row = pick_isa<Fn>(token_row_v4<Row, P>, token_row_v3<Row, P>, token_row_base<Row, P>);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < p.num_tokens; ++t) row(p, t);
}

// Vectors of W floats (and the integer and half-precision vectors beside them). A kernel
// whose hot loop must stay in registers takes W as a template parameter and is compiled
// once per ISA level at that level's register width (SRT_TARGET_V3/V4 above): GCC
// keeps a vector wider than the target's registers in memory, so 16-float vectors on an
// AVX2 core pay a store and reload (often split, failing store forwarding) around every
// operation. The helpers default to kLanes, the width the other kernels use everywhere.
template <int W>
struct VecTypes {
  typedef float f __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t i __attribute__((vector_size(W * sizeof(int32_t))));
  typedef uint16_t u16 __attribute__((vector_size(W * sizeof(uint16_t))));
  typedef uint32_t u32 __attribute__((vector_size(W * sizeof(uint32_t))));
  typedef f16 h __attribute__((vector_size(W * sizeof(f16))));
};
template <int W>
using vec = typename VecTypes<W>::f;
template <int W>
using ivec = typename VecTypes<W>::i;

constexpr int64_t kLanes = 16;
using vf = vec<kLanes>;
using vi = ivec<kLanes>;
using vu16 = VecTypes<kLanes>::u16;
using vu32 = VecTypes<kLanes>::u32;
using vh = VecTypes<kLanes>::h;

// __builtin_shufflevector(a, b, Map::lane(0), ..., Map::lane(N - 1)): N lanes picked from
// a (indices < W) and b (W and up), the indices computed at compile time.
template <typename Map, typename V, typename Out, size_t... I>
SRT_SIMD_INLINE Out shuffle_impl(const V& a, const V& b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, Map::lane(I)...);
}
template <int N, typename Map, typename V>
SRT_SIMD_INLINE vec<N> shuffle(const V& a, const V& b) {
  return shuffle_impl<Map, V, vec<N>>(a, b, std::make_index_sequence<N>{});
}
template <int Offset>
struct Run {  // lanes Offset, Offset + 1, ...
  static constexpr int lane(size_t i) { return Offset + static_cast<int>(i); }
};
struct Zero {
  static constexpr int lane(size_t) { return 0; }
};
template <int W>
SRT_SIMD_INLINE vec<W / 2> low_half(const vec<W>& v) { return shuffle<W / 2, Run<0>>(v, v); }
template <int W>
SRT_SIMD_INLINE vec<W / 2> high_half(const vec<W>& v) { return shuffle<W / 2, Run<W / 2>>(v, v); }

template <int W, size_t... I>
constexpr ivec<W> iota_impl(std::index_sequence<I...>) {
  return ivec<W>{static_cast<int32_t>(I)...};
}
template <int W>
constexpr ivec<W> iota() {  // lanes 0, 1, ..., W - 1
  return iota_impl<W>(std::make_index_sequence<W>{});
}
constexpr vi kIota = iota<kLanes>();

// W elements from p as float32; half-precision converts in registers (exactly), so keys
// and values can be read straight from the cache pages.
template <int W = kLanes>
SRT_SIMD_INLINE vec<W> load(const float* p) {
  vec<W> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <int W = kLanes>
SRT_SIMD_INLINE vec<W> load(const f16* p) {
  typename VecTypes<W>::h h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vec<W>);
}
template <int W = kLanes>
SRT_SIMD_INLINE vec<W> load(const bf16* p) {
  typename VecTypes<W>::u16 h;
  std::memcpy(&h, p, sizeof(h));
  const typename VecTypes<W>::u32 bits = __builtin_convertvector(h, typename VecTypes<W>::u32) << 16;
  vec<W> v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
// The first n (< W) elements, zeros after them; never reads past p + n. At 16 lanes (only
// the AVX-512 clones compute 16) one masked load: the copy through a zeroed stack buffer
// the narrower levels make stalls store forwarding, which made rotary at tiny's head_dim
// 16 (every row a tail at 16 lanes) cost 2% of a step. The builtins, not the intrinsics,
// for the reason dot_bf16 gives.
template <int W = kLanes, typename T>
SRT_SIMD_INLINE vec<W> load_partial(const T* p, int64_t n) {
#if SRT_ISA_LEVELS
  if constexpr (W == 16) {
    const auto mask = static_cast<__mmask16>((1u << n) - 1);
    if constexpr (std::is_same_v<T, float>) {
      return __builtin_ia32_loadups512_mask(p, vec<W>{}, mask);
    } else {
      static_assert(sizeof(T) == 2, "half precision bits");
      const auto bits = (typename VecTypes<W>::u16)__builtin_ia32_loaddquhi256_mask(
          reinterpret_cast<const short*>(p), __v16hi{}, mask);
      return load<W>(reinterpret_cast<const T*>(&bits));
    }
  }
#endif
  T tail[W] = {};
  std::memcpy(tail, p, n * sizeof(T));
  return load<W>(tail);
}
// Lanes d .. d + W of a row holding `len` valid elements (d is a multiple of W), zeros
// past them: rows padded to 16 floats end in whole vectors of zeros when W < 16.
template <int W = kLanes, typename T>
SRT_SIMD_INLINE vec<W> load_row(const T* row, int64_t d, int64_t len) {
  if (d + W <= len) return load<W>(row + d);
  return d < len ? load_partial<W>(row + d, len - d) : vec<W>{};
}
template <typename V>
SRT_SIMD_INLINE void store(float* p, const V& v) { std::memcpy(p, &v, sizeof(v)); }
// from_float<bf16> of every lane: round to nearest even, NaN to a quiet NaN.
template <int W = kLanes>
SRT_SIMD_INLINE typename VecTypes<W>::u16 bf16_bits(const vec<W>& v) {
  using u32 = typename VecTypes<W>::u32;
  u32 u;
  std::memcpy(&u, &v, sizeof(u));
  const u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const u32 bits = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
  return __builtin_convertvector(bits, typename VecTypes<W>::u16);
}
// All W lanes of v at p, each rounded to T as from_float rounds it.
template <typename T, int W = kLanes>
SRT_SIMD_INLINE void store_as(T* p, const vec<W>& v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, f16>) {
    const typename VecTypes<W>::h h = __builtin_convertvector(v, typename VecTypes<W>::h);
    std::memcpy(p, &h, sizeof(h));
  } else {
    const typename VecTypes<W>::u16 h = bf16_bits<W>(v);
    std::memcpy(p, &h, sizeof(h));
  }
}
// Lanes d .. d + W of v into a row of `len` elements (d a multiple of W), rounded as
// store_as rounds them, without writing past row + len.
template <typename T, int W = kLanes>
SRT_SIMD_INLINE void store_row(T* row, int64_t d, int64_t len, const vec<W>& v) {
  if (d + W <= len) {
    store_as<T, W>(row + d, v);
    return;
  }
#if SRT_ISA_LEVELS
  if constexpr (W == 16) {  // one masked store (see load_partial)
    const auto mask = static_cast<__mmask16>((1u << (len - d)) - 1);
    if constexpr (std::is_same_v<T, float>) {
      __builtin_ia32_storeups512_mask(row + d, v, mask);
    } else {
      typename VecTypes<W>::u16 bits;
      store_as<T, W>(reinterpret_cast<T*>(&bits), v);
      __builtin_ia32_storedquhi256_mask(reinterpret_cast<short*>(row + d), (__v16hi)bits, mask);
    }
    return;
  }
#endif
  T tail[W];
  store_as<T, W>(tail, v);
  std::memcpy(row + d, tail, (len - d) * sizeof(T));
}
// Every lane rounded to T (as store_row stores it) and read back as float32: the
// roundings HF's ops make between two steps in the storage dtype, kept in registers.
template <typename T, int W = kLanes>
SRT_SIMD_INLINE vec<W> round_to(const vec<W>& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, f16>) {
    return __builtin_convertvector(__builtin_convertvector(v, typename VecTypes<W>::h), vec<W>);
  } else {
    const typename VecTypes<W>::u32 bits = __builtin_convertvector(bf16_bits<W>(v), typename VecTypes<W>::u32) << 16;
    vec<W> out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
}
// Asks for every cache line of [p, p + bytes) ahead of its use.
SRT_SIMD_INLINE void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}
// The same into the L2 cache only: for data needed a while later, which would evict
// what is in use if it went to L1 (a 32-key chunk of 3 heads at head_dim 64 is 48 KB of
// float32 keys and values, more than an L1).
SRT_SIMD_INLINE void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 1);
}
// Lane 0 shuffled to every lane: one broadcast, which AVX-512 folds into an FMA's memory
// operand. (vf{} + x costs a scalar add first, as x + 0 is not x when x is -0, and a
// braced list of x made GCC 12 insert lane by lane.)
template <int W = kLanes>
SRT_SIMD_INLINE vec<W> splat(float x) {
  const vec<W> v = {x};
  return shuffle<W, Zero>(v, v);
}

// Pairwise halving tree: a fixed order (so results are reproducible) that costs log2(W)
// vector adds instead of W - 1 dependent scalar ones.
template <int W = kLanes>
SRT_SIMD_INLINE float reduce_add(const vec<W>& v) {
  if constexpr (W == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    return reduce_add<W / 2>(low_half<W>(v) + high_half<W>(v));
  }
}
// One level of reduce_addN: blocks of 2 * Half lanes of a (then of b) folded to Half lanes
// each, the low half of each block plus its high half.
template <int W, int Half, int Offset>
struct Fold {
  static constexpr int lane(size_t i) {
    const int o = static_cast<int>(i) % (W / 2), source = static_cast<int>(i) < W / 2 ? 0 : W;
    return source + (o / Half) * 2 * Half + o % Half + Offset;
  }
};
// Two vectors, a then b, folded by one tree level: each block of 2 * Half lanes to its low
// half plus its high half.
template <int W, int Half>
SRT_SIMD_INLINE vec<W> fold_pair(const vec<W>& a, const vec<W>& b) {
  return shuffle<W, Fold<W, Half, 0>>(a, b) + shuffle<W, Fold<W, Half, Half>>(a, b);
}
// reduce_addN at 8 lanes with the same adds, arranged so that only the first level crosses
// the 128-bit halves of an AVX2 register. fold_pair's lane order needs two-source
// permutes there, which AVX2 lacks (GCC built each from vpermd, blends and constants);
// here the first level pairs v[k] with v[k + 4] ([v[k]'s 4 sums | v[k + 4]'s]) and the
// other two are vshufps within each half, which leaves lane j holding v[j]'s sum. Every
// add has the operands of fold_pair's tree (lanes 4 apart, then 2, then 1), so the same
// bits.
SRT_SIMD_INLINE vec<8> reduce_add8(const vec<8>* v) {
  vec<8> x[4], y[2];
  for (int k = 0; k < 4; ++k) {
    x[k] = __builtin_shufflevector(v[k], v[k + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[k], v[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int k = 0; k < 2; ++k) {
    y[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(y[0], y[1], 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 9, 11, 5, 7, 13, 15);
}
// reduce_add of W vectors at once: lane j of the result sums v[j]'s lanes, every sum in
// the same fixed order (each level adds lanes Half apart, two vectors' worth per vector
// add), in W - 1 vector adds instead of W separate trees with their scalar tails.
template <int W, int Half = W / 2>
SRT_SIMD_INLINE vec<W> reduce_addN(const vec<W>* v) {
  if constexpr (W == 8 && Half == 4) {
    return reduce_add8(v);
  } else {
    vec<W> folded[Half];  // this level's vectors: W / 2, W / 4, ..., 1
    for (int k = 0; k < Half; ++k) folded[k] = fold_pair<W, Half>(v[2 * k], v[2 * k + 1]);
    if constexpr (Half == 1) {
      return folded[0];
    } else {
      return reduce_addN<W, Half / 2>(folded);
    }
  }
}
// reduce_addN's tree built as its W inputs arrive in order: add<j>(v) takes input j and
// folds each pair of siblings as soon as both are in, so at most log2(W) + 1 vectors are
// live where reduce_addN holds all W at once (for several rows, more vectors than there
// are registers: they went through the stack). The same pairs, folded in the same order:
// the same bits as reduce_addN.
template <int W>
class AddTree {
 public:
  template <int J>
  SRT_SIMD_INLINE void add(const vec<W>& v) {
    static_assert(J >= 0 && J < W, "one input per lane");
    push<J, 0>(v);
  }
  // Lane j: the sum of input j's lanes (once all W inputs are in).
  SRT_SIMD_INLINE const vec<W>& sums() const { return pending_[kLevels]; }

 private:
  static constexpr int kLevels = __builtin_ctz(W);
  // Node J of tree level Level (whose folds add lanes W >> (Level + 1) apart).
  template <int J, int Level>
  SRT_SIMD_INLINE void push(const vec<W>& v) {
    if constexpr (J % 2 == 0) {
      pending_[Level] = v;  // a left child waits for its sibling
    } else if constexpr (Level + 1 == kLevels) {
      pending_[kLevels] = fold_pair<W, 1>(pending_[Level], v);
    } else {
      push<J / 2, Level + 1>(fold_pair<W, (W >> (Level + 1))>(pending_[Level], v));
    }
  }
  vec<W> pending_[kLevels + 1];
};
// f(std::integral_constant<int, j>{}) for j = 0 .. N - 1 in order: a loop whose index is
// a compile-time constant in each copy of the body.
template <typename F, int... J>
SRT_SIMD_INLINE void unroll_impl(F&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}
template <int N, typename F>
SRT_SIMD_INLINE void unroll(F&& f) {
  unroll_impl(f, std::make_integer_sequence<int, N>{});
}
// Any order gives the same maximum; the halving tree keeps it in vector registers.
template <int W = kLanes>
SRT_SIMD_INLINE float reduce_max(const vec<W>& v) {
  if constexpr (W == 4) {
    const float m0 = v[0] > v[2] ? v[0] : v[2], m1 = v[1] > v[3] ? v[1] : v[3];
    return m0 > m1 ? m0 : m1;
  } else {
    const vec<W / 2> lo = low_half<W>(v), hi = high_half<W>(v);
    return reduce_max<W / 2>(lo > hi ? lo : hi);
  }
}

// 32 bf16 values as raw bits: the operand of dot_bf16, whose lane i holds elements 2i
// and 2i + 1.
typedef int16_t vbf16 __attribute__((vector_size(64)));
// 32 bf16 values (bf16 or their uint16_t bits) from p.
template <typename T>
SRT_SIMD_INLINE vbf16 load_bf16_pairs(const T* p) {
  static_assert(sizeof(T) == 2, "bf16 bits");
  vbf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
#if SRT_ISA_LEVELS
// The first n (< 32) values, zeros after them: one masked load (vmovdqu16), which never
// touches memory past p + n. (A copy through a zeroed stack buffer, as load_partial makes,
// stalls on store forwarding: at head_dim 16, every key is such a tail.) Only for
// SRT_TARGET_V4_BF16 functions: a builtin, for the reason dot_bf16 gives.
template <typename T>
SRT_SIMD_INLINE vbf16 load_bf16_pairs_partial(const T* p, int64_t n) {
  static_assert(sizeof(T) == 2, "bf16 bits");
  const auto mask = static_cast<__mmask32>((uint64_t{1} << n) - 1);
  return __builtin_ia32_loaddquhi512_mask(reinterpret_cast<const short*>(p), vbf16{}, mask);
}
// acc + a . b by pairs (vdpbf16ps): lane i adds a[2i] b[2i] + a[2i+1] b[2i+1], each
// product exact in float32, each add rounded to nearest even, denormal inputs and results
// flushed to zero. Only for SRT_TARGET_V4_BF16 functions. GCC's builtin, not
// _mm512_dpbf16_ps: that intrinsic is a function with a target of its own, which GCC
// refuses to inline into these always-inlined helpers (default target) even when they are
// themselves inlined into a SRT_TARGET_V4_BF16 function; the builtin's ISA is checked
// where it lands.
SRT_SIMD_INLINE vec<16> dot_bf16(const vec<16>& acc, const vbf16& a, const vbf16& b) {
  return __builtin_ia32_dpbf16ps_v16sf(acc, (__m512bh)a, (__m512bh)b);
}
#endif

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

// a < b per lane, as all-ones / zero lanes. W is the clone's register width, so this is
// one compare (into a mask register at the AVX-512 level): a 16-lane compare in an AVX2
// clone would scalarize, which is why every kernel computes at its level's width.
template <int W = kLanes>
SRT_SIMD_INLINE ivec<W> less(const vec<W>& a, const vec<W>& b) {
  return a < b;
}
// Lanes of `a` where `mask` (from less) is set, of `b` elsewhere: bitwise, so no lane
// is compared again (a 16-lane `?:` scalarizes on AVX2 like the compare).
template <int W = kLanes>
SRT_SIMD_INLINE vec<W> select(const ivec<W>& mask, const vec<W>& a, const vec<W>& b) {
  ivec<W> ai, bi;
  std::memcpy(&ai, &a, sizeof(ai));
  std::memcpy(&bi, &b, sizeof(bi));
  const ivec<W> bits = (ai & mask) | (bi & ~mask);
  vec<W> out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// 2^x for x <= 0: n = nearest integer, 2^(x - n) by its Taylor series (|x - n| <= 1/2,
// relative error ~1e-7), times 2^n built in the exponent bits. Below -126 the result is
// exactly 0, so masked (-inf) scores contribute nothing; NaN stays NaN.
template <int W = kLanes>
SRT_SIMD_INLINE vec<W> exp2_nonpositive(const vec<W>& x) {
  const ivec<W> underflow = less<W>(x, splat<W>(-126.0f));  // false for NaN, which stays NaN
  const vec<W> clamped = select<W>(underflow, splat<W>(-126.0f), x);
  const ivec<W> n = __builtin_convertvector(clamped - 0.5f, ivec<W>);  // truncation rounds toward 0
  const vec<W> r = clamped - __builtin_convertvector(n, vec<W>);
  vec<W> p = splat<W>(1.5403530393381606e-4f);  // ln2^6 / 6!
  p = p * r + 1.3333558146428443e-3f;
  p = p * r + 9.6181291076284772e-3f;
  p = p * r + 5.5504108664821580e-2f;
  p = p * r + 2.4022650695910071e-1f;
  p = p * r + 6.9314718055994531e-1f;
  p = p * r + 1.0f;
  const ivec<W> bits = (n + 127) << 23;
  vec<W> scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return select<W>(underflow, vec<W>{}, p * scale);
}

}  // namespace sarathi_rt::cpu

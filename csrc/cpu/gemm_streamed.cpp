// y = x @ w^T (+ bias) on the CPU for rows of x against a w too large to stay in cache
// (the LM head of a decode-heavy step). Such a product is bound by reading w from memory
// when x has few rows, and by FMAs when it has many; either way w is streamed from
// memory once per tile of x's rows (one tile for any decode batch), each thread owning a
// range of w's rows.
//
// Batch invariance: every output element is one register accumulator summed over k in
// the same order, then reduced by reduce_addN, whatever block or tile its row falls in, so
// a row's result does not depend on the other rows in the call.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cpu_simd.h"
#include "sarathi_rt/gemm.h"
#include "sarathi_rt/paged_kv.h"

namespace sarathi_rt {
namespace {

// x's rows per tile: as many as fit in 256 KiB, half the smallest L2 of the x86 cores we
// run on, so a tile stays in L2 while each thread's block of w (in L1) sweeps it.
constexpr int64_t kTileBytes = 256 << 10;

// Register blocks: BM rows of x against BN rows of w, BM x BN accumulators, so each
// loaded vector feeds several FMAs. The accumulators, the BN w vectors and one x vector
// must fit the register file or the loop spills (which made AVX2 2.9x slower than torch's
// GEMM at 64 rows). AVX-512 (32 registers of 16 floats): 16-float vectors, 4 x 4, 21
// live. Everything else (AVX2: 16 registers of 8 floats): 8-float vectors, 4 x 3, 16 live.
//
// Dot (bf16 at the avx512_bf16 level): vdpbf16ps on pairs of k, 32 bf16 of x and w a step
// (the tail by a masked load, zeros past k), each lane adding two exact products, instead
// of converting both operands to float32 for FMAs. That conversion made the kernel
// compute-bound from a few rows on: the bf16 LM head at 5 rows cost 2.6x its 1-row time.
template <typename T, int W, int64_t BM, int64_t BN, bool Dot = false>
SRT_SIMD_INLINE void gemm_block(const GemmParams& p, int64_t m0, int64_t n0) {
  // Fixed trip counts keep the accumulators in registers. gemm_range sizes each block to
  // x's rows left; w's last block may pass its last row, which it reads again and discards.
  const T* x[BM];
  const T* w[BN];
  for (int64_t i = 0; i < BM; ++i) x[i] = static_cast<const T*>(p.x) + (m0 + i) * p.ldx;
  for (int64_t j = 0; j < BN; ++j) w[j] = static_cast<const T*>(p.w) + std::min(n0 + j, p.n - 1) * p.ldw;
  // Zeroed one by one: `= {}` became a `rep stos` of the array (9% of a 64-row float32
  // product at k = 64 on the AVX2 level).
  cpu::vec<W> acc[BM][BN];
  for (int64_t i = 0; i < BM; ++i) {
    for (int64_t j = 0; j < BN; ++j) acc[i][j] = cpu::vec<W>{};
  }
  if constexpr (Dot) {
#if SRT_ISA_LEVELS
    constexpr int64_t kPairs = 2 * W;  // bf16 elements per vdpbf16ps operand
    const int64_t full = p.k / kPairs * kPairs;
    for (int64_t k = 0; k < full; k += kPairs) {
      cpu::vbf16 wv[BN];
      for (int64_t j = 0; j < BN; ++j) wv[j] = cpu::load_bf16_pairs(w[j] + k);
      for (int64_t i = 0; i < BM; ++i) {
        const cpu::vbf16 xv = cpu::load_bf16_pairs(x[i] + k);
        for (int64_t j = 0; j < BN; ++j) acc[i][j] = cpu::dot_bf16(acc[i][j], xv, wv[j]);
      }
    }
    if (full < p.k) {
      cpu::vbf16 wv[BN];
      for (int64_t j = 0; j < BN; ++j) wv[j] = cpu::load_bf16_pairs_partial(w[j] + full, p.k - full);
      for (int64_t i = 0; i < BM; ++i) {
        const cpu::vbf16 xv = cpu::load_bf16_pairs_partial(x[i] + full, p.k - full);
        for (int64_t j = 0; j < BN; ++j) acc[i][j] = cpu::dot_bf16(acc[i][j], xv, wv[j]);
      }
    }
#endif
  } else {
    const int64_t full = p.k / W * W;
    for (int64_t k = 0; k < full; k += W) {
      cpu::vec<W> wv[BN];
      for (int64_t j = 0; j < BN; ++j) wv[j] = cpu::load<W>(w[j] + k);
      for (int64_t i = 0; i < BM; ++i) {
        const cpu::vec<W> xv = cpu::load<W>(x[i] + k);
        for (int64_t j = 0; j < BN; ++j) acc[i][j] += xv * wv[j];
      }
    }
    if (full < p.k) {  // the same sum, its last lanes zero-padded
      cpu::vec<W> wv[BN];
      for (int64_t j = 0; j < BN; ++j) wv[j] = cpu::load_partial<W>(w[j] + full, p.k - full);
      for (int64_t i = 0; i < BM; ++i) {
        const cpu::vec<W> xv = cpu::load_partial<W>(x[i] + full, p.k - full);
        for (int64_t j = 0; j < BN; ++j) acc[i][j] += xv * wv[j];
      }
    }
  }
  // The accumulators' lanes summed W at a time by reduce_addN (W sums in W - 1 vector
  // adds), not by a tree each: at 64 rows and k = 576 the trees were ~40% of the bf16
  // kernel's instructions. A sum reads only its own accumulator's lanes, in reduce_addN's
  // one order, so neither the grouping nor the zero padding changes its bits.
  constexpr int64_t kAcc = BM * BN, kGroups = (kAcc + W - 1) / W;
  cpu::vec<W> flat[kGroups * W];
  for (int64_t a = 0; a < kGroups * W; ++a) flat[a] = a < kAcc ? acc[a / BN][a % BN] : cpu::vec<W>{};
  const auto* bias = static_cast<const T*>(p.bias);
  auto* y = static_cast<T*>(p.y) + m0 * p.ldy + n0;
  const int64_t rows_n = std::min(BN, p.n - n0);
  // Whole blocks: the sums W at a time (lane l of group g: row (g W + l) / BN, w row
  // (g W + l) % BN), the bias added, rounded to T and stored a row at a time in vector
  // code. Per element it was the scalar round of from_float and a store, ~a third of a
  // 4 x 4 bf16 block's instructions at k = 576, and 14% of a 4 x 3 float32 one at k = 64.
  // The same adds and roundings, so the same bits.
  if (rows_n == BN) {
    T rounded[kGroups * W];
    for (int64_t g = 0; g < kGroups; ++g) {
      cpu::vec<W> sums = cpu::reduce_addN<W>(flat + g * W);
      if (bias != nullptr) {
        float b[W] = {};
        for (int64_t l = 0; l < W && g * W + l < kAcc; ++l) b[l] = cpu::to_float(bias[n0 + (g * W + l) % BN]);
        sums += cpu::load<W>(b);
      }
      cpu::store_as<T, W>(rounded + g * W, sums);
    }
    for (int64_t i = 0; i < BM; ++i) std::memcpy(y + i * p.ldy, rounded + i * BN, BN * sizeof(T));
    return;
  }
  float sums[kGroups * W];
  for (int64_t g = 0; g < kGroups; ++g) cpu::store(sums + g * W, cpu::reduce_addN<W>(flat + g * W));
  for (int64_t i = 0; i < BM; ++i) {
    for (int64_t j = 0; j < rows_n; ++j) {
      const float b = bias != nullptr ? cpu::to_float(bias[n0 + j]) : 0.0f;
      y[i * p.ldy + j] = cpu::from_float<T>(sums[i * BN + j] + b);
    }
  }
}

// w's row blocks [blk0, blk1) against x's rows [t0, t1), compiled per ISA level (each
// at its register width: 4x4 blocks of 16 floats on AVX-512, 4x3 of 8 below, which fit
// the 16 AVX2 registers). The level is picked outside the OpenMP loop and the compiled
// range called inside it: GCC outlines a parallel loop's body into a function of its own
// that no target attribute reaches, which would run it at the baseline ISA.
//
// Rows past the last whole block of BM run in a block of their own count: a decode's one
// row is computed once, not BM times (which made a 1-row call cost a 4-row one, and 5
// rows 8). A row's bits do not depend on its block (see the top of the file).
template <typename T, int W, int64_t BM, int64_t BN, bool Dot = false>
SRT_SIMD_INLINE void gemm_range(const GemmParams& p, int64_t blk0, int64_t blk1, int64_t t0, int64_t t1) {
  static_assert(BM == 4, "the tail below covers 1 to 3 rows");
  for (int64_t blk = blk0; blk < blk1; ++blk) {
    int64_t m0 = t0;
    for (; m0 + BM <= t1; m0 += BM) gemm_block<T, W, BM, BN, Dot>(p, m0, blk * BN);
    switch (t1 - m0) {
      case 3: gemm_block<T, W, 3, BN, Dot>(p, m0, blk * BN); break;
      case 2: gemm_block<T, W, 2, BN, Dot>(p, m0, blk * BN); break;
      case 1: gemm_block<T, W, 1, BN, Dot>(p, m0, blk * BN); break;
      default: break;
    }
  }
}
using RangeFn = void (*)(const GemmParams&, int64_t, int64_t, int64_t, int64_t);
template <typename T>
SRT_TARGET_V4 void gemm_range_v4(const GemmParams& p, int64_t blk0, int64_t blk1, int64_t t0, int64_t t1) {
  gemm_range<T, 16, 4, 4>(p, blk0, blk1, t0, t1);
}
#if SRT_ISA_LEVELS
SRT_TARGET_V4_BF16 void gemm_range_v4_bf16(const GemmParams& p, int64_t blk0, int64_t blk1, int64_t t0, int64_t t1) {
  gemm_range<cpu::bf16, 16, 4, 4, true>(p, blk0, blk1, t0, t1);
}
#endif
template <typename T>
SRT_TARGET_V3 void gemm_range_v3(const GemmParams& p, int64_t blk0, int64_t blk1, int64_t t0, int64_t t1) {
  gemm_range<T, 8, 4, 3>(p, blk0, blk1, t0, t1);
}
template <typename T>
void gemm_range_base(const GemmParams& p, int64_t blk0, int64_t blk1, int64_t t0, int64_t t1) {
  gemm_range<T, 8, 4, 3>(p, blk0, blk1, t0, t1);
}

// Every tile of x's rows against all of w, w's row blocks split into one contiguous range
// per thread, `range` being the level's compiled range of BN-row blocks. Equal shares, not
// fixed-size tasks: 64-block tasks left one of two threads 512 of SmolLM2's 576 o/down
// rows (3 tasks), which made those projections ~2x slower than the qkv and gate_up ones.
template <typename T, int64_t BN>
void gemm_tiles(const GemmParams& p, RangeFn range) {
  constexpr int64_t BM = 4;
  const int64_t row_bytes = std::max<int64_t>(1, p.k * int64_t{sizeof(T)});
  const int64_t tile = std::max(BM, kTileBytes / row_bytes / BM * BM);
  const int64_t blocks = ceil_div(p.n, BN);
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(blocks, cpu::max_threads()));
  for (int64_t t0 = 0; t0 < p.m; t0 += tile) {
    const int64_t t1 = std::min(p.m, t0 + tile);
#pragma omp parallel for schedule(static)
    for (int64_t share = 0; share < shares; ++share) {
      range(p, blocks * share / shares, blocks * (share + 1) / shares, t0, t1);
    }
  }
}

template <typename T>
void gemm_streamed(const GemmParams& p) {
  switch (cpu::isa_level()) {
    case cpu::IsaLevel::kV4Bf16:
#if SRT_ISA_LEVELS
      if constexpr (std::is_same_v<T, cpu::bf16>) return gemm_tiles<T, 4>(p, gemm_range_v4_bf16);
#endif
      [[fallthrough]];
    case cpu::IsaLevel::kV4: return gemm_tiles<T, 4>(p, gemm_range_v4<T>);
    case cpu::IsaLevel::kV3: return gemm_tiles<T, 3>(p, gemm_range_v3<T>);
    case cpu::IsaLevel::kBase: break;
  }
  gemm_tiles<T, 3>(p, gemm_range_base<T>);
}

}  // namespace

Status gemm_streamed_cpu(const GemmParams& p) {
  if (p.m < 0 || p.n < 0 || p.k < 0) {
    return Status::Invalid("gemm: negative shape m = " + std::to_string(p.m) + ", n = " + std::to_string(p.n) +
                           ", k = " + std::to_string(p.k));
  }
  switch (p.dtype) {
    case DType::kFloat32: gemm_streamed<float>(p); break;
    case DType::kFloat16: gemm_streamed<cpu::f16>(p); break;
    case DType::kBFloat16: gemm_streamed<cpu::bf16>(p); break;
  }
  return Status::Ok();
}

}  // namespace sarathi_rt

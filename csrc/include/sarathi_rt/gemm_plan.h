// Tile and wave planning of the linear-layer GEMM  y[M, N] = x[M, K] @ w[N, K]^T.
//
// The GEMM runs as a grid of CTAs, each computing one tile_m x tile_n output tile, in
// waves of (SMs x CTAs per SM). Its cost moves in stairs: M = 257 pays a whole extra
// row of tiles over M = 256 (tile quantization), and a grid a little larger than one
// wave pays a whole extra wave (wave quantization). The planner picks, from a small
// explicit set of CUTLASS tile configurations, the one with the least estimated time,
// and reports the tile shape it uses so the scheduler can size chunks to the stairs.
// Pure host logic: the CPU tests cover it, the CUDA launcher follows it.
#pragma once

#include <vector>

#include "sarathi_rt/common.h"

namespace sarathi_rt {

struct GemmTileConfig {
  int32_t id = 0;        // index into gemm_tile_configs(); the CUDA launcher switches on it
  const char* name = "";
  int32_t tile_m = 0;    // CTA tile over the kernel's rows (N when swap_ab)
  int32_t tile_n = 0;    // CTA tile over the kernel's columns (M, the tokens, when swap_ab)
  int32_t tile_k = 0;
  int32_t stages = 0;    // cp.async pipeline depth
  int32_t warps = 0;
  // Computes y^T = w x^T, so few tokens map to the small tile_n instead of wasting
  // most of a 128-row tile: the decode-heavy (M <= kSmallM) configurations.
  bool swap_ab = false;
  // Share of tensor-core peak a full wave of this tile sustains (bigger tiles reuse each
  // loaded operand more); a planning constant, calibrated by bench/bench_gemm_gpu.py.
  double mma_efficiency = 1.0;

  // Dynamic shared memory of one CTA: the cp.async stages of both 16-bit operand tiles
  // (the epilogue reuses it). The CUDA build static_asserts that this is the kernel's size.
  constexpr int64_t smem_bytes() const { return int64_t{stages} * (tile_m + tile_n) * tile_k * 2; }
};

// The configurations the planner chooses from; the CUTLASS kernels (csrc/cuda/
// gemm_kernels.cuh) are instantiated from these rows, so the two cannot drift apart.
// id, name, tile_m, tile_n, tile_k, stages, warps, swap_ab, mma_efficiency
inline constexpr GemmTileConfig kGemmTileConfigs[] = {
    {0, "128x256x64_s3", 128, 256, 64, 3, 8, false, 0.95},
    {1, "128x128x64_s4", 128, 128, 64, 4, 4, false, 0.90},
    {2, "64x128x64_s4", 64, 128, 64, 4, 4, false, 0.80},
    {3, "swap_128x32x64_s4", 128, 32, 64, 4, 4, true, 0.60},
    {4, "swap_64x16x64_s4", 64, 16, 64, 4, 4, true, 0.45},
};

// Registers per thread of one compiled GEMM kernel (every dtype and output variant of a
// CTA tile: the largest), as ptxas reports them for one SM version.
struct GemmKernelRegisters {
  int32_t sm = 0;
  int32_t tile_m = 0, tile_n = 0, tile_k = 0;
  int32_t registers = 0;
};

// Largest M served by the swap_ab configurations; larger M uses the regular ones.
constexpr int64_t kSmallM = 64;
// Serial split-K is considered up to this many K slices, each at least 4 k-tiles deep.
constexpr int32_t kMaxSplitK = 8;

// Split-K adds its K slices up in a float32 [m, n] buffer (then rounds once to the
// output dtype); the workspace holds that buffer and one int32 semaphore per output tile.
inline int64_t gemm_split_k_workspace_bytes(int64_t m, int64_t n, int64_t output_tiles) {
  return 4 * m * n + 4 * output_tiles;
}

// What bounds the CTAs resident on one SM (the CUDA occupancy rules of the SM version).
struct GpuTarget {
  int32_t arch = 80;               // SM version: 80 (A100) or 90 (H100/H200)
  int32_t num_sms = 108;
  int64_t smem_per_sm = 0;         // bytes of shared memory per SM (at the largest carve-out)
  int64_t smem_per_cta = 0;        // the most one CTA may use
  int64_t smem_reserved_per_cta = 1024;  // taken by the system from the SM's pool per CTA
  int64_t registers_per_sm = 65536;
  int32_t max_threads_per_sm = 2048;
  int32_t max_ctas_per_sm = 32;

  static GpuTarget for_arch(int32_t arch, int32_t num_sms);
};

// Per-thread registers of `config`'s kernel on SM version `arch`: in a CUDA build, what ptxas
// reported for the newest compiled SM version <= the target's (captured at build time);
// otherwise, or for a target below every compiled one, the counts ptxas gave a CUDA 13.0 /
// CUTLASS 4.2 build (kDefaultGemmRegisters in gemm_plan.cpp).
int32_t gemm_kernel_registers(const GemmTileConfig& config, int32_t arch);

// How many CTAs of `config` fit on one SM: the least of the register, shared memory,
// thread and CTA-slot limits.
int32_t gemm_ctas_per_sm(const GemmTileConfig& config, const GpuTarget& target);

struct GemmPlan {
  GemmTileConfig config;
  int64_t m = 0, n = 0, k = 0;
  int32_t split_k = 1;
  int64_t tile_m = 0, tile_n = 0;  // in the problem's M (tokens) and N, after undoing swap_ab
  int64_t tiles_m = 0, tiles_n = 0;
  int64_t ctas = 0;                // tiles_m * tiles_n * split_k
  int64_t workspace_bytes = 0;     // what the CUDA GEMM needs: 0 unless split_k > 1
  int32_t registers = 0;           // per thread, of the chosen kernel (gemm_kernel_registers)
  int32_t ctas_per_sm = 1;
  int64_t waves = 0;
  double tile_efficiency = 0.0;    // useful share of the padded output tiles
  double wave_efficiency = 0.0;    // busy share of all wave slots (1 - idle share of the last wave)
  double efficiency = 0.0;         // estimated share of the GPU's tensor-core peak
  double estimated_time = 0.0;     // in units of (one SM's peak MAC time)
};

const std::vector<GemmTileConfig>& gemm_tile_configs();

// Scores one configuration with a fixed split_k; no validation beyond fitting on an SM.
GemmPlan score_gemm_config(int64_t m, int64_t n, int64_t k, const GemmTileConfig& config, int32_t split_k,
                           const GpuTarget& target);

// The best configuration and split for (m, n, k) on `target`. The CUTLASS kernels take
// bfloat16/float16; float32 is planned like them (its CUDA linear runs through torch,
// whose TF32 kernels use the same tile shapes at half the k-depth).
// only_config >= 0 restricts the choice to that configuration (any M), only_split_k > 0
// to that split, for sweeps and tests.
Status plan_gemm(int64_t m, int64_t n, int64_t k, DType dtype, const GpuTarget& target, GemmPlan* plan,
                 int32_t only_config = -1, int32_t only_split_k = 0);

}  // namespace sarathi_rt

// GEMM tile/wave planner (see gemm_plan.h). The configuration table must stay in step
// with the CUTLASS instantiations in csrc/cuda/gemm_kernels.cuh (same ids, same shapes).
#include "sarathi_rt/gemm_plan.h"

#include <algorithm>
#include <string>

namespace sarathi_rt {
namespace {

constexpr int64_t kRegistersPerSm = 65536;
constexpr int64_t kMaxRegistersPerThread = 255;  // what the 64x64 warp tiles use, about

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

const std::vector<GemmTileConfig>& gemm_tile_configs() {
  // id, name, tile_m, tile_n, tile_k, stages, warps, swap_ab, mma_efficiency
  static const std::vector<GemmTileConfig> configs = {
      {0, "128x256x64_s3", 128, 256, 64, 3, 8, false, 0.95},
      {1, "128x128x64_s4", 128, 128, 64, 4, 4, false, 0.90},
      {2, "64x128x64_s4", 64, 128, 64, 4, 4, false, 0.80},
      {3, "swap_128x32x64_s4", 128, 32, 64, 4, 4, true, 0.60},
      {4, "swap_64x16x64_s4", 64, 16, 64, 4, 4, true, 0.45},
  };
  return configs;
}

GpuTarget GpuTarget::for_arch(int32_t arch, int32_t num_sms) {
  GpuTarget t;
  t.arch = arch;
  t.num_sms = num_sms;
  // Shared memory a CTA may use per SM: 164 KiB on sm80, 228 KiB on sm90 (1 KiB each
  // reserved by the system per CTA is within the planning slack).
  // sm86/sm89 (consumer parts) have 100 KiB.
  t.smem_per_sm = arch >= 90 ? 227 * 1024 : arch == 80 || arch == 87 ? 163 * 1024 : 99 * 1024;
  return t;
}

GemmPlan score_gemm_config(int64_t m, int64_t n, int64_t k, const GemmTileConfig& c, int32_t split_k,
                           const GpuTarget& target) {
  GemmPlan p;
  p.config = c;
  p.m = m;
  p.n = n;
  p.k = k;
  p.split_k = split_k;
  p.tile_m = c.swap_ab ? c.tile_n : c.tile_m;
  p.tile_n = c.swap_ab ? c.tile_m : c.tile_n;
  p.tiles_m = ceil_div(m, p.tile_m);
  p.tiles_n = ceil_div(n, p.tile_n);
  p.ctas = p.tiles_m * p.tiles_n * split_k;
  const int64_t by_smem = target.smem_per_sm / c.smem_bytes();
  const int64_t by_regs = kRegistersPerSm / (int64_t{c.warps} * 32 * kMaxRegistersPerThread);
  p.ctas_per_sm = static_cast<int32_t>(std::max<int64_t>(1, std::min(by_smem, by_regs)));
  const int64_t slots = int64_t{target.num_sms} * p.ctas_per_sm;
  p.waves = ceil_div(p.ctas, slots);
  p.tile_efficiency = static_cast<double>(m) * n / (static_cast<double>(p.tiles_m * p.tile_m) * (p.tiles_n * p.tile_n));
  p.wave_efficiency = static_cast<double>(p.ctas) / static_cast<double>(p.waves * slots);
  // One wave costs (CTAs sharing an SM) x (MACs of one CTA) / (SM peak x efficiency). A
  // K slice beyond the first also reloads and rewrites its output tile, costed as two
  // extra k-tiles.
  const int64_t k_slice = ceil_div(ceil_div(k, split_k), c.tile_k) * c.tile_k + (split_k > 1 ? 2 * c.tile_k : 0);
  p.estimated_time = static_cast<double>(p.waves) * p.ctas_per_sm * c.tile_m * c.tile_n * static_cast<double>(k_slice) /
                     c.mma_efficiency;
  p.efficiency = static_cast<double>(m) * n * k / (static_cast<double>(target.num_sms) * p.estimated_time);
  return p;
}

Status plan_gemm(int64_t m, int64_t n, int64_t k, DType dtype, const GpuTarget& target, GemmPlan* plan,
                 int32_t only_config, int32_t only_split_k) {
  if (m <= 0) return Status::Invalid("M must be positive, got " + std::to_string(m));
  if (n <= 0) return Status::Invalid("N must be positive, got " + std::to_string(n));
  if (k <= 0) return Status::Invalid("K must be positive, got " + std::to_string(k));
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    return Status::Invalid("dtype code " + std::to_string(static_cast<int>(dtype)) + " is not a float type");
  }
  if (target.arch < 80) {
    return Status::Unsupported("arch " + std::to_string(target.arch) + " is not supported (sm80 or newer)");
  }
  if (target.num_sms <= 0) return Status::Invalid("num_sms must be positive, got " + std::to_string(target.num_sms));
  const int64_t num_configs = static_cast<int64_t>(gemm_tile_configs().size());
  if (only_config >= num_configs) {
    return Status::Invalid("config id " + std::to_string(only_config) + " is outside [0, " +
                           std::to_string(num_configs) + ")");
  }
  if (only_split_k < 0 || only_split_k > kMaxSplitK) {
    return Status::Invalid("split_k must be in [1, " + std::to_string(kMaxSplitK) + "], got " +
                           std::to_string(only_split_k));
  }
  const bool small_m = m <= kSmallM;
  bool found = false;
  for (const GemmTileConfig& c : gemm_tile_configs()) {
    const bool wanted = only_config >= 0 ? c.id == only_config : c.swap_ab == small_m;
    if (!wanted || c.smem_bytes() > target.smem_per_sm) continue;
    const int32_t first = only_split_k > 0 ? only_split_k : 1;
    const int32_t last = only_split_k > 0 ? only_split_k : kMaxSplitK;
    for (int32_t split = first; split <= last; ++split) {
      if (only_split_k == 0 && split > 1 && ceil_div(k, split) < 4 * int64_t{c.tile_k}) break;
      const GemmPlan candidate = score_gemm_config(m, n, k, c, split, target);
      // Ties keep the earlier (larger-tile, unsplit) choice: fewer partial sums, fewer CTAs.
      if (!found || candidate.estimated_time < plan->estimated_time * (1.0 - 1e-9)) {
        *plan = candidate;
        found = true;
      }
    }
  }
  if (!found) return Status::Unsupported("no GEMM tile configuration fits this GPU's shared memory");
  return Status::Ok();
}

}  // namespace sarathi_rt

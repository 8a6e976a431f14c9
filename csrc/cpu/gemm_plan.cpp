// GEMM tile/wave planner (see gemm_plan.h). The configuration table is kGemmTileConfigs
// (gemm_plan.h), from which the CUDA build instantiates its CUTLASS kernels.
#include "sarathi_rt/gemm_plan.h"

#include <algorithm>
#include <iterator>
#include <string>

#if defined(SARATHI_RT_GEMM_REGISTERS_FROM_BUILD)
#include "sarathi_rt/gemm_kernel_registers.h"  // kCompiledGemmRegisters: generated from ptxas -v
#endif

namespace sarathi_rt {
namespace {

// Registers ptxas -v reported for these kernels (bfloat16/float16, both output variants;
// CUDA 13.0, CUTLASS 4.2). A CPU-only build plans with them; a CUDA build with its own.
constexpr GemmKernelRegisters kDefaultGemmRegisters[] = {
    {80, 64, 16, 64, 54},    {80, 64, 128, 64, 156},  {80, 128, 32, 64, 96},
    {80, 128, 128, 64, 242}, {80, 128, 256, 64, 244}, {90, 64, 16, 64, 54},
    {90, 64, 128, 64, 160},  {90, 128, 32, 64, 96},   {90, 128, 128, 64, 242},
    {90, 128, 256, 64, 244},
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <size_t N>
const GemmKernelRegisters* find_registers(const GemmKernelRegisters (&rows)[N], const GemmTileConfig& c,
                                          int32_t arch) {
  const GemmKernelRegisters* best = nullptr;
  for (const GemmKernelRegisters& r : rows) {
    const bool same_kernel = r.tile_m == c.tile_m && r.tile_n == c.tile_n && r.tile_k == c.tile_k;
    if (same_kernel && r.sm <= arch && (best == nullptr || r.sm > best->sm)) best = &r;
  }
  return best;
}

}  // namespace

const std::vector<GemmTileConfig>& gemm_tile_configs() {
  static const std::vector<GemmTileConfig> configs(std::begin(kGemmTileConfigs), std::end(kGemmTileConfigs));
  return configs;
}

GpuTarget GpuTarget::for_arch(int32_t arch, int32_t num_sms) {
  GpuTarget t;
  t.arch = arch;
  t.num_sms = num_sms;
  // Per SM / per CTA (KiB): sm80 and sm87 164/163, sm90 and newer 228/227, the consumer
  // parts (sm86, sm89) 100/99, with 1536 threads and 16 (sm86) or 24 (sm89) CTAs per SM.
  const bool big = arch >= 90 || arch == 80 || arch == 87;
  t.smem_per_sm = (arch >= 90 ? 228 : big ? 164 : 100) * 1024;
  t.smem_per_cta = t.smem_per_sm - 1024;
  t.max_threads_per_sm = big ? 2048 : 1536;
  t.max_ctas_per_sm = big ? 32 : arch == 86 ? 16 : 24;
  return t;
}

int32_t gemm_kernel_registers(const GemmTileConfig& config, int32_t arch) {
  const GemmKernelRegisters* row = nullptr;
#if defined(SARATHI_RT_GEMM_REGISTERS_FROM_BUILD)
  row = find_registers(kCompiledGemmRegisters, config, arch);
#endif
  if (row == nullptr) row = find_registers(kDefaultGemmRegisters, config, arch);
  return row != nullptr ? row->registers : 255;  // unknown kernel: the most a thread may use
}

int32_t gemm_ctas_per_sm(const GemmTileConfig& c, const GpuTarget& target) {
  const int64_t threads = int64_t{c.warps} * 32;
  // Registers are allocated per warp in units of 256 (8 per thread).
  const int64_t registers_per_warp = ceil_div(int64_t{gemm_kernel_registers(c, target.arch)} * 32, 256) * 256;
  const int64_t by_registers = target.registers_per_sm / (registers_per_warp * c.warps);
  const int64_t by_smem = target.smem_per_sm / (c.smem_bytes() + target.smem_reserved_per_cta);
  const int64_t by_threads = target.max_threads_per_sm / threads;
  const int64_t fit = std::min({by_registers, by_smem, by_threads, int64_t{target.max_ctas_per_sm}});
  return static_cast<int32_t>(std::max<int64_t>(1, fit));
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
  p.workspace_bytes = split_k > 1 ? gemm_split_k_workspace_bytes(m, n, p.tiles_m * p.tiles_n) : 0;
  p.registers = gemm_kernel_registers(c, target.arch);
  p.ctas_per_sm = gemm_ctas_per_sm(c, target);
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
    if (!wanted || c.smem_bytes() > target.smem_per_cta) continue;
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

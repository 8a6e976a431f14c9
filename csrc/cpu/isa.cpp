// The ISA level the CPU kernels run (cpu_simd.h): the CPU's, capped from Python.
#include <algorithm>
#include <atomic>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_simd.h"

namespace sarathi_rt::cpu {
namespace {

std::atomic<int> g_cap{static_cast<int>(IsaLevel::kV4Bf16)};

}  // namespace

IsaLevel native_isa_level() {
#if SRT_ISA_LEVELS
  static const IsaLevel level =
      __builtin_cpu_supports("x86-64-v4") ? (__builtin_cpu_supports("avx512bf16") ? IsaLevel::kV4Bf16 : IsaLevel::kV4)
      : __builtin_cpu_supports("x86-64-v3") ? IsaLevel::kV3
                                            : IsaLevel::kBase;
  return level;
#else
  return IsaLevel::kBase;
#endif
}

IsaLevel isa_level() {
  return static_cast<IsaLevel>(std::min(static_cast<int>(native_isa_level()), g_cap.load(std::memory_order_relaxed)));
}

void set_isa_cap(IsaLevel cap) { g_cap.store(static_cast<int>(cap), std::memory_order_relaxed); }

int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void release_threads() {
#if defined(_OPENMP)
  omp_pause_resource_all(omp_pause_soft);  // libgomp: the calling thread's team
#endif
}

}  // namespace sarathi_rt::cpu

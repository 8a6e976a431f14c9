// build_info(): the build's facts, from the compile definitions CMake sets on _C, so
// that Python can check what it runs (scripts/test.sh asserts CUDA was compiled when
// nvcc was there).
#include "build_info.h"

#include <pybind11/stl.h>

#include <string>
#include <vector>

#if defined(SARATHI_RT_WITH_OPENMP)
#include <omp.h>
#endif

namespace py = pybind11;

namespace sarathi_rt {
namespace {

#if defined(SARATHI_RT_WITH_CUDA)
std::vector<std::string> split_list(const std::string& all) {
  std::vector<std::string> items;
  for (size_t start = 0, end; start <= all.size(); start = end + 1) {
    end = all.find(',', start);
    if (end == std::string::npos) end = all.size();
    if (end > start) items.push_back(all.substr(start, end - start));
  }
  return items;
}
#endif

py::dict build_info() {
  py::dict info;
  info["version"] = SARATHI_RT_VERSION;
#if defined(SARATHI_RT_WITH_CUDA)
  info["cuda_compiled"] = true;
  info["cuda_archs"] = split_list(SARATHI_RT_CUDA_ARCHS);
  info["cuda_sass"] = split_list(SARATHI_RT_CUDA_SASS);
  info["cuda_ptx"] = split_list(SARATHI_RT_CUDA_PTX);
#else
  info["cuda_compiled"] = false;
  info["cuda_archs"] = std::vector<std::string>{};
  info["cuda_sass"] = std::vector<std::string>{};
  info["cuda_ptx"] = std::vector<std::string>{};
#endif
#if defined(SARATHI_RT_GEMM_REGISTERS_FROM_BUILD)
  info["gemm_registers"] = "ptxas";  // the planner's register counts come from this build's kernels
#else
  info["gemm_registers"] = "defaults";
#endif
#if defined(SARATHI_RT_WITH_OPENMP)
  info["openmp"] = true;
  info["omp_max_threads"] = omp_get_max_threads();
#else
  info["openmp"] = false;
  info["omp_max_threads"] = 1;
#endif
#if defined(SARATHI_RT_CUTLASS_VERSION)
  info["cutlass_version"] = SARATHI_RT_CUTLASS_VERSION;
#else
  info["cutlass_version"] = py::none();
#endif
  return info;
}

}  // namespace

void bind_build_info(py::module_& m) { m.def("build_info", &build_info, "How this module was built."); }

}  // namespace sarathi_rt

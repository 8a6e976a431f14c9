// build_info(): how the _C module was built (version, CUDA targets, OpenMP, CUTLASS).
#pragma once

#include <pybind11/pybind11.h>

namespace sarathi_rt {

void bind_build_info(pybind11::module_& m);

}  // namespace sarathi_rt

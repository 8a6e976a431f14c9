// cpu_isa() / set_cpu_isa(): the ISA level the CPU kernels run, and its cap.
#pragma once

#include <pybind11/pybind11.h>

namespace sarathi_rt {

// Binds both, then caps the level at what SARATHI_RT_CPU_ISA asks for (read and checked
// by sarathi_rt.utils.cpu, the one parser of the variable; a bad value fails the import).
void bind_isa(pybind11::module_& m);

}  // namespace sarathi_rt

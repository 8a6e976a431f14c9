// step_indices(): the step's index arrays from its SequenceChunks, in one call.
#pragma once

#include <pybind11/pybind11.h>

namespace sarathi_rt {

void bind_step_indices(pybind11::module_& m);

}  // namespace sarathi_rt

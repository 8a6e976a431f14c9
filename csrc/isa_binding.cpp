#include "isa_binding.h"

#include <stdexcept>
#include <string>

#include "cpu/cpu_simd.h"

namespace py = pybind11;

namespace sarathi_rt {
namespace {

using cpu::IsaLevel;

const char* isa_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::kV4Bf16: return "avx512_bf16";
    case IsaLevel::kV4: return "avx512";
    case IsaLevel::kV3: return "avx2";
    case IsaLevel::kBase: break;
  }
  return "base";
}

void set_cpu_isa(const std::string& name) {
  for (IsaLevel level : {IsaLevel::kBase, IsaLevel::kV3, IsaLevel::kV4, IsaLevel::kV4Bf16}) {
    if (name == isa_name(level)) {
      if (static_cast<int>(level) > static_cast<int>(cpu::native_isa_level())) {
        throw py::value_error("set_cpu_isa: this CPU runs at most " + std::string(isa_name(cpu::native_isa_level())) +
                              ", got '" + name + "'");
      }
      cpu::set_isa_cap(level);
      return;
    }
  }
  throw py::value_error("set_cpu_isa: level must be base, avx2, avx512 or avx512_bf16, got '" + name + "'");
}

}  // namespace

void bind_isa(py::module_& m) {
  m.def("cpu_isa", [] { return isa_name(cpu::isa_level()); }, "The ISA level the CPU kernels run: base, avx2, avx512 or avx512_bf16.");
  m.def("cpu_isa_native", [] { return isa_name(cpu::native_isa_level()); }, "The highest level this CPU runs.");
  m.def("release_cpu_threads", &cpu::release_threads,
        "End the OpenMP worker threads this thread started (the next parallel region it runs starts new ones).");
  m.def("set_cpu_isa", &set_cpu_isa, py::arg("level"),
        "Run the CPU kernels at `level` (base, avx2, avx512 or avx512_bf16), at most the CPU's own.");
  const py::object level = py::module_::import("sarathi_rt.utils.cpu").attr("kernel_isa")();
  if (!level.is_none()) set_cpu_isa(level.cast<std::string>());
}

}  // namespace sarathi_rt

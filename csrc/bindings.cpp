// The one pybind11 file: turns Python ints (data pointers), shapes and strides into the
// params structs, releases the GIL around kernels, and maps Status to exceptions.
// Tensor-level validation (dtype, shape, device, layout) lives in sarathi_rt.ops.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>
#include <vector>

#include "sarathi_rt/block_allocator.h"
#include "sarathi_rt/kv_ops.h"

#if defined(SARATHI_RT_WITH_OPENMP)
#include <omp.h>
#endif

namespace py = pybind11;
using namespace sarathi_rt;

namespace {

constexpr int kCpu = -1;  // device argument: -1 = CPU, otherwise the CUDA device index

void raise_if_error(const Status& st) {
  switch (st.code) {
    case StatusCode::kOk: return;
    case StatusCode::kInvalidArgument:
    case StatusCode::kUnsupported: throw py::value_error(st.message);
    case StatusCode::kDeviceError: throw std::runtime_error(st.message);
  }
}

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

PagedKVLayout make_layout(const std::array<int64_t, 4>& cache_shape) {
  return {cache_shape[0], cache_shape[1], cache_shape[2], cache_shape[3]};
}

#if !defined(SARATHI_RT_WITH_CUDA)
[[noreturn]] void no_cuda() {
  throw py::value_error("sarathi_rt was built without CUDA; rebuild with SARATHI_RT_CUDA=1 to use CUDA tensors");
}
#endif

void write_kv(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slot_mapping,
              int64_t num_tokens, std::array<int64_t, 2> key_strides, std::array<int64_t, 2> value_strides,
              std::array<int64_t, 4> cache_shape, int dtype, int device, uintptr_t stream) {
  WriteKVParams p;
  p.key = ptr<const void>(key);
  p.value = ptr<const void>(value);
  p.k_cache = ptr<void>(k_cache);
  p.v_cache = ptr<void>(v_cache);
  p.slot_mapping = ptr<const int64_t>(slot_mapping);
  p.num_tokens = num_tokens;
  p.key_token_stride = key_strides[0];
  p.key_head_stride = key_strides[1];
  p.value_token_stride = value_strides[0];
  p.value_head_stride = value_strides[1];
  p.layout = make_layout(cache_shape);
  p.dtype = static_cast<DType>(dtype);
  Status st;
  {
    py::gil_scoped_release release;
    if (device == kCpu) {
      st = write_kv_cpu(p);
    } else {
#if defined(SARATHI_RT_WITH_CUDA)
      st = write_kv_cuda(p, ptr<void>(stream));
#else
      no_cuda();
#endif
    }
  }
  raise_if_error(st);
}

void hybrid_attention(uintptr_t q, uintptr_t out, uintptr_t k_cache, uintptr_t v_cache, uintptr_t cu_seqlens_q,
                      uintptr_t seqlens_k, uintptr_t block_tables, int64_t batch, int64_t total_q,
                      int64_t num_q_heads, int64_t max_blocks_per_seq, std::array<int64_t, 2> q_strides,
                      std::array<int64_t, 2> out_strides, std::array<int64_t, 4> cache_shape, float scale,
                      int dtype, int device, uintptr_t stream) {
  HybridAttentionParams p;
  p.q = ptr<const void>(q);
  p.out = ptr<void>(out);
  p.k_cache = ptr<const void>(k_cache);
  p.v_cache = ptr<const void>(v_cache);
  p.cu_seqlens_q = ptr<const int32_t>(cu_seqlens_q);
  p.seqlens_k = ptr<const int32_t>(seqlens_k);
  p.block_tables = ptr<const int32_t>(block_tables);
  p.batch = batch;
  p.total_q = total_q;
  p.num_q_heads = num_q_heads;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.q_token_stride = q_strides[0];
  p.q_head_stride = q_strides[1];
  p.out_token_stride = out_strides[0];
  p.out_head_stride = out_strides[1];
  p.scale = scale;
  p.layout = make_layout(cache_shape);
  p.dtype = static_cast<DType>(dtype);
  if (device != kCpu) throw py::value_error("hybrid_attention: CUDA tensors are not supported by this build yet");
  Status st;
  {
    py::gil_scoped_release release;
    st = hybrid_attention_cpu(p);
  }
  raise_if_error(st);
}

py::dict build_info() {
  py::dict info;
  info["version"] = SARATHI_RT_VERSION;
#if defined(SARATHI_RT_WITH_CUDA)
  info["cuda_compiled"] = true;
  std::vector<std::string> archs;
  std::string all = SARATHI_RT_CUDA_ARCHS;
  for (size_t start = 0, end; start <= all.size(); start = end + 1) {
    end = all.find(',', start);
    if (end == std::string::npos) end = all.size();
    if (end > start) archs.push_back(all.substr(start, end - start));
  }
  info["cuda_archs"] = archs;
#else
  info["cuda_compiled"] = false;
  info["cuda_archs"] = std::vector<std::string>{};
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

PYBIND11_MODULE(_C, m) {
  m.doc() = "sarathi_rt C++/CUDA core: raw-pointer kernels behind sarathi_rt.ops";

  m.def("build_info", &build_info, "How this module was built.");

  py::enum_<DType>(m, "DType")
      .value("float32", DType::kFloat32)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16);

  m.def("write_kv", &write_kv, py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("num_tokens"), py::arg("key_strides"), py::arg("value_strides"),
        py::arg("cache_shape"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def("hybrid_attention", &hybrid_attention, py::arg("q"), py::arg("out"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("cu_seqlens_q"), py::arg("seqlens_k"), py::arg("block_tables"),
        py::arg("batch"), py::arg("total_q"), py::arg("num_q_heads"), py::arg("max_blocks_per_seq"),
        py::arg("q_strides"), py::arg("out_strides"), py::arg("cache_shape"), py::arg("scale"), py::arg("dtype"),
        py::arg("device"), py::arg("stream"));

  py::register_exception<OutOfBlocks>(m, "OutOfBlocksError", PyExc_MemoryError);
  py::class_<BlockAllocator>(m, "BlockAllocator")
      .def(py::init<int64_t>(), py::arg("num_blocks"))
      .def("allocate", &BlockAllocator::allocate, py::arg("n"))
      .def("free", &BlockAllocator::free, py::arg("ids"))
      .def("incref", &BlockAllocator::incref, py::arg("ids"))
      .def("refcount", &BlockAllocator::refcount, py::arg("id"))
      .def_property_readonly("num_free", &BlockAllocator::num_free)
      .def_property_readonly("num_blocks", &BlockAllocator::num_blocks)
      .def("__repr__", [](const BlockAllocator& a) {
        return "BlockAllocator(num_blocks=" + std::to_string(a.num_blocks()) +
               ", num_free=" + std::to_string(a.num_free()) + ")";
      });
}

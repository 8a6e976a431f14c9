// _C.step_indices: ModelRunner.prepare's one call into the core, reading the step's
// SequenceChunks (Python objects) into the flat arrays of sarathi_rt/step_indices.h.
#include "step_indices_binding.h"

#include <limits>
#include <string>
#include <vector>

#include "sarathi_rt/step_indices.h"

namespace py = pybind11;

namespace sarathi_rt {
namespace {

// Appends the ints of `seq` (a list or tuple) to `out`; false (with the Python error
// cleared) when one is not an int of type T.
template <typename T>
bool append_ints(PyObject* seq, std::vector<T>& out) {
  py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq, ""));
  if (!fast) return PyErr_Clear(), false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
  PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long v = PyLong_AsLongLong(items[i]);
    if ((v == -1 && PyErr_Occurred()) || v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
      PyErr_Clear();
      return false;
    }
    out.push_back(static_cast<T>(v));
  }
  return true;
}

// ModelRunner.prepare's one call: reads each SequenceChunk's token_ids, start_pos,
// block_table, prompt_targets, sampling, forks and num_draft, and returns (the int64 buffer, the
// int32 buffer, tokens, width) of step_indices.h as bytearrays. A bad chunk raises
// ValueError naming its request.
py::tuple step_indices(const py::sequence& chunks, int64_t block_size, int64_t max_position, int64_t vocab_size) {
  static const py::str kIds("token_ids"), kStart("start_pos"), kTable("block_table"), kTargets("prompt_targets"),
      kSampling("sampling"), kForks("forks"),
      kDraft("num_draft");
  const int64_t batch = static_cast<int64_t>(py::len(chunks));
  std::vector<StepChunk> views(static_cast<size_t>(batch));
  std::vector<int64_t> ids;
  std::vector<int32_t> tables;
  ids.reserve(static_cast<size_t>(batch));
  tables.reserve(static_cast<size_t>(batch) * 8);
  auto fail = [&](int64_t b, const std::string& what) {
    throw py::value_error("request " + py::repr(chunks[b].attr("request_id")).cast<std::string>() + ": " + what);
  };
  for (int64_t b = 0; b < batch; ++b) {
    const py::object c = chunks[b];
    StepChunk& v = views[static_cast<size_t>(b)];
    v.token_offset = static_cast<int64_t>(ids.size());
    v.table_offset = static_cast<int64_t>(tables.size());
    if (!append_ints(c.attr(kIds).ptr(), ids)) fail(b, "token_ids must be a list of ints");
    if (!append_ints(c.attr(kTable).ptr(), tables)) fail(b, "block_table must be a list of int32 block ids");
    v.num_tokens = static_cast<int64_t>(ids.size()) - v.token_offset;
    v.num_blocks = static_cast<int64_t>(tables.size()) - v.table_offset;
    v.start_pos = c.attr(kStart).cast<int64_t>();
    const py::object targets = c.attr(kTargets);
    v.num_targets = targets.is_none() ? 0 : static_cast<int64_t>(py::len(targets));
    v.num_samples = c.attr(kSampling).is_none() ? 0 : 1 + static_cast<int64_t>(py::len(c.attr(kForks)));
    v.num_draft = c.attr(kDraft).cast<int64_t>();
  }
  StepIndicesInput in;
  in.chunks = views.data();
  in.batch = batch;
  in.token_ids = ids.data();
  in.block_tables = tables.data();
  in.block_size = block_size;
  in.max_position = max_position;
  in.vocab_size = vocab_size;
  StepIndicesSizes sizes;
  int64_t bad = -1;
  const Status st = step_indices_sizes(in, &sizes, &bad);
  if (!st.ok()) {
    if (bad >= 0) fail(bad, st.message);
    throw py::value_error(st.message);  // the step as a whole (no chunks, a bad block_size)
  }
  py::bytearray longs(nullptr, static_cast<size_t>(sizes.longs()) * sizeof(int64_t));
  py::bytearray ints(nullptr, static_cast<size_t>(sizes.ints(batch)) * sizeof(int32_t));
  write_step_indices(in, sizes, reinterpret_cast<int64_t*>(PyByteArray_AS_STRING(longs.ptr())),
                     reinterpret_cast<int32_t*>(PyByteArray_AS_STRING(ints.ptr())));
  return py::make_tuple(longs, ints, sizes.tokens, sizes.width);
}

}  // namespace

void bind_step_indices(py::module_& m) {
  m.def("step_indices", &step_indices, py::arg("chunks"), py::arg("block_size"), py::arg("max_position"),
        py::arg("vocab_size"),
        "One step's index buffers from its SequenceChunks: (int64 ids/positions/slots/logits rows, int32 "
        "cu_seqlens_q/seqlens_k/block tables, tokens, width) as bytearrays; ValueError names a bad chunk.");
}

}  // namespace sarathi_rt

// The module's bindings: turn Python ints (data pointers), shapes and strides into the
// params structs, release the GIL around kernels, and map Status to exceptions.
// build_info.cpp adds how the module was built, step_indices_binding.cpp the step's index arrays.
// Tensor-level validation (dtype, shape, device, layout) lives in sarathi_rt.ops.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>

#include "build_info.h"
#include "isa_binding.h"
#include "step_indices_binding.h"
#include "sarathi_rt/attention_plan.h"
#include "sarathi_rt/block_allocator.h"
#include "sarathi_rt/elementwise.h"
#include "sarathi_rt/gemm.h"
#include "sarathi_rt/gemm_plan.h"
#include "sarathi_rt/kv_ops.h"
#include "sarathi_rt/nvtx.h"

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
              std::array<int64_t, 4> cache_shape, int dtype, int device, uintptr_t stream, bool sync_check) {
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
  p.sync_check = sync_check;
  p.device = device;
  Status st;
  {
    py::gil_scoped_release release;
    NvtxOpRange range("write_kv");
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

// The tensor part of the attention params, shared by the CPU and the planned CUDA entry.
HybridAttentionParams attention_params(uintptr_t q, uintptr_t out, uintptr_t k_cache, uintptr_t v_cache,
                                       uintptr_t block_tables, int64_t num_q_heads, int64_t max_blocks_per_seq,
                                       std::array<int64_t, 2> q_strides, std::array<int64_t, 2> out_strides,
                                       std::array<int64_t, 4> cache_shape, float scale, int64_t window,
                                       float softcap, int dtype) {
  HybridAttentionParams p;
  p.q = ptr<const void>(q);
  p.out = ptr<void>(out);
  p.k_cache = ptr<const void>(k_cache);
  p.v_cache = ptr<const void>(v_cache);
  p.block_tables = ptr<const int32_t>(block_tables);
  p.num_q_heads = num_q_heads;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.q_token_stride = q_strides[0];
  p.q_head_stride = q_strides[1];
  p.out_token_stride = out_strides[0];
  p.out_head_stride = out_strides[1];
  p.scale = scale;
  p.window = window;
  p.softcap = softcap;
  p.layout = make_layout(cache_shape);
  p.dtype = static_cast<DType>(dtype);
  return p;
}

// max_items, max_merges, max_partial_rows, num_ctas (workers), kernel (AttentionKernel)
using CapacityTuple = std::array<int64_t, 5>;

AttentionPlanCapacity make_capacity(const CapacityTuple& c) {
  if (c[4] != static_cast<int64_t>(AttentionKernel::kCuda) && c[4] != static_cast<int64_t>(AttentionKernel::kCpu)) {
    throw py::value_error("capacity: unknown attention kernel " + std::to_string(c[4]));
  }
  return {c[0], c[1], c[2], c[3], static_cast<AttentionKernel>(c[4])};
}

void hybrid_attention(uintptr_t q, uintptr_t out, uintptr_t k_cache, uintptr_t v_cache, uintptr_t cu_seqlens_q,
                      uintptr_t seqlens_k, uintptr_t block_tables, int64_t batch, int64_t total_q,
                      int64_t num_q_heads, int64_t max_blocks_per_seq, std::array<int64_t, 2> q_strides,
                      std::array<int64_t, 2> out_strides, std::array<int64_t, 4> cache_shape, float scale,
                      int64_t window, float softcap, int dtype, int device, uintptr_t stream, uintptr_t plan,
                      CapacityTuple capacity) {
  HybridAttentionParams p = attention_params(q, out, k_cache, v_cache, block_tables, num_q_heads, max_blocks_per_seq,
                                             q_strides, out_strides, cache_shape, scale, window, softcap, dtype);
  p.cu_seqlens_q = ptr<const int32_t>(cu_seqlens_q);
  p.seqlens_k = ptr<const int32_t>(seqlens_k);
  p.batch = batch;
  p.total_q = total_q;
  if (device != kCpu) throw py::value_error("hybrid_attention: CUDA tensors are not supported by this build yet");
  Status st;
  {
    py::gil_scoped_release release;
    NvtxOpRange range("attention");
    st = plan == 0 ? hybrid_attention_cpu(p) : hybrid_attention_cpu_planned(p, ptr<const int32_t>(plan),
                                                                               make_capacity(capacity));
  }
  raise_if_error(st);
}

// Runs an op on the CPU or, for device >= 0, with its CUDA launcher (null when this
// build has no CUDA), without the GIL.
#if defined(SARATHI_RT_WITH_CUDA)
#define SRT_CUDA_LAUNCHER(fn) (&fn)
#else
#define SRT_CUDA_LAUNCHER(fn) nullptr
#endif

// The CUDA launcher's type is not deduced, so a nullptr (no CUDA build) binds to it.
template <typename P>
struct CudaLauncher {
  using type = Status (*)(const P&, void*);
};

template <typename P>
void launch(const P& p, int device, uintptr_t stream, Status (*cpu)(const P&), typename CudaLauncher<P>::type cuda) {
  if (device != kCpu && cuda == nullptr) {
    throw py::value_error("sarathi_rt was built without CUDA; rebuild with SARATHI_RT_CUDA=1 to use CUDA tensors");
  }
  Status st;
  {
    py::gil_scoped_release release;
    st = device == kCpu ? cpu(p) : cuda(p, ptr<void>(stream));
  }
  raise_if_error(st);
}

void rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t out, uintptr_t residual_out,
              int64_t num_tokens, int64_t hidden, std::array<int64_t, 4> row_strides, float eps, int dtype, int device,
              uintptr_t stream) {
  RMSNormParams p;
  p.x = ptr<const void>(x);
  p.residual = ptr<const void>(residual);
  p.weight = ptr<const void>(weight);
  p.out = ptr<void>(out);
  p.residual_out = ptr<void>(residual_out);
  p.num_tokens = num_tokens;
  p.hidden = hidden;
  p.x_stride = row_strides[0];
  p.residual_stride = row_strides[1];
  p.out_stride = row_strides[2];
  p.residual_out_stride = row_strides[3];
  p.eps = eps;
  p.dtype = static_cast<DType>(dtype);
  launch(p, device, stream, &rms_norm_cpu, SRT_CUDA_LAUNCHER(rms_norm_cuda));
}

void rotary_embedding(uintptr_t positions, uintptr_t q, uintptr_t k, uintptr_t cos_sin_cache, int64_t num_tokens,
                      int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
                      int64_t max_position, std::array<int64_t, 2> q_strides, std::array<int64_t, 2> k_strides,
                      int dtype, int device, uintptr_t stream) {
  RotaryParams p;
  p.positions = ptr<const int64_t>(positions);
  p.q = ptr<void>(q);
  p.k = ptr<void>(k);
  p.cos_sin_cache = ptr<const float>(cos_sin_cache);
  p.num_tokens = num_tokens;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.rotary_dim = rotary_dim;
  p.max_position = max_position;
  p.q_token_stride = q_strides[0];
  p.q_head_stride = q_strides[1];
  p.k_token_stride = k_strides[0];
  p.k_head_stride = k_strides[1];
  p.dtype = static_cast<DType>(dtype);
  launch(p, device, stream, &rotary_embedding_cpu, SRT_CUDA_LAUNCHER(rotary_embedding_cuda));
}

void silu_and_mul(uintptr_t x, uintptr_t out, int64_t num_tokens, int64_t intermediate, int64_t x_stride,
                  int64_t out_stride, int dtype, int device, uintptr_t stream) {
  SiluAndMulParams p;
  p.x = ptr<const void>(x);
  p.out = ptr<void>(out);
  p.num_tokens = num_tokens;
  p.intermediate = intermediate;
  p.x_stride = x_stride;
  p.out_stride = out_stride;
  p.dtype = static_cast<DType>(dtype);
  launch(p, device, stream, &silu_and_mul_cpu, SRT_CUDA_LAUNCHER(silu_and_mul_cuda));
}

// CPU tensors only (ops.argmax_rows leaves CUDA ones to torch).
void argmax_rows(uintptr_t x, uintptr_t out, int64_t num_tokens, int64_t n, int64_t x_stride, int dtype) {
  ArgmaxParams p;
  p.x = ptr<const void>(x);
  p.out = ptr<int64_t>(out);
  p.num_tokens = num_tokens;
  p.n = n;
  p.x_stride = x_stride;
  p.dtype = static_cast<DType>(dtype);
  launch(p, kCpu, 0, &argmax_rows_cpu, nullptr);
}

py::tuple plan_capacity(int64_t max_batch, int64_t max_tokens, int64_t num_q_heads, int64_t num_kv_heads,
                        int64_t num_ctas, int64_t kernel) {
  const AttentionKernel k = make_capacity({0, 0, 0, num_ctas, kernel}).kernel;
  const AttentionPlanCapacity c =
      attention_plan_capacity(max_batch, max_tokens, num_q_heads, num_kv_heads, attention_target(k, num_ctas));
  return py::make_tuple(c.max_items, c.max_merges, c.max_partial_rows, c.num_ctas, static_cast<int64_t>(c.kernel),
                        c.total_words());
}

py::dict plan_stats(uintptr_t buffer, CapacityTuple capacity, int64_t head_dim) {
  const AttentionPlanStats s = attention_plan_stats(ptr<const int32_t>(buffer), make_capacity(capacity), head_dim);
  return py::dict(py::arg("num_items") = s.num_items, py::arg("num_splits") = s.num_splits,
                  py::arg("num_partials") = s.num_partials, py::arg("partial_rows") = s.partial_rows,
                  py::arg("partial_bytes") = s.partial_bytes, py::arg("max_load") = s.max_load,
                  py::arg("total_load") = s.total_load);
}

int64_t partial_bytes(int64_t kernel, int64_t head_dim, int64_t partial_rows) {
  return attention_partial_bytes(make_capacity({0, 0, 0, 1, kernel}).kernel, head_dim, partial_rows);
}

// Returns the plan's partial rows: what the CUDA kernel's pool must hold for it.
int64_t build_plan(uintptr_t buffer, uintptr_t cu_seqlens_q, uintptr_t seqlens_k, uintptr_t block_tables,
                int64_t batch, int64_t total_q, int64_t num_q_heads, int64_t max_blocks_per_seq,
                std::array<int64_t, 4> cache_shape, CapacityTuple capacity, int64_t window) {
  AttentionPlanInputs in;
  in.cu_seqlens_q = ptr<const int32_t>(cu_seqlens_q);
  in.seqlens_k = ptr<const int32_t>(seqlens_k);
  in.block_tables = ptr<const int32_t>(block_tables);
  in.batch = batch;
  in.total_q = total_q;
  in.num_q_heads = num_q_heads;
  in.max_blocks_per_seq = max_blocks_per_seq;
  in.layout = make_layout(cache_shape);
  in.window = window;
  Status st;
  {
    py::gil_scoped_release release;
    NvtxOpRange range("attention_plan");
    st = build_attention_plan(in, make_capacity(capacity), ptr<int32_t>(buffer));
  }
  raise_if_error(st);
  return ptr<const int32_t>(buffer)[kPlanNumPartialRows];
}

void hybrid_attention_planned(uintptr_t q, uintptr_t out, uintptr_t k_cache, uintptr_t v_cache,
                              uintptr_t block_tables, int64_t num_q_heads, int64_t max_blocks_per_seq,
                              std::array<int64_t, 2> q_strides, std::array<int64_t, 2> out_strides,
                              std::array<int64_t, 4> cache_shape, float scale, int64_t window, float softcap,
                              int dtype, int device, uintptr_t stream, uintptr_t plan, CapacityTuple capacity,
                              uintptr_t partial_out, uintptr_t partial_lse) {
#if defined(SARATHI_RT_WITH_CUDA)
  const HybridAttentionParams p = attention_params(q, out, k_cache, v_cache, block_tables, num_q_heads,
                                                   max_blocks_per_seq, q_strides, out_strides, cache_shape, scale,
                                                   window, softcap, dtype);
  PlannedAttentionArgs args;
  args.plan = ptr<const int32_t>(plan);
  args.capacity = make_capacity(capacity);
  args.partial_out = ptr<float>(partial_out);
  args.partial_lse = ptr<float>(partial_lse);
  args.device = device;
  Status st;
  {
    py::gil_scoped_release release;
    NvtxOpRange range("attention");
    st = hybrid_attention_cuda(p, args, ptr<void>(stream));
  }
  raise_if_error(st);
#else
  no_cuda();
#endif
}

void gemm(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k,
          std::array<int64_t, 3> row_strides, int dtype, int config, int split_k, uintptr_t workspace,
          int64_t workspace_bytes, int device, uintptr_t stream) {
  GemmParams p;
  p.x = ptr<const void>(x);
  p.w = ptr<const void>(w);
  p.bias = ptr<const void>(bias);
  p.y = ptr<void>(y);
  p.m = m;
  p.n = n;
  p.k = k;
  p.ldx = row_strides[0];
  p.ldw = row_strides[1];
  p.ldy = row_strides[2];
  p.dtype = static_cast<DType>(dtype);
  p.config_id = config;
  p.split_k = split_k;
  p.workspace = ptr<void>(workspace);
  p.workspace_bytes = workspace_bytes;
  NvtxOpRange range("gemm");
  launch(p, device, stream, &gemm_streamed_cpu, SRT_CUDA_LAUNCHER(gemm_cuda));
}

int attention_ctas_per_sm(int64_t head_dim, int dtype, int device) {
#if defined(SARATHI_RT_WITH_CUDA)
  int ctas = 0;
  raise_if_error(attention_cuda_ctas_per_sm(head_dim, static_cast<DType>(dtype), device, &ctas));
  return ctas;
#else
  no_cuda();
#endif
}

py::dict tile_config_dict(const GemmTileConfig& c) {
  py::dict d;
  d["id"] = c.id;
  d["name"] = c.name;
  d["tile_m"] = c.tile_m;
  d["tile_n"] = c.tile_n;
  d["tile_k"] = c.tile_k;
  d["stages"] = c.stages;
  d["warps"] = c.warps;
  d["swap_ab"] = c.swap_ab;
  d["mma_efficiency"] = c.mma_efficiency;
  d["smem_bytes"] = c.smem_bytes();
  return d;
}

py::list gemm_tile_configs_list() {
  py::list out;
  for (const GemmTileConfig& c : gemm_tile_configs()) out.append(tile_config_dict(c));
  return out;
}

py::dict gemm_plan(int64_t m, int64_t n, int64_t k, int dtype, int arch, int num_sms, int config, int split_k) {
  GemmPlan p;
  raise_if_error(
      plan_gemm(m, n, k, static_cast<DType>(dtype), GpuTarget::for_arch(arch, num_sms), &p, config, split_k));
  py::dict d;
  d["config"] = tile_config_dict(p.config);
  d["split_k"] = p.split_k;
  d["tile_m"] = p.tile_m;
  d["tile_n"] = p.tile_n;
  d["tiles_m"] = p.tiles_m;
  d["tiles_n"] = p.tiles_n;
  d["ctas"] = p.ctas;
  d["workspace_bytes"] = p.workspace_bytes;
  d["registers"] = p.registers;
  d["ctas_per_sm"] = p.ctas_per_sm;
  d["waves"] = p.waves;
  d["tile_efficiency"] = p.tile_efficiency;
  d["wave_efficiency"] = p.wave_efficiency;
  d["efficiency"] = p.efficiency;
  d["estimated_time"] = p.estimated_time;
  return d;
}

py::dict gemm_kernel_occupancy(int config, int dtype, bool split_k, int device) {
#if defined(SARATHI_RT_WITH_CUDA)
  GemmKernelOccupancy occ;
  raise_if_error(gemm_cuda_occupancy(config, static_cast<DType>(dtype), split_k, device, &occ));
  py::dict d;
  d["registers"] = occ.registers;
  d["ctas_per_sm"] = occ.ctas_per_sm;
  return d;
#else
  no_cuda();
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "sarathi_rt C++/CUDA core: raw-pointer kernels behind sarathi_rt.ops";

  bind_build_info(m);
  bind_step_indices(m);
  bind_isa(m);

  py::enum_<DType>(m, "DType")
      .value("float32", DType::kFloat32)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16);

  m.attr("NVTX") = kHaveNvtx;
#if defined(SARATHI_RT_NVTX_INCLUDE)
  m.attr("NVTX_INCLUDE") = SARATHI_RT_NVTX_INCLUDE;  // where the headers were: a test builds a tool with them
#else
  m.attr("NVTX_INCLUDE") = "";
#endif
  m.def("nvtx_push", [](const std::string& name, uint32_t argb) { nvtx_push(name.c_str(), argb); },
        py::arg("name"), py::arg("argb"), "Push a range on this thread in the sarathi_rt NVTX domain.");
  m.def("nvtx_pop", &nvtx_pop, "Pop this thread's innermost sarathi_rt NVTX range.");
  m.def("nvtx_detail", &nvtx_detail, "Whether SARATHI_RT_NVTX=detail: per-layer and per-op ranges.");
  m.def("write_kv", &write_kv, py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("num_tokens"), py::arg("key_strides"), py::arg("value_strides"),
        py::arg("cache_shape"), py::arg("dtype"), py::arg("device"), py::arg("stream"), py::arg("sync_check") = true);
  m.def("hybrid_attention", &hybrid_attention, py::arg("q"), py::arg("out"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("cu_seqlens_q"), py::arg("seqlens_k"), py::arg("block_tables"),
        py::arg("batch"), py::arg("total_q"), py::arg("num_q_heads"), py::arg("max_blocks_per_seq"),
        py::arg("q_strides"), py::arg("out_strides"), py::arg("cache_shape"), py::arg("scale"), py::arg("window"),
        py::arg("softcap"), py::arg("dtype"), py::arg("device"), py::arg("stream"), py::arg("plan"),
        py::arg("capacity"),
        "CPU hybrid attention: runs the plan at `plan` (host buffer, AttentionKernel::kCpu) or, when it is 0, "
        "plans internally.");

  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("out"),
        py::arg("residual_out"), py::arg("num_tokens"), py::arg("hidden"), py::arg("row_strides"), py::arg("eps"),
        py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def("rotary_embedding", &rotary_embedding, py::arg("positions"), py::arg("q"), py::arg("k"),
        py::arg("cos_sin_cache"), py::arg("num_tokens"), py::arg("num_q_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("rotary_dim"), py::arg("max_position"), py::arg("q_strides"),
        py::arg("k_strides"), py::arg("dtype"), py::arg("device"), py::arg("stream"));
  m.def("silu_and_mul", &silu_and_mul, py::arg("x"), py::arg("out"), py::arg("num_tokens"), py::arg("intermediate"),
        py::arg("x_stride"), py::arg("out_stride"), py::arg("dtype"), py::arg("device"), py::arg("stream"));

  m.def("argmax_rows", &argmax_rows, py::arg("x"), py::arg("out"), py::arg("num_tokens"), py::arg("n"),
        py::arg("x_stride"), py::arg("dtype"));

  m.def("attention_plan_capacity", &plan_capacity, py::arg("max_batch"), py::arg("max_tokens"),
        py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("num_ctas"), py::arg("kernel"),
        "(max_items, max_merges, max_partial_rows, num_ctas, kernel, total_words) of a hybrid-attention plan.");
  m.def("attention_plan_stats", &plan_stats, py::arg("buffer"), py::arg("capacity"), py::arg("head_dim"),
        "Per-worker loads of a built plan under the planner's cost model, and the partial-pool bytes it needs.");
  m.def("attention_partial_bytes", &partial_bytes, py::arg("kernel"), py::arg("head_dim"), py::arg("partial_rows"),
        "Bytes of the partial-result pool that many partial rows take in that kernel's layout.");
  m.def("cpu_attention_workers", &cpu_attention_workers, "Default worker bins of a CPU attention plan.");
  m.def("build_attention_plan", &build_plan, py::arg("buffer"), py::arg("cu_seqlens_q"),
        py::arg("seqlens_k"), py::arg("block_tables"), py::arg("batch"), py::arg("total_q"), py::arg("num_q_heads"),
        py::arg("max_blocks_per_seq"), py::arg("cache_shape"), py::arg("capacity"),
        py::arg("window") = 0);
  m.def("hybrid_attention_planned", &hybrid_attention_planned, py::arg("q"), py::arg("out"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("num_q_heads"), py::arg("max_blocks_per_seq"),
        py::arg("q_strides"), py::arg("out_strides"), py::arg("cache_shape"), py::arg("scale"), py::arg("window"),
        py::arg("softcap"), py::arg("dtype"), py::arg("device"), py::arg("stream"), py::arg("plan"),
        py::arg("capacity"), py::arg("partial_out"), py::arg("partial_lse"));
  m.def("attention_ctas_per_sm", &attention_ctas_per_sm, py::arg("head_dim"), py::arg("dtype"), py::arg("device"));
  m.attr("ATTENTION_PLAN_LAYOUT") = py::dict(
      py::arg("header_words") = static_cast<int>(kPlanHeaderWords),
      py::arg("item_words") = static_cast<int>(sizeof(AttentionWorkItem) / 4),
      py::arg("merge_words") = static_cast<int>(sizeof(AttentionMergeItem) / 4),
      py::arg("narrow_rows") = kNarrowTileRows, py::arg("wide_rows") = kWideTileRows,
      py::arg("keys_per_chunk") = kKeysPerChunk, py::arg("min_split_chunks") = kMinSplitChunks,
      py::arg("cpu_direct_rows") = kCpuDirectRows, py::arg("cpu_min_split_chunks") = kCpuMinSplitChunks,
      py::arg("max_pieces_per_worker") = kMaxPiecesPerWorker,
      py::arg("partial_rows_per_worker") = kPartialRowsPerWorker,
      py::arg("kernel_cuda") = static_cast<int>(AttentionKernel::kCuda),
      py::arg("kernel_cpu") = static_cast<int>(AttentionKernel::kCpu));

  m.def("gemm", &gemm, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"),
        py::arg("k"), py::arg("row_strides"), py::arg("dtype"), py::arg("config"), py::arg("split_k"),
        py::arg("workspace"), py::arg("workspace_bytes"), py::arg("device"), py::arg("stream"));
  m.def("gemm_kernel_occupancy", &gemm_kernel_occupancy, py::arg("config"), py::arg("dtype"), py::arg("split_k"),
        py::arg("device"), "Registers per thread and CTAs per SM of one GEMM kernel, from the CUDA driver.");
  m.def("gemm_tile_configs", &gemm_tile_configs_list, "The GEMM tile configurations the planner chooses from.");
  m.def("gemm_plan", &gemm_plan, py::arg("m"), py::arg("n"), py::arg("k"), py::arg("dtype"), py::arg("arch"),
        py::arg("num_sms"), py::arg("config") = -1, py::arg("split_k") = 0);

  py::register_exception<OutOfBlocks>(m, "OutOfBlocksError", PyExc_MemoryError);
  py::class_<BlockAllocator>(m, "BlockAllocator")
      .def(py::init<int64_t>(), py::arg("num_blocks"))
      .def("allocate", &BlockAllocator::allocate, py::arg("n"))
      .def("free", &BlockAllocator::free, py::arg("ids"))
      .def("incref", &BlockAllocator::incref, py::arg("ids"))
      .def("reuse", &BlockAllocator::reuse, py::arg("ids"))
      .def("mark_cached", &BlockAllocator::mark_cached, py::arg("ids"))
      .def("is_cached", &BlockAllocator::is_cached, py::arg("id"))
      .def("refcount", &BlockAllocator::refcount, py::arg("id"))
      .def_property_readonly("num_free", &BlockAllocator::num_free)
      .def_property_readonly("num_cached_free", &BlockAllocator::num_cached_free)
      .def_property_readonly("num_blocks", &BlockAllocator::num_blocks)
      .def("__repr__", [](const BlockAllocator& a) {
        return "BlockAllocator(num_blocks=" + std::to_string(a.num_blocks()) +
               ", num_free=" + std::to_string(a.num_free()) + ")";
      });
}

"""The LLaMA decoder stack on the CPU without per-op Python: the eager layers' kernels and
GEMMs, called straight, into buffers sized once per row count.

Eagerly (models/llama.py) each layer is ~10 module calls, each op wrapper re-reads its
tensors' pointers and strides, and every op allocates its output: at a small model's
step that Python, not the kernels, is what a step costs beyond its compute (issue 42,
bench/RESULTS.md "Step overhead"). Here the weights' pointers are read once, each row
count gets one set of zero-initialised workspaces (normed rows, qkv, attention out,
o_proj out, gate/up, activated, down out, two residual buffers), and a step calls `_C`'s
kernels and torch's GEMMs (`mm`/`addmm` with `out=`) on them.

It computes what the eager layers compute, bit for bit: the same kernels on the same
rows, and the GEMMs by `ops/linear.py`'s rule for the CPU: a weight that `_streams_weight`
picks runs our streamed kernel on the step's rows; any other runs torch's GEMM on the
rows padded with zero rows to a multiple of `_CPU_ROW_TILE`, which is what keeps a
row's bits independent of the batch (the workspaces' padding rows are zero from their
allocation and no kernel writes them; `mm`/`addmm` into `out=` is what `F.linear` runs
for 2-D inputs). tests/test_layer_loop.py compares the two paths on decode, prefill
and mixed steps in float32 and bfloat16.

It takes the plain LLaMA layer only (`LayerLoop.unsupported` says why not otherwise):
the CPU, one tensor-parallel rank (the row-parallel layers' all-reduce stays eager), no
per-head q/k norm, and the classes of models/llama.py (a family that overrides a layer,
like Gemma, runs eagerly). Anything that fails in it makes every step eager from then
on, with one warning, and that step is rerun eagerly: it rewrites the same KV slots
with the same values, so a failure costs time, never a wrong answer."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sarathi_rt import _C
from sarathi_rt.ops._checks import DTYPE_CODES
from sarathi_rt.ops._registry import KERNELS
from sarathi_rt.ops.linear import _CPU_ROW_TILE, _streams_weight

from .context import StepContext
from .llama import MLP, Attention, DecoderLayer, Linear, LlamaForCausalLM, RMSNorm

log = logging.getLogger("sarathi_rt")

Activations = tuple[torch.Tensor, torch.Tensor | None]
_CPU, _NO_STREAM = -1, 0  # the kernels' device code and stream for the CPU
_NO_WORKSPACE = torch.empty(0, dtype=torch.uint8)


class _Gemm:
    """One projection, y[rows] = x[rows] @ W^T (+ b), into a workspace's `out`: our
    streamed kernel on the step's rows where ops/linear.py streams the weight, else
    torch's GEMM on the padded rows."""

    def __init__(self, linear: Linear, x: torch.Tensor, out: torch.Tensor) -> None:
        self.weight, self.bias, self.x, self.out = linear.weight, linear.bias, x, out
        self.weight_t = linear.weight.t()
        self.streamed = _streams_weight(x[:1], linear.weight, linear.bias)

    def __call__(self, rows: int, padded: int) -> None:
        if self.streamed:
            KERNELS.linear_out(self.x[:rows], self.weight, self.bias, self.out[:rows], 0, 1, _NO_WORKSPACE)
        elif self.bias is None:
            torch.mm(self.x[:padded], self.weight_t, out=self.out[:padded])
        else:
            torch.addmm(self.bias, self.x[:padded], self.weight_t, out=self.out[:padded])


@dataclass(frozen=True)
class _Shape:
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class _Workspace:
    """A row count's buffers (rows = a multiple of the GEMM row tile) and, per layer, its
    GEMMs over them. Layers run one after another, so they share the buffers."""

    def __init__(self, rows: int, shape: _Shape, layers: list[DecoderLayer], dtype: torch.dtype) -> None:
        def buffer(width: int) -> torch.Tensor:
            return torch.zeros(rows, width, dtype=dtype)

        self.normed, self.qkv = buffer(shape.hidden), buffer(shape.q_size + 2 * shape.kv_size)
        self.attn, self.o = buffer(shape.q_size), buffer(shape.hidden)
        self.gate_up, self.activated = buffer(2 * shape.intermediate), buffer(shape.intermediate)
        self.down = buffer(shape.hidden)
        self.residual = (buffer(shape.hidden), buffer(shape.hidden))
        self.gemms = [(_Gemm(layer.self_attn.qkv_proj, self.normed, self.qkv),
                       _Gemm(layer.self_attn.o_proj, self.attn, self.o),
                       _Gemm(layer.mlp.gate_up_proj, self.normed, self.gate_up),
                       _Gemm(layer.mlp.down_proj, self.activated, self.down)) for layer in layers]


class LayerLoop:
    """Call it like the model (`forward(ctx, input_ids=..., intermediate=...)`). `failure`
    says what made it run eagerly (None while it runs its own loop)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        reason = self.unsupported(model)
        if reason is not None:
            raise ValueError(f"model cannot run in the layer loop: {reason}")
        self.model = model
        self.failure: str | None = None
        self._layers: list[DecoderLayer] = list(model.layers.values())
        self._rope = [model.rope_cache(index) for index in model.layers]
        attn, mlp = self._layers[0].self_attn, self._layers[0].mlp
        self._shape = _Shape(hidden=model.config.hidden_size, q_size=attn.q_size, kv_size=attn.kv_size,
                             intermediate=mlp.down_proj.weight.shape[1], num_heads=attn.num_heads,
                             num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim)
        self._dtype = DTYPE_CODES[model.dtype]
        self._spaces: dict[int, _Workspace] = {}

    @staticmethod
    def unsupported(model: torch.nn.Module) -> str | None:
        """Why `model` must run eagerly, or None when the loop computes what it computes."""
        if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
            return f"{type(model).__name__} is not the LLaMA layout's forward"
        if model.device.type != "cpu":
            return f"it runs on the CPU only, the model is on {model.device}"
        if not model.layers:
            return "the stage has no layers"
        for layer in model.layers.values():
            if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention \
                    or type(layer.mlp) is not MLP or type(layer.input_layernorm) is not RMSNorm \
                    or type(layer.post_attention_layernorm) is not RMSNorm:
                return f"{type(layer).__name__} is not the LLaMA decoder layer"
            if layer.self_attn.q_norm is not None:
                return "per-head q/k norms run eagerly"
            if layer.self_attn.o_proj._reduce is not None or layer.mlp.down_proj._reduce is not None:
                return "tensor-parallel layers run eagerly"
        return None

    @torch.inference_mode()
    def __call__(self, ctx: StepContext, input_ids: torch.Tensor | None = None,
                 intermediate: Activations | None = None) -> Activations:
        if self.failure is None:
            try:
                return self._run(ctx, input_ids, intermediate)
            except Exception as exc:  # noqa: BLE001 - any fault here: the eager layers from now on
                self.failure = f"{type(exc).__name__}: {exc}"
                log.warning("layer loop failed (%s); every step runs the eager layers from now on", self.failure)
        return self.model(ctx, input_ids=input_ids, intermediate=intermediate)

    def _workspace(self, rows: int) -> _Workspace:
        padded = -(-rows // _CPU_ROW_TILE) * _CPU_ROW_TILE
        space = self._spaces.get(padded)
        if space is None:
            space = self._spaces[padded] = _Workspace(padded, self._shape, self._layers, self.model.dtype)
        return space

    def _run(self, ctx: StepContext, input_ids: torch.Tensor | None,
             intermediate: Activations | None) -> Activations:
        model = self.model
        if model.shard.is_first:
            if input_ids is None:
                raise ValueError("input_ids is required on the first pipeline stage")
            hidden, residual = model.embed(input_ids), None
        else:
            if intermediate is None:
                raise ValueError("intermediate (hidden, residual) is required after the first stage")
            hidden, residual = intermediate
        rows = hidden.shape[0]
        if rows == 0:
            return model(ctx, input_ids=input_ids, intermediate=intermediate)
        space = self._workspace(rows)
        padded = space.normed.shape[0]
        shape, dtype = self._shape, self._dtype
        hidden_size, qkv_width = shape.hidden, space.qkv.shape[1]
        # The step's index arrays and plans, read once for every layer.
        positions, slots = ctx.positions.data_ptr(), ctx.slot_mapping.data_ptr()
        cu_seqlens, seqlens_k, tables = ctx.cu_seqlens_q.data_ptr(), ctx.seqlens_k.data_ptr(), \
            ctx.block_tables.data_ptr()
        batch, max_blocks = ctx.seqlens_k.shape[0], ctx.block_tables.shape[1]
        plans = {}
        normed, qkv, attn, o = space.normed.data_ptr(), space.qkv.data_ptr(), space.attn.data_ptr(), \
            space.o.data_ptr()
        gate_up, activated = space.gate_up.data_ptr(), space.activated.data_ptr()
        k_offset = shape.q_size * space.qkv.element_size()
        v_offset = k_offset + shape.kv_size * space.qkv.element_size()
        qkv_strides = (qkv_width, shape.head_dim)
        attn_strides = (shape.q_size, shape.head_dim)
        x = hidden.contiguous()
        x_ptr, x_stride = x.data_ptr(), x.stride(0)
        if residual is not None:
            residual = residual.contiguous()
        for layer, rope, gemms in zip(self._layers, self._rope, space.gemms):
            a = layer.self_attn
            qkv_proj, o_proj, gate_up_proj, down_proj = gemms
            norm = layer.input_layernorm
            # Each fused norm reads one residual buffer and writes the other.
            out_res = space.residual[1] if residual is space.residual[0] else space.residual[0]
            if residual is None:  # the first layer of the first stage: the embedding is the residual
                _C.rms_norm(x_ptr, 0, norm.weight.data_ptr(), normed, 0, rows, hidden_size,
                            (x_stride, 0, hidden_size, 0), norm.eps, dtype, _CPU, _NO_STREAM)
                residual = x
            else:
                _C.rms_norm(x_ptr, residual.data_ptr(), norm.weight.data_ptr(), normed, out_res.data_ptr(), rows,
                            hidden_size, (x_stride, residual.stride(0), hidden_size, hidden_size), norm.eps, dtype,
                            _CPU, _NO_STREAM)
                residual = out_res
            qkv_proj(rows, padded)
            _C.rotary_embedding(positions, qkv, qkv + k_offset, rope.data_ptr(), rows, shape.num_heads,
                                shape.num_kv_heads, shape.head_dim, rope.shape[1], rope.shape[0], qkv_strides,
                                qkv_strides, dtype, _CPU, _NO_STREAM)
            k_cache, v_cache = a.k_cache, a.v_cache
            cache_shape = tuple(k_cache.shape)
            _C.write_kv(qkv + k_offset, qkv + v_offset, k_cache.data_ptr(), v_cache.data_ptr(), slots, rows,
                        qkv_strides, qkv_strides, cache_shape, dtype, _CPU, _NO_STREAM, False)
            plan = plans.get(a.window)
            if plan is None:
                step_plan = ctx.plan_for(a.window)
                plan = plans[a.window] = (step_plan.buffer.data_ptr() if step_plan.buffer.numel() else 0,
                                          step_plan.capacity.as_list())
            _C.hybrid_attention(qkv, attn, k_cache.data_ptr(), v_cache.data_ptr(), cu_seqlens, seqlens_k, tables,
                                batch, rows, shape.num_heads, max_blocks, qkv_strides, attn_strides, cache_shape,
                                a.scale, a.window, a.softcap, dtype, _CPU, _NO_STREAM, plan[0], plan[1])
            o_proj(rows, padded)
            norm = layer.post_attention_layernorm
            out_res = space.residual[1] if residual is space.residual[0] else space.residual[0]
            _C.rms_norm(o, residual.data_ptr(), norm.weight.data_ptr(), normed, out_res.data_ptr(), rows,
                        hidden_size, (hidden_size, residual.stride(0), hidden_size, hidden_size), norm.eps, dtype,
                        _CPU, _NO_STREAM)
            residual = out_res
            gate_up_proj(rows, padded)
            _C.silu_and_mul(gate_up, activated, rows, shape.intermediate, 2 * shape.intermediate,
                            shape.intermediate, dtype, _CPU, _NO_STREAM)
            down_proj(rows, padded)
            x_ptr, x_stride = space.down.data_ptr(), hidden_size
        # The next step reuses the workspaces: what leaves the stage is its own copy.
        return space.down[:rows].clone(), residual[:rows].clone()

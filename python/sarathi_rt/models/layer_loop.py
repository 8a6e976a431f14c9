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
rows padded with zero rows as `cpu_padded_rows` says, which is what keeps a
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
from typing import NamedTuple

import torch

from sarathi_rt import _C
from sarathi_rt.ops._checks import DTYPE_CODES
from sarathi_rt.ops.linear import _streams_weight, bound_cpu_gemm, cpu_padded_rows

from .context import StepContext
from .llama import MLP, Attention, DecoderLayer, Linear, LlamaForCausalLM, RMSNorm

log = logging.getLogger("sarathi_rt")

Activations = tuple[torch.Tensor, torch.Tensor | None]
_CPU, _NO_STREAM = -1, 0  # the kernels' device code and stream for the CPU


class _Gemm:
    """One projection, y = x @ W^T (+ b), from a workspace's `x` into its `out`: our
    streamed kernel on the step's rows where ops/linear.py streams the weight, else
    torch's GEMM on all the workspace's rows (the step's, padded)."""

    def __init__(self, linear: Linear, x: torch.Tensor, out: torch.Tensor) -> None:
        self.weight, self.bias, self.x, self.out = linear.weight, linear.bias, x, out
        self.weight_t = linear.weight.t()
        self._streamed_call = bound_cpu_gemm(x, linear.weight, linear.bias, out) \
            if _streams_weight(x[:1], linear.weight, linear.bias) else None

    @property
    def streamed(self) -> bool:
        return self._streamed_call is not None

    def __call__(self, rows: int) -> None:
        if self._streamed_call is not None:
            self._streamed_call(rows)
        elif self.bias is None:
            torch.mm(self.x, self.weight_t, out=self.out)
        else:
            torch.addmm(self.bias, self.x, self.weight_t, out=self.out)


class _Shape(NamedTuple):
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class _LayerArgs(NamedTuple):
    """A layer's weights, rotary cache and KV cache as the kernels take them, read once
    (again only once the model is bound to another cache: `k_cache` is compared per step)."""

    k_cache: torch.Tensor
    input_norm: int
    input_eps: float
    post_norm: int
    post_eps: float
    rope: int
    rope_dim: int
    rope_positions: int
    k: int
    v: int
    cache_shape: tuple[int, ...]
    scale: float
    window: int
    softcap: float


def _layer_args(layer: DecoderLayer, rope: torch.Tensor) -> _LayerArgs:
    attn = layer.self_attn
    if attn.k_cache is None or attn.v_cache is None:
        raise RuntimeError("no KV cache bound: call model.bind_kv_cache(cache) first")
    return _LayerArgs(attn.k_cache, layer.input_layernorm.weight.data_ptr(), layer.input_layernorm.eps,
                      layer.post_attention_layernorm.weight.data_ptr(), layer.post_attention_layernorm.eps,
                      rope.data_ptr(), rope.shape[1], rope.shape[0], attn.k_cache.data_ptr(),
                      attn.v_cache.data_ptr(), tuple(attn.k_cache.shape), attn.scale, attn.window, attn.softcap)


def _buffers(rows: int, shape: _Shape, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The largest step's workspaces, zero-initialised: normed rows, qkv, attention out,
    o_proj out, gate/up, activated, down out and two residual buffers."""
    widths = {"normed": shape.hidden, "qkv": shape.q_size + 2 * shape.kv_size, "attn": shape.q_size,
              "o": shape.hidden, "gate_up": 2 * shape.intermediate, "activated": shape.intermediate,
              "down": shape.hidden, "residual0": shape.hidden, "residual1": shape.hidden}
    return {name: torch.zeros(rows, width, dtype=dtype) for name, width in widths.items()}


class _Workspace:
    """The first `rows` rows of the workspaces (a multiple of the GEMM row tile) and, per
    layer, its GEMMs over them. Layers run one after another, so they share the rows."""

    def __init__(self, rows: int, buffers: dict[str, torch.Tensor], layers: list[DecoderLayer]) -> None:
        self.normed, self.qkv, self.attn, self.o, self.gate_up, self.activated, self.down = (
            buffers[name][:rows] for name in ("normed", "qkv", "attn", "o", "gate_up", "activated", "down"))
        self.residual = (buffers["residual0"][:rows], buffers["residual1"][:rows])
        self.gemms = [(_Gemm(layer.self_attn.qkv_proj, self.normed, self.qkv),
                       _Gemm(layer.self_attn.o_proj, self.attn, self.o),
                       _Gemm(layer.mlp.gate_up_proj, self.normed, self.gate_up),
                       _Gemm(layer.mlp.down_proj, self.activated, self.down)) for layer in layers]
        # Each fused norm reads one residual buffer and writes the other.
        self.other_residual = {id(self.residual[0]): self.residual[1], id(self.residual[1]): self.residual[0]}
        # The GEMMs' inputs: their rows past a step's are zero, as ops/linear.py pads.
        self.gemm_inputs = (self.normed, self.attn, self.activated)


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
        self._args: list[_LayerArgs] = []
        attn, mlp = self._layers[0].self_attn, self._layers[0].mlp
        self._shape = _Shape(hidden=model.config.hidden_size, q_size=attn.q_size, kv_size=attn.kv_size,
                             intermediate=mlp.down_proj.weight.shape[1], num_heads=attn.num_heads,
                             num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim)
        self._dtype = DTYPE_CODES[model.dtype]
        # One set of buffers, grown to the largest step so far, and views of it per padded
        # row count: memory for the largest step only, whatever the token budget.
        self._buffers: dict[str, torch.Tensor] = {}
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
        padded = cpu_padded_rows(rows)
        space = self._spaces.get(padded)
        if space is None:
            if not self._buffers or padded > self._buffers["normed"].shape[0]:
                self._buffers = _buffers(padded, self._shape, self.model.dtype)
                self._spaces.clear()
            space = self._spaces[padded] = _Workspace(padded, self._buffers, self._layers)
        if rows < padded:  # a longer step may have left its rows there
            for t in space.gemm_inputs:
                t[rows:].zero_()
        return space

    def _layer_args(self) -> list[_LayerArgs]:
        args = self._args
        # bind_kv_cache rebinds every layer at once, so the first layer's cache tells.
        if not args or args[0].k_cache is not self._layers[0].self_attn.k_cache:
            args = self._args = [_layer_args(layer, rope) for layer, rope in zip(self._layers, self._rope)]
        return args

    def _run(self, ctx: StepContext, input_ids: torch.Tensor | None,
             intermediate: Activations | None) -> Activations:
        model = self.model
        hidden, residual = model.stage_input(input_ids, intermediate)
        rows = hidden.shape[0]
        if rows == 0:
            return model(ctx, input_ids=input_ids, intermediate=intermediate)
        space = self._workspace(rows)
        num_heads, num_kv_heads, head_dim = self._shape.num_heads, self._shape.num_kv_heads, self._shape.head_dim
        hidden_size, intermediate_size, dtype = self._shape.hidden, self._shape.intermediate, self._dtype
        # The step's index arrays and plans, read once for every layer.
        positions, slots = ctx.positions.data_ptr(), ctx.slot_mapping.data_ptr()
        cu_seqlens, seqlens_k = ctx.cu_seqlens_q.data_ptr(), ctx.seqlens_k.data_ptr()
        tables, batch, max_blocks = ctx.block_tables.data_ptr(), ctx.seqlens_k.shape[0], ctx.block_tables.shape[1]
        plans: dict[int, tuple[int, list[int]]] = {}
        normed, qkv, attn, o = space.normed.data_ptr(), space.qkv.data_ptr(), space.attn.data_ptr(), \
            space.o.data_ptr()
        gate_up, activated = space.gate_up.data_ptr(), space.activated.data_ptr()
        k_at = qkv + self._shape.q_size * space.qkv.element_size()
        v_at = k_at + self._shape.kv_size * space.qkv.element_size()
        qkv_strides = (space.qkv.shape[1], head_dim)  # q, k and v are column slices of one buffer
        attn_strides = (self._shape.q_size, head_dim)
        other_residual = space.other_residual
        x = hidden.contiguous()
        x_at, x_stride = x.data_ptr(), x.stride(0)
        if residual is not None:
            residual = residual.contiguous()
        for (_, input_norm, input_eps, post_norm, post_eps, rope, rope_dim, rope_positions, k_cache, v_cache,
             cache_shape, scale, window, softcap), (qkv_proj, o_proj, gate_up_proj, down_proj) \
                in zip(self._layer_args(), space.gemms):
            if residual is None:  # the first layer of the first stage: the embedding is the residual
                _C.rms_norm(x_at, 0, input_norm, normed, 0, rows, hidden_size, (x_stride, 0, hidden_size, 0),
                            input_eps, dtype, _CPU, _NO_STREAM)
                residual = x
            else:
                out_residual = other_residual.get(id(residual), space.residual[0])
                _C.rms_norm(x_at, residual.data_ptr(), input_norm, normed, out_residual.data_ptr(), rows,
                            hidden_size, (x_stride, residual.stride(0), hidden_size, hidden_size), input_eps, dtype,
                            _CPU, _NO_STREAM)
                residual = out_residual
            qkv_proj(rows)
            _C.rotary_embedding(positions, qkv, k_at, rope, rows, num_heads, num_kv_heads, head_dim, rope_dim,
                                rope_positions, qkv_strides, qkv_strides, dtype, _CPU, _NO_STREAM)
            _C.write_kv(k_at, v_at, k_cache, v_cache, slots, rows, qkv_strides, qkv_strides, cache_shape, dtype,
                        _CPU, _NO_STREAM, False)
            plan = plans.get(window)
            if plan is None:
                step_plan = ctx.plan_for(window)
                plan = plans[window] = (step_plan.buffer.data_ptr() if step_plan.buffer.numel() else 0,
                                        step_plan.capacity.as_list())
            _C.hybrid_attention(qkv, attn, k_cache, v_cache, cu_seqlens, seqlens_k, tables, batch, rows, num_heads,
                                max_blocks, qkv_strides, attn_strides, cache_shape, scale, window, softcap, dtype,
                                _CPU, _NO_STREAM, plan[0], plan[1])
            o_proj(rows)
            out_residual = other_residual.get(id(residual), space.residual[0])
            _C.rms_norm(o, residual.data_ptr(), post_norm, normed, out_residual.data_ptr(), rows, hidden_size,
                        (hidden_size, residual.stride(0), hidden_size, hidden_size), post_eps, dtype, _CPU,
                        _NO_STREAM)
            residual = out_residual
            gate_up_proj(rows)
            _C.silu_and_mul(gate_up, activated, rows, intermediate_size, 2 * intermediate_size, intermediate_size,
                            dtype, _CPU, _NO_STREAM)
            down_proj(rows)
            x_at, x_stride = space.down.data_ptr(), hidden_size
        # The next step reuses the workspaces: what leaves the stage is its own copy.
        return space.down[:rows].clone(), residual[:rows].clone()

"""The LLaMA layout (Llama 2/3, Mistral, Qwen2: see `families/`) built from sarathi_rt ops.

Weights are stored fused: qkv_proj = [q; k; v] and gate_up_proj = [gate; up] along the
output dimension, so each projection is one GEMM. Parameter names otherwise follow
Hugging Face, which keeps the loader's mapping short. Layers pass the residual stream
separately so that every RMSNorm fuses the residual add (vLLM's layout).

Inside a layer the kernels are called through their registered ops directly rather than
through the checking wrappers in sarathi_rt.ops: shapes and dtypes are fixed when the
model is built and its KV cache bound (bind_kv_cache checks the cache), and the step's
index tensors are checked once per step by the ModelRunner, not again in every layer."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from sarathi_rt import ops
from sarathi_rt.ops._registry import KERNELS
from sarathi_rt.ops.attention import check_head_dim, run_attention
from sarathi_rt.ops.linear import apply_linear
from sarathi_rt.utils.nvtx import nvtx_detail_range

from .config import ModelConfig
from .context import StepContext
from .parallel import BoundLayout, ParallelLayout

if TYPE_CHECKING:  # the engine owns the cache; a model only binds to it
    from sarathi_rt.ops.kv_cache import KVCache


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden]; with `residual`, also returns x + residual."""
        out = torch.empty_like(x)
        if residual is None:
            KERNELS.rms_norm_out(x, None, self.weight, self.eps, out, None)
            return out
        new_residual = torch.empty_like(x)
        KERNELS.rms_norm_out(x, residual, self.weight, self.eps, out, new_residual)
        return out, new_residual


class Linear(nn.Module):
    """y = x W^T (+ b). Row-parallel layers sum partial products over the tensor-parallel
    group before the bias is added, so the bias counts once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, reduce: BoundLayout | None = None) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        self._reduce = reduce if reduce is not None and reduce.tp_size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._reduce is None:
            return apply_linear(x, self.weight, self.bias)
        out = self._reduce.reduce(apply_linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def _norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm` applied to each head of x [tokens, heads, head_dim] on its own. x is a
    strided view of the fused qkv, which no single row stride describes, so the rows are
    copied out first; the result is contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    KERNELS.rms_norm_out(rows, None, norm.weight, norm.eps, out, None)
    return out.view(x.shape)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: BoundLayout, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, shard.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)  # the step plans each window the layers use
        self.softcap = config.attn_logit_softcapping or 0.0
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, dtype, device, reduce=shard)
        # Per-head RMSNorm of q and k before rotary, where the family has it (Qwen3). The
        # weight spans one head, so every tensor-parallel rank holds all of it.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, ctx: StepContext, cos_sin: torch.Tensor) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("no KV cache bound: call model.bind_kv_cache(cache) first")
        qkv = self.qkv_proj(hidden)
        tokens = qkv.shape[0]
        q = qkv[:, :self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = _norm_heads(self.q_norm, q), _norm_heads(self.k_norm, k)
        KERNELS.rotary_embedding(ctx.positions, q, k, cos_sin)
        # The slots come from the engine's own block tables: no per-layer wait on the GPU.
        KERNELS.write_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, sync_check=False)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        run_attention(ctx.plan_for(self.window), q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.seqlens_k,
                      ctx.block_tables, self.scale, out, window=self.window, softcap=self.softcap)
        return self.o_proj(out.view(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: BoundLayout, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * shard.intermediate, config.mlp_bias, dtype, device)
        self.down_proj = Linear(shard.intermediate, config.hidden_size, config.mlp_bias, dtype, device,
                                reduce=shard)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        activated = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
        KERNELS.silu_and_mul_out(gate_up, activated)
        return self.down_proj(activated)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: BoundLayout, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, layer, shard, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, shard, dtype, device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, ctx, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """One pipeline stage of the model (the whole model with the default layout).

    The first stage embeds token ids; later stages take the previous stage's
    (hidden, residual). The last stage owns the final norm and lm_head. A family that
    keeps this layout but changes its layers or norm (Gemma) names its own classes here."""

    decoder_layer: type[nn.Module] = DecoderLayer
    final_norm: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", layout: ParallelLayout | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.shard = (layout or ParallelLayout()).bind(config)
        check_head_dim(config.head_dim, device)
        hidden = config.hidden_size
        needs_embed = self.shard.is_first or (self.shard.is_last and config.tie_word_embeddings)
        vocab = len(self.shard.vocab)  # this rank's slice of the vocabulary
        self.embed_tokens = _param(vocab, hidden, dtype=dtype, device=device) if needs_embed else None
        self.layers = nn.ModuleDict({str(i): self.decoder_layer(config, i, self.shard, dtype, device)
                                     for i in self.shard.layers})
        self.norm = self.final_norm(hidden, config.rms_norm_eps, dtype, device) if self.shard.is_last else None
        self.lm_head: nn.Parameter | None = None
        if self.shard.is_last:
            self.lm_head = self.embed_tokens if config.tie_word_embeddings else \
                _param(vocab, hidden, dtype=dtype, device=device)
        self.register_buffer("cos_sin_cache", ops.rope_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling).to(device),
            persistent=False)

    @property
    def device(self) -> torch.device:
        return self.cos_sin_cache.device

    def timed_regions(self) -> Iterator[tuple[str, nn.Module]]:
        """See CausalLM.timed_regions: every Linear, and every Attention (whose
        projections are Linears, timed apart)."""
        for module in self.modules():
            if isinstance(module, Linear):
                yield "linear", module
            elif isinstance(module, Attention):
                yield "attention", module

    def bind_kv_cache(self, cache: KVCache) -> None:
        """Give every attention layer its K/V tensors (cache layer j = this stage's j-th layer)."""
        shape = cache.shape
        if shape.num_layers != len(self.layers):
            raise ValueError(f"cache has {shape.num_layers} layers but this stage runs {len(self.layers)}")
        if (shape.num_kv_heads, shape.head_dim) != (self.shard.num_kv_heads, self.shard.head_dim):
            raise ValueError(f"cache holds {shape.num_kv_heads} KV heads of dim {shape.head_dim} but this "
                             f"shard has {self.shard.num_kv_heads} of dim {self.shard.head_dim}")
        k0 = cache.layer(0)[0]
        if k0.dtype != self.dtype or k0.device != self.device:
            raise ValueError(f"cache is {k0.dtype} on {k0.device} but the model is {self.dtype} on {self.device}")
        for j, layer in enumerate(self.layers.values()):
            layer.self_attn.k_cache, layer.self_attn.v_cache = cache.layer(j)

    @torch.inference_mode()
    def forward(self, ctx: StepContext, input_ids: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor | None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run this stage's layers; returns (hidden, residual) for the next stage or for
        `compute_logits`."""
        hidden, residual = self.stage_input(input_ids, intermediate)
        for index, layer in self.layers.items():
            with nvtx_detail_range(f"layer{index}", "layer"):
                hidden, residual = layer(hidden, residual, ctx, self.rope_cache(index))
        return hidden, residual

    def stage_input(self, input_ids: torch.Tensor | None, intermediate: tuple[torch.Tensor, torch.Tensor | None] | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What this stage's first layer takes: the embedded ids on the first stage
        (residual None), the previous stage's (hidden, residual) on the others."""
        if self.shard.is_first:
            if input_ids is None:
                raise ValueError("input_ids is required on the first pipeline stage")
            return self.embed(input_ids), None
        if intermediate is None:
            raise ValueError("intermediate (hidden, residual) is required after the first stage")
        return intermediate

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input rows for `input_ids` (a family may scale them)."""
        return self.shard.embed(input_ids, self.embed_tokens)

    def rope_cache(self, layer: str) -> torch.Tensor:
        """The cos/sin cache layer `layer` rotates with (one for every layer here)."""
        return self.cos_sin_cache

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                       ctx: StepContext) -> torch.Tensor | None:
        """float32 logits [rows, vocab] for the rows in ctx.logits_indices only. Under
        tensor parallelism each rank computes its vocabulary slice and the full rows
        land on tensor rank 0; the other ranks get None."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("compute_logits runs on the last pipeline stage only")
        rows = hidden.index_select(0, ctx.logits_indices)
        if residual is None:
            normed = self.norm(rows)
        else:
            normed, _ = self.norm(rows, residual.index_select(0, ctx.logits_indices))
        return self.shard.gather_logits(apply_linear(normed, self.lm_head).float())

"""Gemma 2 and Gemma 3 (text): the LLaMA layout (fused qkv and gate_up, rotary, the paged
KV cache, the step's planned hybrid attention) with Gemma's differences, each computed as
transformers' modeling_gemma2 / modeling_gemma3 compute it:

- RMSNorm scales by (1 + weight), in float32, rounded to the model dtype once at the end.
  Our rms_norm kernel rounds the normalized row to the storage dtype before it multiplies
  by a weight in that dtype, so it cannot give this exactly outside float32: these norms
  run in plain torch.
- every layer norms its attention and MLP outputs too (post-attention, pre- and
  post-feed-forward norms), and adds them to a residual stream it carries itself;
- embeddings are scaled by sqrt(hidden_size) rounded to the model dtype; the LM head is
  the embedding (tied) and Gemma 2 soft-caps the logits;
- the MLP is GeGLU with gelu's tanh approximation;
- attention is scaled by query_pre_attn_scalar ** -0.5; local (sliding-window) layers
  alternate with global ones (`layer_types`); Gemma 2 soft-caps the attention logits;
  Gemma 3 norms q and k per head with (1 + w) before rotary and gives its local layers
  their own rope base (`rope_local_base_freq`), the rope scaling being the global
  layers' only.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sarathi_rt import ops
from sarathi_rt.ops._registry import KERNELS
from sarathi_rt.ops.attention import run_attention
from sarathi_rt.ops.linear import apply_linear

from ..config import ModelConfig
from ..context import StepContext
from ..llama import MLP, Attention, LlamaForCausalLM, _param
from ..parallel import BoundLayout, ParallelLayout
from ..registry import Family, register_family

_ACTIVATION = "gelu_pytorch_tanh"  # transformers' name for gelu's tanh approximation


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight) over the last dimension, in float32; `weight` holds the
    checkpoint's value (zero-centred), as transformers keeps it."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(MLP):
    """GeGLU: gelu_tanh(gate) * up, then down (the fused gate_up GEMM of the LLaMA MLP)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(Attention):
    """The LLaMA attention block with Gemma 3's per-head (1 + w) norms of q and k, which
    come between the projection and rotary. Their weights span one head, so every
    tensor-parallel rank holds all of them."""

    def __init__(self, config: ModelConfig, layer: int, shard: BoundLayout, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(config, layer, shard, dtype, device)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)

    def forward(self, hidden: torch.Tensor, ctx: StepContext, cos_sin: torch.Tensor) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("no KV cache bound: call model.bind_kv_cache(cache) first")
        qkv = self.qkv_proj(hidden)
        tokens = qkv.shape[0]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=1)
        # The norms return new contiguous tensors, which rotary then turns in place.
        q = self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
        KERNELS.rotary_embedding(ctx.positions, q, k, cos_sin)
        KERNELS.write_kv(k, v.view(tokens, self.num_kv_heads, self.head_dim), self.k_cache, self.v_cache,
                         ctx.slot_mapping, sync_check=False)
        out = torch.empty_like(q)
        run_attention(ctx.plan_for(self.window), q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.seqlens_k,
                      ctx.block_tables, self.scale, out, window=self.window, softcap=self.softcap)
        return self.o_proj(out.view(tokens, self.q_size))


def _stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return hidden if residual is None else residual + hidden


class Gemma2DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then the same around the MLP with the
    pre- and post-feed-forward norms. Like the LLaMA layers it takes and returns the
    stream as (hidden, residual) whose sum is the stream (residual None: hidden is), so
    pipeline stages hand it on unchanged; the sum is the one transformers adds, in the
    model dtype. No add is fused into a norm: the norm of a sum is not what comes next."""

    attention_class: type[Attention] = Attention

    def __init__(self, config: ModelConfig, layer: int, shard: BoundLayout, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype, device)
        self.self_attn = self.attention_class(config, layer, shard, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype, device)
        self.mlp = GemmaMLP(config, shard, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype, device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stream = _stream(hidden, residual)
        stream = stream + self.post_attention_layernorm(self.self_attn(self.input_layernorm(stream), ctx, cos_sin))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(stream))), stream


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma2ForCausalLM(LlamaForCausalLM):
    """One pipeline stage of Gemma 2 (see the module)."""

    decoder_layer = Gemma2DecoderLayer
    final_norm = GemmaRMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", layout: ParallelLayout | None = None) -> None:
        super().__init__(config, dtype, device, layout)
        # transformers keeps sqrt(hidden_size) as a float32 scalar and rounds it to the
        # model dtype when it multiplies (bfloat16: 55.4256 becomes 55.5).
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5).to(dtype=dtype, device=device),
                             persistent=False)
        # The layers whose rotary uses the local rope base (Gemma 3's sliding layers).
        self._local_rope: frozenset[str] = frozenset()
        if config.rope_local_theta is not None and config.layer_types is not None:
            self.register_buffer("local_cos_sin_cache", ops.rope_cos_sin_cache(
                config.head_dim, config.max_position_embeddings, config.rope_local_theta).to(device),
                persistent=False)
            self._local_rope = frozenset(str(i) for i in self.shard.layers
                                         if config.layer_types[i] == "sliding_attention")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def rope_cache(self, layer: str) -> torch.Tensor:
        return self.local_cos_sin_cache if layer in self._local_rope else self.cos_sin_cache

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                       ctx: StepContext) -> torch.Tensor | None:
        """float32 logits of the rows in ctx.logits_indices, soft-capped in the model
        dtype (as transformers caps them) when the config caps them; see
        LlamaForCausalLM.compute_logits for tensor parallelism."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("compute_logits runs on the last pipeline stage only")
        rows = ctx.logits_indices
        stream = _stream(hidden.index_select(0, rows), None if residual is None else residual.index_select(0, rows))
        logits = apply_linear(self.norm(stream), self.lm_head)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return self.shard.gather_logits(logits.float())


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """One pipeline stage of Gemma 3's text model."""

    decoder_layer = Gemma3DecoderLayer


def _check_causal_gelu(d: dict[str, Any], name: str) -> None:
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{name}: use_bidirectional_attention=True attends both ways; ops.hybrid_attention is "
                         "causal")
    act = d.get("hidden_activation", _ACTIVATION)
    if act != _ACTIVATION:
        raise ValueError(f"{name}: hidden_activation must be {_ACTIVATION!r} (GeGLU with gelu's tanh "
                         f"approximation), got {act!r}")


def _layer_types(d: dict[str, Any], pattern: int) -> list[str]:
    """`layer_types` as written, else every `pattern`-th layer global (the config's
    sliding_window_pattern for Gemma 3 checkpoints written before transformers listed
    the layers, as transformers reads them)."""
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or pattern
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(d["num_hidden_layers"])]


# What transformers' config classes assume for keys a config.json leaves out (their
# defaults differ from the LLaMA reader's).
_GEMMA_DEFAULTS: dict[str, Any] = {"head_dim": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                                   "query_pre_attn_scalar": 256, "sliding_window": 4096}


def normalize_gemma2(d: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 2 config.json as ModelConfig.from_hf_dict reads it (see Family.normalize_hf)."""
    _check_causal_gelu(d, "gemma2")
    out = {**_GEMMA_DEFAULTS, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
           "attn_logit_softcapping": 50.0, **d}
    out.pop("hidden_act", None)  # Gemma 2 applies hidden_activation (checked above); hidden_act is unread
    out["layer_types"] = _layer_types(d, 2)
    return out


def normalize_gemma3(d: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 text config.json as ModelConfig.from_hf_dict reads it: transformers 5
    writes a rope dict per layer kind (rope_parameters), transformers 4 rope_theta,
    rope_local_base_freq and rope_scaling (the global layers')."""
    _check_causal_gelu(d, "gemma3_text")
    out = {**_GEMMA_DEFAULTS, "max_position_embeddings": 131072, "final_logit_softcapping": None,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, **d}
    out.pop("hidden_act", None)
    # Gemma 3's attention passes no soft cap to the attention function, whatever the config says.
    out["attn_logit_softcapping"] = None
    out["layer_types"] = _layer_types(d, 6)
    per_kind = d.get("rope_parameters") or {}
    if "full_attention" in per_kind or "sliding_attention" in per_kind:
        local = dict(per_kind.get("sliding_attention") or {})
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(f"gemma3_text: rope_parameters['sliding_attention'] must have rope_type 'default' "
                             f"(the local layers' rope is not scaled here), got {local}")
        out["rope_parameters"] = {"rope_theta": 1_000_000.0, **(per_kind.get("full_attention") or {})}
        out["rope_local_base_freq"] = local.get("rope_theta", 10_000.0)
        out.pop("rope_scaling", None)
    return out


def _gemma2_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    size = (config.hidden_size,)
    return {"pre_feedforward_layernorm.weight": size, "post_feedforward_layernorm.weight": size}


def _gemma3_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    head = (config.head_dim,)
    return {**_gemma2_tensors(config), "self_attn.q_norm.weight": head, "self_attn.k_norm.weight": head}


register_family(Family(name="gemma2", architectures=("Gemma2ForCausalLM",), model_class=Gemma2ForCausalLM,
                       always_sliding=True, normalize_hf=normalize_gemma2, layer_tensors=_gemma2_tensors))
register_family(Family(name="gemma3_text", architectures=("Gemma3ForCausalLM",), model_class=Gemma3ForCausalLM,
                       always_sliding=True, normalize_hf=normalize_gemma3, layer_tensors=_gemma3_tensors))

"""The fallback family: any decoder-only causal LM that transformers builds and whose
attention goes through its `AttentionInterface` runs here with transformers' own layers,
attention excepted. Each step is one varlen batch (batch dimension 1, the engine's
positions as `position_ids`); every attention layer calls the function registered below
as "sarathi_rt", which writes the layer's K/V into the paged cache and runs the step's
planned hybrid attention, so prefill chunks and decodes share one launch as in the
native path; its linear layers run the engine's GEMM, sibling projections stacked into
one (`models/hf_linear.py`), as the native layers do. Everything above the model
(scheduling, prefix caching, sampling) is the engine's own. What it cannot run is
refused when the config is read, before any weight.

The same idea as vLLM's Transformers backend; its attention function and checks are
written for this engine's step context."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sarathi_rt.ops._registry import KERNELS
from sarathi_rt.ops.attention import check_head_dim, run_attention

from ..config import ModelConfig
from ..context import StepContext
from ..hf_linear import adopt_linears
from ..parallel import ParallelLayout
from ..registry import Family, register_family

if TYPE_CHECKING:
    from sarathi_rt.ops.kv_cache import KVCache

ATTENTION = "sarathi_rt"
# Layer kinds whose K/V the paged cache holds; any other (mamba, conv, linear
# attention) keeps a recurrent state the engine has nowhere to put.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass
class _Step:
    """The step every attention layer of one model reads (set by the model's forward)."""

    ctx: StepContext | None = None


@dataclass
class _LayerKV:
    """What one HF attention module attends with: its cache layer and its model's step."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    step: _Step


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, heads, tokens, head_dim], key/value
    [1, kv_heads, tokens, head_dim]; returns [1, tokens, heads, head_dim]. The mask is
    None (no mask function is registered for this implementation): causality within the
    step and across the cache comes from the step's cu_seqlens_q / seqlens_k."""
    layer: _LayerKV | None = getattr(module, "_sarathi_rt_kv", None)
    if layer is None or layer.step.ctx is None:
        raise RuntimeError("no KV cache bound or no step running: call model.bind_kv_cache(cache) and run a step")
    # A sliding window and a logit soft cap are the op's own arguments (each window has
    # its plan: read_config gives the model config the layers' windows). What else
    # changes the scores is refused (read_config catches the known cases first).
    unsupported = [name for name in ("s_aux", "sinks", "position_bias") if kwargs.get(name) is not None]
    if unsupported or kwargs.get("is_causal") is False:
        raise ValueError(f"{type(module).__name__} asks for {unsupported or 'bidirectional attention'}, which "
                         "ops.hybrid_attention does not implement")
    if not query.dtype == key.dtype == value.dtype == layer.k_cache.dtype:
        raise TypeError(f"{type(module).__name__} passes q/k/v as {query.dtype}/{key.dtype}/{value.dtype} but the "
                        f"KV cache holds {layer.k_cache.dtype}")
    ctx = layer.step.ctx
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or 0
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    # The op's unchecked entry points, as the native layers use them: the step's tensors
    # were checked when its plan was built, and bind_kv_cache checked that the cache's
    # heads, head_dim, dtype and device are this model's.
    KERNELS.write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), layer.k_cache, layer.v_cache,
                     ctx.slot_mapping, sync_check=False)
    q = query[0].transpose(0, 1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    run_attention(ctx.plan_for(window), q.contiguous(), layer.k_cache, layer.v_cache, ctx.cu_seqlens_q,
                  ctx.seqlens_k, ctx.block_tables, query.shape[-1] ** -0.5 if scale is None else float(scale), out,
                  window=window, softcap=float(kwargs.get("softcap") or 0.0))
    return out.unsqueeze(0), None


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that call the attention interface, in layer order: transformers'
    attention modules carry their `layer_idx` and the `scaling` they pass."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    return sorted(found, key=lambda m: m.layer_idx)


def _transformers() -> Any:
    """transformers (an optional dependency), with this backend's attention registered."""
    try:
        import transformers
    except ImportError:
        raise ValueError("this architecture has no native family and runs through transformers, which is not "
                         "installed (pip install transformers)") from None
    # Registering again replaces the entry with the same function: harmless.
    transformers.AttentionInterface.register(ATTENTION, _attention)
    return transformers


def _model_class(transformers: Any, hf_config: Any, path: Path) -> type:
    """The transformers class the config's first architecture names, or the one its
    auto_map ships in the directory (read_config has checked that it is trusted)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = hf_config.architectures[0]
    cls = getattr(transformers, arch, None)
    if cls is not None:
        if arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            raise ValueError(f"architecture {arch!r} is not a causal language model")
        return cls
    auto_map = getattr(hf_config, "auto_map", None) or {}
    if "AutoModelForCausalLM" not in auto_map:
        raise ValueError(f"architecture {arch!r} is unknown to transformers {transformers.__version__} and the "
                         "checkpoint ships no AutoModelForCausalLM code (auto_map)")
    return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(path))


def read_config(path: Path, trust_remote_code: bool = False) -> ModelConfig:
    """The engine's view of a checkpoint transformers runs: the KV cache's shape, the
    vocabulary, the context length and the eos ids, with the transformers config kept
    for building the model. Everything this backend cannot run raises ValueError here,
    before any weight is read."""
    raw = json.loads((path / "config.json").read_text())
    if not raw.get("architectures"):
        raise ValueError(f"{path / 'config.json'} names no `architectures`: the transformers backend needs the "
                         "model class to build")
    transformers = _transformers()
    # Code in the directory runs only when trusted; a class transformers has is its own.
    if raw.get("auto_map") and not trust_remote_code and not hasattr(transformers, raw["architectures"][0]):
        raise ValueError(f"architecture {raw['architectures'][0]!r} needs the modelling code in the checkpoint "
                         f"directory (auto_map {raw['auto_map']}); pass trust_remote_code=True to run it")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:  # an unknown model_type, or remote code not trusted
        raise ValueError(f"transformers cannot read {path / 'config.json'}: {exc}") from exc
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(f"{raw['architectures'][0]} is an encoder-decoder model; sarathi_rt runs decoders only")
    cls = _model_class(transformers, hf_config, path)
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(f"{cls.__name__} computes attention in its own code rather than through transformers' "
                         "AttentionInterface, so the paged KV cache cannot serve it")
    text = hf_config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES
    if kinds:
        raise ValueError(f"{cls.__name__} has {sorted(kinds)} layers, which this backend does not run (recurrent "
                         "and convolutional layers keep state outside the KV cache)")
    with torch.device("meta"):  # shapes only: no memory, no weights read
        meta = cls._from_config(hf_config, attn_implementation=ATTENTION)
    modules = _attention_modules(meta)
    if len(modules) != text.num_hidden_layers:
        raise ValueError(f"{cls.__name__} has {len(modules)} attention layers among {text.num_hidden_layers} "
                         "layers: the others keep state outside the KV cache")
    if any(getattr(m, "is_causal", True) is False for m in modules):
        raise ValueError(f"{cls.__name__} attends bidirectionally; ops.hybrid_attention is causal")
    if any(hasattr(m, "sinks") for m in modules):
        raise ValueError(f"{cls.__name__} adds attention sinks to its scores, which ops.hybrid_attention does "
                         "not implement")
    # Each layer's sliding window, as its module applies it: the config's on its
    # "sliding_attention" layers (every layer where it lists no kinds, as Mistral), or the
    # module's own attribute. The model config holds one window and which layers use it.
    layer_types = getattr(text, "layer_types", None)
    config_window = getattr(text, "sliding_window", None)
    windows = [getattr(m, "sliding_window", None) or
               (config_window if config_window and (not layer_types or layer_types[i] == "sliding_attention") else 0)
               for i, m in enumerate(modules)]
    if len(set(windows) - {0}) > 1:
        raise ValueError(f"{cls.__name__}'s layers use several sliding windows {sorted(set(windows) - {0})}; the "
                         "model config holds one")
    heads = text.num_attention_heads
    # The KV cache's shape from what the attention modules pass on, not from config
    # fields whose names and defaults differ by model (GPT-NeoX ignores num_key_value_heads).
    def head_size(m: nn.Module) -> int:
        return (getattr(m, "head_dim", None) or getattr(m, "qk_head_dim", None) or getattr(m, "head_size", None)
                or text.hidden_size // heads)

    if any(getattr(m, "v_head_dim", None) not in (None, head_size(m)) for m in modules):
        raise ValueError(f"{cls.__name__}'s values and keys differ in head size (multi-head latent attention); "
                         "the paged KV cache holds one head size for both")
    shapes = {(heads // getattr(m, "num_key_value_groups", 1), head_size(m)) for m in modules}
    if len(shapes) != 1:
        raise ValueError(f"{cls.__name__}'s layers differ in (KV heads, head_dim): {sorted(shapes)}; the paged "
                         "KV cache holds one shape")
    ((kv_heads, head_dim),) = shapes
    window = max(windows)
    eos = raw.get("eos_token_id")
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ModelConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        num_hidden_layers=text.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=text.max_position_embeddings,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)), model_type=FAMILY_NAME,
        eos_token_ids=eos_ids, sliding_window=window or None,
        layer_types=tuple("sliding_attention" if w else "full_attention" for w in windows) if window else None,
        attn_logit_softcapping=getattr(text, "attn_logit_softcapping", None), hf_config=hf_config)


class TransformersCausalLM(nn.Module):
    """The engine's CausalLM over a transformers model (built by `load_weights`). One
    stage only: transformers' layers know no tensor or pipeline split.

    forward runs the whole HF model, its head included, on the rows that sample
    (`logits_to_keep`), so model-specific logit scaling and capping stay transformers'
    own; it hands those logits on as its "hidden" and compute_logits passes them on."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", layout: ParallelLayout | None = None) -> None:
        super().__init__()
        layout = layout or ParallelLayout()
        if layout.tp_size > 1 or layout.layer_start > 0 or layout.layer_end not in (None, config.num_hidden_layers):
            raise ValueError("the transformers backend runs the whole model on one worker: no tensor or "
                             "pipeline parallelism")
        if config.hf_config is None:
            raise ValueError("the transformers backend needs the model's transformers config (read_config)")
        check_head_dim(config.head_dim, device)  # before transformers builds any weight
        self.config = config
        self.dtype = dtype
        self.shard = layout.bind(config)
        self._device = torch.device(device)
        self._step = _Step()
        self.hf: nn.Module | None = None

    @property
    def device(self) -> torch.device:
        return self._device

    def _model(self) -> nn.Module:
        if self.hf is None:
            raise RuntimeError("no weights loaded: build this model with load_model")
        return self.hf

    def timed_regions(self) -> Iterator[tuple[str, nn.Module]]:
        """Every nn.Linear, and every attention module (its projections timed apart)."""
        attention = set(map(id, _attention_modules(self._model())))
        for module in self._model().modules():
            if isinstance(module, nn.Linear):
                yield "linear", module
            elif id(module) in attention:
                yield "attention", module

    def bind_kv_cache(self, cache: KVCache) -> None:
        """Give every attention module its cache layer (cache layer j = layer_idx j)."""
        shape = cache.shape
        modules = _attention_modules(self._model())
        if shape.num_layers != len(modules):
            raise ValueError(f"cache has {shape.num_layers} layers but the model has {len(modules)} attention layers")
        if (shape.num_kv_heads, shape.head_dim) != (self.shard.num_kv_heads, self.shard.head_dim):
            raise ValueError(f"cache holds {shape.num_kv_heads} KV heads of dim {shape.head_dim} but the model has "
                             f"{self.shard.num_kv_heads} of dim {self.shard.head_dim}")
        for j, module in enumerate(modules):
            k_cache, v_cache = cache.layer(j)
            if k_cache.dtype != self.dtype or k_cache.device != self.device:
                raise ValueError(f"cache is {k_cache.dtype} on {k_cache.device} but the model is {self.dtype} "
                                 f"on {self.device}")
            module._sarathi_rt_kv = _LayerKV(k_cache, v_cache, self._step)

    @torch.inference_mode()
    def forward(self, ctx: StepContext, input_ids: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor | None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits of the rows in ctx.logits_indices, None): see the class."""
        if input_ids is None:
            raise ValueError("input_ids is required: the transformers backend runs the whole model")
        self._step.ctx = ctx
        try:
            out = self._model()(input_ids=input_ids.unsqueeze(0), position_ids=ctx.positions.unsqueeze(0),
                                use_cache=False, logits_to_keep=ctx.logits_indices)
        finally:
            self._step.ctx = None
        return out.logits[0], None

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                       ctx: StepContext) -> torch.Tensor:
        """forward's logits, as float32."""
        return hidden.float()


def load_weights(model: TransformersCausalLM, path: Path) -> None:
    """Build the transformers model from `path` in the model's dtype and on its device.
    transformers 5 builds the modules on the meta device and materialises each weight
    once, in the target dtype, so the weights are never held twice."""
    transformers = _transformers()
    hf_config = model.config.hf_config
    cls = _model_class(transformers, hf_config, path)
    net = cls.from_pretrained(path, config=hf_config, dtype=model.dtype, device_map=model.device,
                              attn_implementation=ATTENTION)
    adopt_linears(net)
    model.hf = net.eval()


FAMILY_NAME = "transformers"
register_family(Family(name=FAMILY_NAME, architectures=(), model_class=TransformersCausalLM, read_config=read_config,
                       load_weights=load_weights))

"""The model's shape, read from a Hugging Face `config.json` (transformers 4.x and 5.x
spellings) or given directly for the random-weight presets."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sarathi_rt.config.tree import MODEL_IMPLS
from sarathi_rt.utils.checks import positive_int

from .registry import fallback_family, family_for_hf, get_family, has_native_family


@dataclass(frozen=True)
class ModelConfig:
    """A LLaMA-family decoder. `rope_scaling` is None or the HF dict (rope_type "llama3",
    "linear" or "default"); `eos_token_ids` lists every id that ends generation; `model_type`
    names its family in `registry`. `hf_config` is the transformers config of a model the
    fallback family runs (None for the native families, which need only the fields
    above and below).

    Attention options, all off by default: `sliding_window` (keys a query sees, its own
    included) on the layers `layer_types` marks "sliding_attention" (HF's spelling; None =
    every layer), the rest "full_attention" (Gemma's alternating local and global
    layers); `attn_logit_softcapping` (Gemma 2: logits = cap * tanh(logits / cap));
    `query_pre_attn_scalar` (Gemma: scale = query_pre_attn_scalar ** -0.5 instead of
    head_dim ** -0.5); `final_logit_softcapping` (Gemma 2: the same cap on the output
    logits); `rope_local_theta` (Gemma 3: the rope base of the sliding-window layers,
    which `rope_scaling` leaves alone; None: rope_theta). A family's model reads the ones
    it has."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    eos_token_ids: tuple[int, ...] = ()
    initializer_range: float = 0.02
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attn_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    hf_config: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                                 f"num_attention_heads ({self.num_attention_heads}) when head_dim is unset")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        get_family(self.model_type)  # a registered family, or a ValueError naming them
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("default", "llama3", "linear"):
                raise ValueError(f"rope_scaling type must be 'default', 'llama3' or 'linear', got {kind!r}")
        self._check_attention_options()
        bad = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"eos_token_ids {bad} are outside the vocabulary (vocab_size={self.vocab_size})")

    def _check_attention_options(self) -> None:
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ValueError(f"sliding_window must be None or a positive int, got {window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types must name all {self.num_hidden_layers} layers, "
                                 f"got {len(self.layer_types)}")
            unknown = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
            if unknown:
                raise ValueError(f"layer_types must be 'sliding_attention' or 'full_attention', got {unknown}")
        for name in ("attn_logit_softcapping", "query_pre_attn_scalar", "final_logit_softcapping",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")

    def layer_window(self, layer: int) -> int:
        """The sliding window of layer `layer` (0 = full attention), as the attention op takes it."""
        if self.sliding_window is None:
            return 0
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return 0

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax (and the soft cap)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def qk_norm(self) -> bool:
        """Whether q and k pass a per-head RMSNorm before rotary (a fact of the family)."""
        return get_family(self.model_type).qk_norm

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        family = family_for_hf(d.get("architectures"), d.get("model_type"))
        if family.normalize_hf is not None:
            d = family.normalize_hf(d)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {d['hidden_act']!r}")
        window = d.get("sliding_window")
        if not (window and (d.get("use_sliding_window") or family.always_sliding)):
            window = None
        layer_types = d.get("layer_types")
        max_window_layers = d.get("max_window_layers", family.max_window_layers)
        if window is not None and layer_types is None and max_window_layers is not None:
            # Qwen2's spelling: the layers from max_window_layers on slide, those before attend fully.
            layer_types = ["sliding_attention" if i >= max_window_layers else "full_attention"
                           for i in range(d["num_hidden_layers"])]
        # transformers 5 folds rope_theta/rope_scaling into rope_parameters.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        attention_bias = bool(d.get("attention_bias", False))
        qkv_bias, o_bias = family.fixed_bias or (attention_bias, attention_bias)
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"), rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=None if kind == "default" else rope,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)), model_type=family.name, eos_token_ids=eos_ids,
            initializer_range=d.get("initializer_range", 0.02), sliding_window=window,
            layer_types=None if layer_types is None else tuple(layer_types),
            attn_logit_softcapping=d.get("attn_logit_softcapping"), query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            final_logit_softcapping=d.get("final_logit_softcapping"), rope_local_theta=d.get("rope_local_base_freq"))

    @classmethod
    def from_pretrained(cls, path: str | Path, *, model_impl: str = "auto",
                        trust_remote_code: bool = False) -> ModelConfig:
        """Read `path/config.json`, plus the eos ids of `generation_config.json` when
        present. An architecture no native family names (or any, with
        model_impl="transformers") is read by the fallback family, which runs code from
        the checkpoint directory only with trust_remote_code=True."""
        path = Path(path)
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {list(MODEL_IMPLS)}, got {model_impl!r}")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        d = json.loads(config_file.read_text())
        fallback = fallback_family()
        native = has_native_family(d.get("architectures"), d.get("model_type"))
        if fallback is not None and (model_impl == "transformers" or (model_impl == "auto" and not native)):
            return fallback.read_config(path, trust_remote_code)
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            if gen_eos is not None:
                d = {**d, "eos_token_id": gen_eos}
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers config dict describing the same model (for saving presets)."""
        family = get_family(self.model_type)
        d: dict[str, Any] = {
            "architectures": [family.architectures[0]], "model_type": self.model_type, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "mlp_bias": self.mlp_bias,
            "initializer_range": self.initializer_range,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else
            (self.eos_token_ids[0] if self.eos_token_ids else None),
        }
        if family.fixed_bias is None:
            d["attention_bias"] = self.qkv_bias
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = True
            if self.layer_types is not None:
                d["layer_types"] = list(self.layer_types)
            elif family.max_window_layers is not None:
                d["max_window_layers"] = 0  # every layer slides, whatever the family's default says
        for name in ("attn_logit_softcapping", "query_pre_attn_scalar", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        if self.rope_local_theta is not None:
            d["rope_local_base_freq"] = self.rope_local_theta
        return d

"""Model families by name, so a checkpoint's own words (a Hugging Face config's
`architectures` and `model_type`, a GGUF file's `general.architecture`) pick the model
class and the per-family facts its loaders need.

A leaf module: each family registers itself from its own module under `families/`, and
the config and loaders look names up here, so neither imports the other (the package's
`__init__` imports every built-in family before anything can build a config)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Family:
    """One architecture family. `name` is its Hugging Face model_type, which
    ModelConfig.model_type holds; `architectures` are the HF class names that mean it
    (the first is written when a config is saved); `gguf_architecture` is its GGUF
    `general.architecture` (None: not loaded from GGUF). `model_class` builds one stage
    of the model: (config, dtype, device, layout).

    `fixed_bias` is (q/k/v carry a bias, o_proj carries a bias) when the family fixes it
    rather than the config's `attention_bias` (Qwen2 always biases q/k/v, never o).
    `gguf_rope_permuted`: llama.cpp's converter interleaved the q/k rows' rotary halves.
    `always_sliding`: a config's `sliding_window` applies without `use_sliding_window`.
    `max_window_layers`: the family's HF default for the config field of that name (the
    layers before it attend fully when the config lists no `layer_types`), used when a
    config leaves it out. `qk_norm`: q and k pass a per-head RMSNorm (weight of size
    head_dim) before rotary (Qwen3); the HF tensors are `self_attn.q_norm` / `k_norm`.
    `normalize_hf` rewrites the family's config.json dict into the keys and spellings
    ModelConfig.from_hf_dict reads (its transformers class defaults filled in), raising
    ValueError for what the family's model cannot run. `layer_tensors` ((config) ->
    {name within a layer: shape}) lists the tensors each layer holds beyond the LLaMA
    layout's; each loads whole into the layer's parameter of that name.

    `read_config` marks the fallback family (at most one): it runs any HF checkpoint
    whose architectures no other family names, reading the checkpoint directory itself
    ((path, trust_remote_code) -> ModelConfig), and `load_weights` ((model, path)) fills
    its model in place of the LLaMA loader."""

    name: str
    architectures: tuple[str, ...]
    # Builds a models.interface.CausalLM (not named: the interface imports the config,
    # which imports this module).
    model_class: Callable[..., Any]
    gguf_architecture: str | None = None
    fixed_bias: tuple[bool, bool] | None = None
    gguf_rope_permuted: bool = False
    always_sliding: bool = False
    max_window_layers: int | None = None
    qk_norm: bool = False
    normalize_hf: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    layer_tensors: Callable[..., dict[str, tuple[int, ...]]] | None = None
    read_config: Callable[..., Any] | None = None
    load_weights: Callable[..., None] | None = None


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Make `family` available under its name, HF architectures and GGUF architecture;
    none of them may be taken already."""
    if not family.name or not (family.architectures or family.read_config is not None):
        raise ValueError(f"family {family.name!r} needs a name and at least one HF architecture")
    if family.read_config is not None and fallback_family() is not None:
        raise ValueError(f"family {family.name!r}: the fallback family is {fallback_family().name!r} already")
    for other in _FAMILIES.values():
        taken = [family.name] if family.name == other.name else []
        taken += sorted(set(family.architectures) & set(other.architectures))
        if family.gguf_architecture is not None and family.gguf_architecture == other.gguf_architecture:
            taken.append(family.gguf_architecture)
        if taken:
            raise ValueError(f"family {family.name!r}: {taken} already registered by family {other.name!r}")
    _FAMILIES[family.name] = family
    return family


def available_architectures() -> list[str]:
    """Every registered HF architecture name."""
    return sorted(a for f in _FAMILIES.values() for a in f.architectures)


def get_family(model_type: str) -> Family:
    """The family whose HF model_type is `model_type`."""
    try:
        return _FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type must be one of {sorted(_FAMILIES)}, got {model_type!r}") from None


def family_for_hf(architectures: list[str] | None, model_type: str | None) -> Family:
    """The family a HF config names: its first registered `architectures` entry (the
    more specific word), else its `model_type`."""
    for arch in architectures or ():
        family = next((f for f in _FAMILIES.values() if arch in f.architectures), None)
        if family is not None:
            return family
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]
    raise ValueError(f"unsupported architecture {architectures!r} (model_type {model_type!r}): sarathi_rt runs "
                     f"the architectures {available_architectures()} (model_type {sorted(_FAMILIES)})")


def fallback_family() -> Family | None:
    """The family that runs HF architectures no other family names (None: none registered)."""
    return next((f for f in _FAMILIES.values() if f.read_config is not None), None)


def has_native_family(architectures: list[str] | None, model_type: str | None) -> bool:
    """Whether a family other than the fallback names this HF config."""
    try:
        return family_for_hf(architectures, model_type).read_config is None
    except ValueError:
        return False


def family_for_gguf(architecture: str | None) -> Family:
    """The family of a GGUF file's `general.architecture`."""
    family = next((f for f in _FAMILIES.values() if f.gguf_architecture == architecture), None)
    if family is None:
        known = sorted(f.gguf_architecture for f in _FAMILIES.values() if f.gguf_architecture is not None)
        raise ValueError(f"unsupported architecture {architecture!r}; sarathi_rt loads GGUF files of {known}")
    return family

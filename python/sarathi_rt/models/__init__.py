"""LLaMA-family models: config parsing (Hugging Face directories and GGUF files, read by
`gguf_file`), the families by name (`registry`, one module each under `families/`),
presets with random weights, the model itself on `sarathi_rt.ops` (behind the
`interface` the engine talks to), weight loading with its tensor-parallel layout, and
models fetched by name. Any other decoder transformers builds runs through the fallback
family `families/transformers_backend`, on transformers' layers and our attention."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sarathi_rt.config.tree import ModelOptions
from sarathi_rt.utils.dtypes import parse_dtype
from sarathi_rt.models.gguf_file import open_gguf

from .config import ModelConfig
from . import families  # noqa: F401  registers the built-in families before the presets build configs
from .context import StepContext
from .gguf import gguf_config, load_gguf
from .hub import NAMED_MODELS, cache_dir, named_model_path
from .interface import CausalLM
from .llama import LlamaForCausalLM
from .loader import hf_tensor_shapes, init_random, load_checkpoint
from .parallel import ParallelLayout
from .presets import PRESETS, get_preset
from .registry import Family, available_architectures, get_family, register_family


def resolve_model_path(model: str | Path) -> Path | None:
    """Where `model`'s weights are: a HF directory or a GGUF file as given, a named
    model's GGUF in the cache (fetched on first use), or None for a preset."""
    path = Path(model)
    if path.is_dir() or path.is_file():
        return path
    name = str(model)
    if name in NAMED_MODELS:
        return named_model_path(name)
    if name in PRESETS:
        return None
    if path.suffix == ".gguf":
        raise ValueError(f"model file {name!r} does not exist")
    raise ValueError(f"model must be a HF model directory, a .gguf file, a named model {sorted(NAMED_MODELS)} "
                     f"or a preset {sorted(PRESETS)}, got {name!r}")


@dataclass(frozen=True)
class ResolvedModel:
    """A model looked up once: `name` as given, where its weights are (`path`; None for
    a preset, whose weights are seeded random ones) and its config. Picklable, so an
    engine resolves its model once and hands it to its workers, in-process or spawned."""

    name: str
    path: Path | None
    config: ModelConfig

    @property
    def family(self) -> Family:
        """The registry's entry for this model (its name is config.model_type)."""
        return get_family(self.config.model_type)


def resolve_model(model: str | Path, *, model_impl: str = "auto", trust_remote_code: bool = False) -> ResolvedModel:
    """`model` (a HF directory, a GGUF file, a named model or a preset) found and its
    config read; a bad or unsupported model raises ValueError naming it. A HF directory
    whose architecture no native family runs (or any, with model_impl="transformers")
    runs through transformers (`families/transformers_backend`); trust_remote_code=True
    lets it run modelling code shipped in the directory."""
    path = resolve_model_path(model)
    if model_impl == "transformers" and (path is None or not path.is_dir()):
        raise ValueError(f"model_impl='transformers' runs HF model directories only, got {str(model)!r}")
    if path is None:
        config = get_preset(str(model))
    elif path.is_dir():
        config = ModelConfig.from_pretrained(path, model_impl=model_impl, trust_remote_code=trust_remote_code)
    else:
        config = gguf_config(open_gguf(path))
    return ResolvedModel(str(model), path, config)


def resolve_configured(options: ModelOptions) -> ResolvedModel:
    """resolve_model as a config's model options ask: its model, model_impl and
    trust_remote_code (the one place an engine looks its model up)."""
    return resolve_model(options.model, model_impl=options.model_impl, trust_remote_code=options.trust_remote_code)


def load_model(model: str | Path | ResolvedModel, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", layout: ParallelLayout | None = None,
               seed: int = 0) -> CausalLM:
    """Build one stage of `model` (resolved already, or a HF directory, a GGUF file, a
    named model or a preset) as its family's model class and fill its weights: from the
    checkpoint, or seeded random ones for a preset."""
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
    net = resolved.family.model_class(resolved.config, parse_dtype(dtype), device, layout)
    path = resolved.path
    if path is None:
        init_random(net, seed)
    elif path.is_dir():
        (resolved.family.load_weights or load_checkpoint)(net, path)
    else:
        load_gguf(net, open_gguf(path))
    return net.eval()


__all__ = ["CausalLM", "Family", "LlamaForCausalLM", "ModelConfig", "NAMED_MODELS", "PRESETS", "ParallelLayout",
           "ResolvedModel", "StepContext", "available_architectures", "cache_dir", "get_family", "get_preset",
           "hf_tensor_shapes", "init_random", "load_checkpoint", "load_model", "parse_dtype", "register_family",
           "resolve_configured", "resolve_model", "resolve_model_path"]

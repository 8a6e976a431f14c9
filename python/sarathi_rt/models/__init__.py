"""LLaMA-family models: config parsing, presets, the model, weight loading."""
from __future__ import annotations

from pathlib import Path

import torch

from sarathi_rt.dtypes import parse_dtype

from .config import ModelConfig
from .context import StepContext
from .llama import LlamaForCausalLM
from .loader import hf_tensor_shapes, init_random, load_checkpoint
from .parallel import ParallelLayout
from .presets import PRESETS, get_preset


def resolve_config(model: str | Path) -> tuple[ModelConfig, Path | None]:
    """A model directory's config (and the directory), or a preset's (and None)."""
    path = Path(model)
    if path.is_dir():
        return ModelConfig.from_pretrained(path), path
    return get_preset(str(model)), None


def load_model(model: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               layout: ParallelLayout | None = None, seed: int = 0) -> LlamaForCausalLM:
    """Build one stage of `model` (a HF directory or a preset name) and fill its weights:
    from the checkpoint, or seeded random ones for a preset."""
    config, path = resolve_config(model)
    net = LlamaForCausalLM(config, parse_dtype(dtype), device, layout)
    if path is None:
        init_random(net, seed)
    else:
        load_checkpoint(net, path)
    return net.eval()


__all__ = ["LlamaForCausalLM", "ModelConfig", "PRESETS", "ParallelLayout", "StepContext", "get_preset",
           "hf_tensor_shapes", "init_random", "load_checkpoint", "load_model", "parse_dtype", "resolve_config"]

"""Fill a model's (fused, sharded) parameters from Hugging Face tensor names: a local
safetensors checkpoint (one file or a sharded index), or seeded random weights."""
from __future__ import annotations

import json
import re
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from .config import ModelConfig
from .llama import LlamaForCausalLM

# A reader returns the tensor under an HF name, restricted to `index` (a slice tuple).
Reader = Callable[[str, tuple[slice, ...]], torch.Tensor]

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_SKIPPED = re.compile(r".*rotary_emb\.inv_freq$")
ALL = slice(None)


def _targets(model: LlamaForCausalLM, name: str) -> list[tuple[torch.Tensor, tuple[slice, ...]]]:
    """(destination view, source index) pairs for one HF tensor; empty when this
    stage/rank has no use for it."""
    shard, cfg = model.shard, model.config
    if name == "model.embed_tokens.weight":
        return [(model.embed_tokens, (shard.vocab_slice(),))] if model.embed_tokens is not None else []
    if name == "lm_head.weight":
        tied = cfg.tie_word_embeddings
        return [(model.lm_head, (shard.vocab_slice(),))] if model.lm_head is not None and not tied else []
    if name == "model.norm.weight":
        return [(model.norm.weight, (ALL,))] if model.norm is not None else []
    m = _LAYER.fullmatch(name)
    if m is None:
        raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
    if m.group(1) not in model.layers:
        return []
    layer, rest = model.layers[m.group(1)], m.group(2)
    attn, mlp = layer.self_attn, layer.mlp
    simple = {"input_layernorm.weight": layer.input_layernorm.weight,
              "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
              "self_attn.o_proj.bias": attn.o_proj.bias, "mlp.down_proj.bias": mlp.down_proj.bias}
    if rest in simple and simple[rest] is not None:
        return [(simple[rest], (ALL,))]
    if rest == "self_attn.o_proj.weight":
        return [(attn.o_proj.weight, (ALL, shard.row_slice("o")))]
    if rest == "mlp.down_proj.weight":
        return [(mlp.down_proj.weight, (ALL, shard.row_slice("down")))]
    fused = re.fullmatch(r"(self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)", rest)
    if fused is not None:
        kind, what = fused.group(2), fused.group(3)
        proj = attn.qkv_proj if kind in "qkv" else mlp.gate_up_proj
        dest = getattr(proj, what)
        if dest is not None:
            offsets = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size,
                       "gate": 0, "up": shard.intermediate}
            rows = shard.column_slice(kind)
            start = offsets[kind]
            return [(dest[start:start + rows.stop - rows.start], (rows,))]
    raise ValueError(f"tensor {name!r} has no place in a {cfg.model_type} model with this config")


def _load(model: LlamaForCausalLM, names: list[str], read: Reader) -> None:
    present = set(names)
    missing = [n for n, _ in hf_tensor_shapes(model.config) if n not in present and _targets(model, n)]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors this model needs, e.g. {missing[:4]}")
    for name in names:
        if _SKIPPED.fullmatch(name):
            continue
        for dest, index in _targets(model, name):
            src = read(name, index)
            if src.shape != dest.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dest.shape)} "
                                 "(does config.json match the weights?)")
            with torch.no_grad():
                dest.copy_(src)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = sorted({path / f for f in weight_map.values()})
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names missing shard files: {absent}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"model directory {str(path)!r} has neither model.safetensors nor "
                     "model.safetensors.index.json (only safetensors checkpoints are supported)")


def load_checkpoint(model: LlamaForCausalLM, path: str | Path) -> None:
    """Load a local HF safetensors checkpoint; reads only this stage's and rank's slices."""
    with ExitStack() as stack:
        handles = {}
        for file in _checkpoint_files(Path(path)):
            f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            handles.update({name: f for name in f.keys()})

        def read(name: str, index: tuple[slice, ...]) -> torch.Tensor:
            return handles[name].get_slice(name)[index]

        _load(model, sorted(handles), read)


def hf_tensor_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor name and full shape a HF checkpoint of `config` holds."""
    h = config.hidden_size
    yield "model.embed_tokens.weight", (config.vocab_size, h)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h)
    yield "model.norm.weight", (h,)
    sizes = {"q": config.q_size, "k": config.kv_size, "v": config.kv_size}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        for part, rows in sizes.items():
            yield p + f"self_attn.{part}_proj.weight", (rows, h)
            if config.qkv_bias:
                yield p + f"self_attn.{part}_proj.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, config.q_size)
        if config.o_bias:
            yield p + "self_attn.o_proj.bias", (h,)
        for part in ("gate", "up"):
            yield p + f"mlp.{part}_proj.weight", (config.intermediate_size, h)
            if config.mlp_bias:
                yield p + f"mlp.{part}_proj.bias", (config.intermediate_size,)
        yield p + "mlp.down_proj.weight", (h, config.intermediate_size)
        if config.mlp_bias:
            yield p + "mlp.down_proj.bias", (h,)


def init_random(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Seeded random weights (normal(0, initializer_range); norms 1, biases 0). Each
    tensor is drawn whole from a generator keyed by (seed, name), then sliced, so every
    stage and rank sees the same model."""
    shapes = dict(hf_tensor_shapes(model.config))
    device = next(model.parameters()).device
    std = model.config.initializer_range

    def read(name: str, index: tuple[slice, ...]) -> torch.Tensor:
        shape = shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=device)[index]
        if name.endswith(".bias"):
            return torch.zeros(shape, device=device)[index]
        gen = torch.Generator(device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)[index]

    _load(model, list(shapes), read)

"""Fill a model's (fused, sharded) parameters from Hugging Face tensor names: a local
safetensors checkpoint (one file or a sharded index), or seeded random weights."""
from __future__ import annotations

import json
import re
import struct
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import torch
from safetensors import safe_open

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .registry import get_family

# A reader fills `dest` with the tensor under an HF name restricted to `index` (a slice
# tuple), raising ValueError when the shapes differ. Writing into the parameter itself
# matters: a copy through a temporary first-touches twice as many fresh pages, which
# costs more than the read itself.
Reader = Callable[[str, tuple[slice, ...], torch.Tensor], None]

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
    if attn.q_norm is not None and attn.k_norm is not None:
        simple.update({"self_attn.q_norm.weight": attn.q_norm.weight, "self_attn.k_norm.weight": attn.k_norm.weight})
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
    if rest in _layer_tensors(cfg):  # the family's own per-layer tensors (Gemma's extra norms)
        return [(layer.get_parameter(rest), (ALL,))]
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
            with torch.no_grad():
                read(name, index, dest)


def _check_shape(name: str, shape: tuple[int, ...], dest: torch.Tensor) -> None:
    if tuple(shape) != tuple(dest.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(shape)}, expected {tuple(dest.shape)} "
                         "(does config.json match the weights?)")


def _sliced_shape(shape: list[int], index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape)) + tuple(shape[len(index):])


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class _SafetensorsFile:
    """Reads row ranges of a tensor straight into their destination with one read()
    (the page cache copies into the parameter); other slices go through safetensors."""

    def __init__(self, path: Path, stack: ExitStack) -> None:
        self.path, self.stack = path, stack
        self.file: BinaryIO = stack.enter_context(open(path, "rb", buffering=0))
        try:
            (size,) = struct.unpack("<Q", self.file.read(8))
            header = json.loads(self.file.read(size))
        except (struct.error, ValueError) as exc:
            raise ValueError(f"{path} is not a safetensors file ({exc})") from None
        self.header = {k: v for k, v in header.items() if k != "__metadata__"}
        self.data_start = 8 + size
        file_size = self.file.seek(0, 2)
        for name, meta in self.header.items():
            if self.data_start + meta["data_offsets"][1] > file_size:
                raise ValueError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
        self._lazy: object | None = None

    @property
    def lazy(self) -> Any:  # safetensors' own reader, for slices that are not row ranges
        if self._lazy is None:
            self._lazy = self.stack.enter_context(safe_open(str(self.path), framework="pt", device="cpu"))
        return self._lazy

    def read(self, name: str, index: tuple[slice, ...], dest: torch.Tensor) -> None:
        meta = self.header[name]
        shape = meta["shape"]
        _check_shape(name, _sliced_shape(shape, index), dest)
        rows = index[0].indices(shape[0]) if index and shape else (0, 1, 1)
        whole_rows = rows[2] == 1 and all(s.indices(n) == (0, n, 1) for s, n in zip(index[1:], shape[1:]))
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
        if not (whole_rows and dtype == dest.dtype and dest.is_contiguous() and dest.device.type == "cpu"):
            dest.copy_(self.lazy.get_slice(name)[index])
            return
        row_bytes = dest.element_size() * (dest.numel() // max(dest.shape[0], 1) if dest.dim() else 1)
        self.file.seek(self.data_start + meta["data_offsets"][0] + rows[0] * row_bytes)
        view = memoryview(dest.view(torch.uint8).numpy() if dest.dim() else dest.view(1).view(torch.uint8).numpy())
        self.file.readinto(view)


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
        handles: dict[str, _SafetensorsFile] = {}
        for file in _checkpoint_files(Path(path)):
            f = _SafetensorsFile(file, stack)
            handles.update({name: f for name in f.header})

        def read(name: str, index: tuple[slice, ...], dest: torch.Tensor) -> None:
            handles[name].read(name, index, dest)

        _load(model, sorted(handles), read)


def _layer_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    extra = get_family(config.model_type).layer_tensors
    return {} if extra is None else extra(config)


def hf_tensor_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor name and full shape a HF checkpoint of `config` holds."""
    h = config.hidden_size
    yield "model.embed_tokens.weight", (config.vocab_size, h)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h)
    yield "model.norm.weight", (h,)
    sizes = {"q": config.q_size, "k": config.kv_size, "v": config.kv_size}
    extra = _layer_tensors(config)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        for part, rows in sizes.items():
            yield p + f"self_attn.{part}_proj.weight", (rows, h)
            if config.qkv_bias:
                yield p + f"self_attn.{part}_proj.bias", (rows,)
        if config.qk_norm:
            yield p + "self_attn.q_norm.weight", (config.head_dim,)
            yield p + "self_attn.k_norm.weight", (config.head_dim,)
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
        for name, shape in extra.items():
            yield p + name, shape


def init_random(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Seeded random weights (normal(0, initializer_range); norms 1, biases 0). Each
    tensor is drawn whole from a generator keyed by (seed, name), then sliced, so every
    stage and rank sees the same model."""
    shapes = dict(hf_tensor_shapes(model.config))
    device = next(model.parameters()).device
    std = model.config.initializer_range

    def read(name: str, index: tuple[slice, ...], dest: torch.Tensor) -> None:
        shape = shapes[name]
        _check_shape(name, _sliced_shape(list(shape), index), dest)
        if name.endswith("norm.weight"):
            dest.fill_(1.0)
        elif name.endswith(".bias"):
            dest.zero_()
        else:
            gen = torch.Generator(device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            dest.copy_(torch.empty(shape, device=device).normal_(0.0, std, generator=gen)[index])

    _load(model, list(shapes), read)

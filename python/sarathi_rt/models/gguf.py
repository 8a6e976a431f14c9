"""LLaMA-family models from GGUF files (llama.cpp's format): the config from the file's
metadata, the weights dequantized by the `gguf` package to float32 and then to the model's
dtype, read by index slices like a safetensors checkpoint so tensor-parallel ranks read
only their rows. The file's `general.architecture` picks the family (`registry`); for
families whose q/k rows llama.cpp stored permuted for its rope layout, that is undone
here by reading the rows in HF order."""
from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from sarathi_rt.models.gguf_file import GGUFFile

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .loader import _check_shape, _load
from .registry import Family, family_for_gguf

SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1})

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
# Only in the files of families with q/k norms (llama.cpp's "qwen3"): elsewhere they
# have no place.
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_config(file: GGUFFile) -> ModelConfig:
    """The model shape a LLaMA-family GGUF file's metadata describes."""
    family = _family(file)
    arch = family.gguf_architecture
    if "token_embd.weight" not in file.tensors:
        raise ValueError(f"{file.name!r} has no tensor 'token_embd.weight'")
    if "rope_freqs.weight" in file.tensors:
        raise ValueError(f"{file.name!r}: tensor 'rope_freqs.weight' (per-frequency rope scaling) is not supported")
    scaling = file.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{file.name!r}: rope scaling {scaling!r} is not supported")
    key = f"{arch}."
    heads = file.get(key + "attention.head_count")
    hidden = file.get(key + "embedding_length")
    head_dim = file.get(key + "attention.key_length", hidden // heads)
    rotary = file.get(key + "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"{file.name!r}: partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    eos = [file.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot")]
    return ModelConfig(
        vocab_size=file.tensors["token_embd.weight"].shape[0], hidden_size=hidden,
        intermediate_size=file.get(key + "feed_forward_length"), num_hidden_layers=file.get(key + "block_count"),
        num_attention_heads=heads, num_key_value_heads=file.get(key + "attention.head_count_kv", heads),
        head_dim=head_dim, rms_norm_eps=file.get(key + "attention.layer_norm_rms_epsilon"),
        rope_theta=file.get(key + "rope.freq_base", 10000.0),
        max_position_embeddings=file.get(key + "context_length"),
        tie_word_embeddings="output.weight" not in file.tensors,
        qkv_bias="blk.0.attn_q.bias" in file.tensors, o_bias="blk.0.attn_output.bias" in file.tensors,
        mlp_bias="blk.0.ffn_up.bias" in file.tensors, model_type=family.name,
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)))


def _family(file: GGUFFile) -> Family:
    try:
        return family_for_gguf(file.get("general.architecture"))
    except ValueError as e:
        raise ValueError(f"{file.name!r}: {e}") from None


def hf_name(file: GGUFFile, name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK.fullmatch(name)
    family = _family(file)
    layer = {**_LAYER, **_QK_NORMS} if family.qk_norm else _LAYER
    if m is None or m.group(2) not in layer:
        raise ValueError(f"{file.name!r}: tensor {name!r} has no place in a {family.name} model")
    return f"model.layers.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"


def _rope_rows(rows: int, heads: int) -> np.ndarray:
    """perm[i] = the GGUF row holding HF row i of a q/k projection: llama.cpp interleaves
    each head's two rotary halves, so HF row (h, half, j) sits at GGUF row (h, j, half)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def load_gguf(model: LlamaForCausalLM, file: GGUFFile) -> None:
    """Fill `model` (one stage/rank) from `file`, dequantizing only the rows it needs."""
    names = {hf_name(file, name): name for name in file.tensors}
    for name, info in file.tensors.items():
        if info.qtype not in SUPPORTED_TYPES:
            raise ValueError(f"{file.name!r}: tensor {name!r} has type {info.qtype.name}; sarathi_rt dequantizes "
                             f"{sorted(t.name for t in SUPPORTED_TYPES)}")
    cfg = model.config
    heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads} \
        if _family(file).gguf_rope_permuted else {}

    def read(name: str, index: tuple[slice, ...], dest: torch.Tensor) -> None:
        value = dequantized(name, index)
        _check_shape(name, tuple(value.shape), dest)
        dest.copy_(value)

    def dequantized(name: str, index: tuple[slice, ...]) -> torch.Tensor:
        info = file.tensors[names[name]]
        raw = file.rows(info.name)
        heads_here = next((h for proj, h in heads.items() if f".{proj}." in name), None)
        if len(info.shape) == 1:  # a norm or bias: one row, permuted element-wise
            values = quants.dequantize(np.asarray(raw), info.qtype).reshape(-1)
            if heads_here is not None:
                values = values[_rope_rows(values.shape[0], heads_here)]
            return torch.from_numpy(np.array(values, dtype=np.float32))[index]
        rows = np.arange(raw.shape[0])[index[0]]
        if heads_here is not None:
            rows = _rope_rows(raw.shape[0], heads_here)[rows]
        # take() copies just these rows, so dequantize returns a fresh, writable array
        values = quants.dequantize(np.asarray(raw.take(rows, axis=0)), info.qtype)
        return torch.from_numpy(values)[(slice(None), *index[1:])]

    _load(model, sorted(names), read)

"""Small GGUF files written with gguf.GGUFWriter, the way llama.cpp's converter lays them
out (tensor names, Q/K rows permuted for its rope, tokenizer metadata): a byte-level BPE
and a SentencePiece-style vocabulary, and tiny LLaMA models quantized to each type."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ t", "h i"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 byte symbols, one token per merge."""
    merged = [m.replace(" ", "") for m in BYTE_MERGES]
    tokens = SPECIAL + byte_alphabet() + merged
    return tokens, [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)), BYTE_MERGES


# (piece, score): the pieces a SentencePiece BPE merges up to, best (highest) score first.
SP_PIECES = [("ll", -1.0), ("\u2581h", -2.0), ("\u2581he", -3.0), ("\u2581hell", -4.0), ("\u2581hello", -5.0),
             ("\u2581w", -6.0), ("or", -7.0), ("\u2581wor", -8.0), ("ld", -9.0), ("\u2581world", -10.0)]
SP_CHARS = ["\u2581", "h", "e", "l", "o", "w", "r", "d"]


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, token types, scores): <unk> <s> </s>, 256 byte tokens, characters, pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for i, ch in enumerate(SP_CHARS):
        tokens.append(ch), types.append(1), scores.append(-100.0 - i)
    for piece, score in SP_PIECES:
        tokens.append(piece), types.append(1), scores.append(score)
    return tokens, types, scores


def add_tokenizer(w: Any, kind: str = "gpt2", pre: str | None = "smollm", add_bos: bool | None = False,
                  template: str | None = CHATML) -> list[str]:
    """Write a byte-level ('gpt2') or SentencePiece ('llama') vocabulary; returns its tokens."""
    w.add_tokenizer_model(kind)
    if kind == "llama":
        tokens, types, scores = sentencepiece_vocab()
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
        bos, eos = 1, 2
    else:
        tokens, types, merges = byte_level_vocab()
        w.add_token_merges(merges)
        bos, eos = 0, 2
        if pre is not None:
            w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    return tokens


def write_tokenizer_gguf(path: Path, **kwargs: Any) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    add_tokenizer(w, **kwargs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter layout for q/k rows: within each head, the two rotary halves
    are interleaved (row i of half 0, row i of half 1, ...)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
          "model.norm.weight": "output_norm.weight"}
_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _NAMES:
        return _NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, what = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{what}"


def write_model_gguf(path: Path, config: Any, state: dict[str, np.ndarray], qtype: Q,
                     types: dict[str, Q] | None = None, arch: str = "llama") -> dict[str, np.ndarray]:
    """Write a transformers Llama `config` + float32 `state` as llama.cpp would, 2-D
    weights in `qtype` (norms stay F32; `types` overrides by HF name, and a type numpy
    cannot quantize gets zero bytes); returns the HF-layout weights the file really
    holds (what dequantizing it gives) for building the same model in transformers.
    llama.cpp permutes q/k rows for 'llama' only."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters")
                         and config.rope_parameters else config.rope_theta)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(config.vocab_size)
    add_tokenizer(w)
    stored: dict[str, np.ndarray] = {}
    for name, value in state.items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads} \
            if arch == "llama" else {}
        head = next((h for key, h in heads.items() if f".{key}." in name), None)
        data = permute_rows(value, head) if head else value
        kind = (types or {}).get(name, qtype if value.ndim == 2 else Q.F32)
        if kind in (Q.F32, Q.F16):
            raw = data.astype(np.float16) if kind == Q.F16 else data
        elif kind in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
            raw = gguf.quants.quantize(data, kind)
        else:
            w.add_tensor(gguf_name(name), np.zeros(gguf.quant_shape_to_byte_shape(data.shape, kind), np.uint8),
                         raw_dtype=kind)
            continue
        w.add_tensor(gguf_name(name), raw, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
        back = gguf.quants.dequantize(raw.view(np.uint8) if kind not in (Q.F32, Q.F16) else raw, kind)
        back = back.reshape(value.shape).astype(np.float32)
        stored[name] = permute_rows_back(back, head) if head else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def permute_rows_back(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

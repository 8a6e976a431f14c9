"""Tiny random-weight checkpoints built and saved with transformers, and their greedy
continuations, shared by the model and engine tests (built once per test session)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

# name -> (config class, kwargs). Initialised wider than usual (std 0.2) so greedy
# choices are decided by clear margins, not by float32 rounding.
CONFIGS: dict[str, tuple[str, dict]] = {
    "llama_gqa": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)),
    "qwen2_bias_tied": ("Qwen2Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=1, vocab_size=256,
                                            tie_word_embeddings=True, eos_token_id=3)),
    "llama3_odd": ("LlamaConfig", dict(hidden_size=72, intermediate_size=100, num_hidden_layers=3,
                                       num_attention_heads=6, num_key_value_heads=3, vocab_size=301,
                                       tie_word_embeddings=True, rope_theta=500000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16})),
    "mistral_headdim": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                              vocab_size=256, sliding_window=None)),
    # A window shorter than most prompts: chunks and decodes see only their last 8 keys.
    "mistral_window": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                             sliding_window=8)),
    # Layer 0 attends fully, layer 1 through a window (Qwen2's max_window_layers): two plans a step.
    "qwen2_mixed_window": ("Qwen2Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                               use_sliding_window=True, sliding_window=6, max_window_layers=1)),
}
# The CUDA attention kernel takes head_dim 64 or 128 in float16/bfloat16.
CUDA_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama_hd64": ("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512)),
}
MAX_POSITIONS = 128


@dataclass
class HFModel:
    name: str
    path: Path
    model: object  # the transformers model, float32, eval mode
    prompts: list[list[int]]
    max_tokens: list[int]
    expected: list[list[int]]  # transformers greedy continuations (stopping at eos)


def build(name: str, root: Path, seed: int = 0) -> HFModel:
    cls_name, kwargs = {**CONFIGS, **CUDA_CONFIGS}[name]
    config = getattr(transformers, cls_name)(max_position_embeddings=MAX_POSITIONS, initializer_range=0.2,
                                             rms_norm_eps=1e-6, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config).float().eval()
    path = root / name
    model.save_pretrained(path)
    rng = random.Random(seed)
    lengths = [1, 2, 5, 7, 9, 16, 17, 23, 33, 40]
    prompts = [[rng.randrange(4, config.vocab_size) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randrange(3, 12) for _ in prompts]
    expected = [greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    return HFModel(name, path, model, prompts, max_tokens, expected)


@torch.no_grad()
def greedy(model: object, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def last_logits(model: object, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0, -1].double()

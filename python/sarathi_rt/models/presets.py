"""Named model shapes with random weights, for benchmarks and demos that need no download."""
from __future__ import annotations

from .config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                        eos_token_ids=(2,)),
    # tiny's vocabulary and width over 8 layers: a target that tiny can draft for
    # (speculative_method "draft").
    "tiny-deep": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             eos_token_ids=(2,)),
    "cpu-small": ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                             eos_token_ids=(2,)),
    # A 2-layer draft for cpu-small: its vocabulary, a quarter of its layers.
    "cpu-small-draft": ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                                   eos_token_ids=(2,)),
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                             rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
                             eos_token_ids=(128001, 128009)),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"model must be a directory with config.json or a preset "
                         f"{sorted(PRESETS)}, got {name!r}") from None

"""Qwen3: the LLaMA layout with a per-head RMSNorm on q and k before rotary, q/k/v and o
biased only when `attention_bias` says so, and head_dim set by the config. A sliding
window applies only with `use_sliding_window`, on the layers `layer_types` marks (or,
when it is absent, from `max_window_layers` on: transformers' default 28). llama.cpp
keeps the q/k rows in HF order and names the norms attn_q_norm / attn_k_norm."""
from __future__ import annotations

from ..llama import LlamaForCausalLM
from ..registry import Family, register_family

register_family(Family(name="qwen3", architectures=("Qwen3ForCausalLM",), model_class=LlamaForCausalLM,
                       gguf_architecture="qwen3", max_window_layers=28, qk_norm=True))

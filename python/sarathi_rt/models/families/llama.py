"""Llama 2/3 (and their fine-tunes): llama.cpp stores their q/k rows permuted."""
from __future__ import annotations

from ..llama import LlamaForCausalLM
from ..registry import Family, register_family

register_family(Family(name="llama", architectures=("LlamaForCausalLM",), model_class=LlamaForCausalLM,
                       gguf_architecture="llama", gguf_rope_permuted=True))

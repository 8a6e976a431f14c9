"""Mistral: the LLaMA layout with a sliding window that applies whenever the config sets
one (llama.cpp converts it as "llama", so its GGUF files load as that family)."""
from __future__ import annotations

from ..llama import LlamaForCausalLM
from ..registry import Family, register_family

register_family(Family(name="mistral", architectures=("MistralForCausalLM",), model_class=LlamaForCausalLM,
                       always_sliding=True))

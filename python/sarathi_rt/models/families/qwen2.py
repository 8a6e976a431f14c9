"""Qwen2 (and Qwen2.5): the LLaMA layout with biased q/k/v and an unbiased o_proj,
whatever `attention_bias` says; with `use_sliding_window`, the layers from
`max_window_layers` on slide (transformers' default 28 when the config leaves it out);
llama.cpp keeps its q/k rows in HF order."""
from __future__ import annotations

from ..llama import LlamaForCausalLM
from ..registry import Family, register_family

register_family(Family(name="qwen2", architectures=("Qwen2ForCausalLM",), model_class=LlamaForCausalLM,
                       gguf_architecture="qwen2", fixed_bias=(True, False), max_window_layers=28))

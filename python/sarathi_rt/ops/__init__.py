"""Torch-tensor ops backed by the C++/CUDA core (`sarathi_rt._C`): the attention work
plan built once per step (`attention_plan`) and the fused hybrid attention that runs it,
paged KV writes, tile-aligned GEMMs (`linear`, `gemm_plan`), the elementwise kernels, and
float64 references for each (`reference`). CPU and CUDA tensors share one API. The paged
KV cache's storage those ops read and write (`kv_cache`) lives here too, below the models
that bind to it and the engine that allocates it."""
from sarathi_rt.ops import reference
from sarathi_rt.ops.attention import hybrid_attention, write_kv
from sarathi_rt.ops.elementwise import argmax_rows, rms_norm, rope_cos_sin_cache, rotary_embedding, silu_and_mul
from sarathi_rt.ops.gemm_plan import GemmPlan, gemm_plan, gemm_tile_configs, gemm_tile_size
from sarathi_rt.ops.linear import linear
from sarathi_rt.ops.attention_plan import AttentionPlan, plan_attention

__all__ = ["hybrid_attention", "write_kv", "reference", "linear", "rms_norm", "rope_cos_sin_cache",
           "rotary_embedding", "silu_and_mul", "argmax_rows", "AttentionPlan", "plan_attention", "GemmPlan",
           "gemm_plan", "gemm_tile_configs", "gemm_tile_size"]

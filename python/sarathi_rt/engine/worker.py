"""One worker: a model stage, its KV cache, the model runner and the sampler."""
from __future__ import annotations

import torch

from sarathi_rt.kv_cache import KVCache, KVCacheShape
from sarathi_rt.models import ParallelLayout, load_model

from .config import EngineConfig
from .memory import auto_num_blocks
from .model_runner import ModelRunner
from .sampler import Sampler
from .step_io import StepInput, StepOutput


class Worker:
    """Holds the weights of its (tensor rank, pipeline stage) shard and the KV blocks of
    its layers; block ids are shared by every worker, so one scheduler serves them all.

    `num_kv_blocks` is what fits here (config.num_kv_blocks, or `kv_memory_fraction` of
    free memory, config.kv_memory_fraction when None). With allocate=False the cache
    waits for `allocate_kv_cache`, so that workers can agree on the smallest count."""

    def __init__(self, config: EngineConfig, layout: ParallelLayout | None = None, *,
                 kv_memory_fraction: float | None = None, allocate: bool = True) -> None:
        self.config = config
        self.model = load_model(config.model, config.dtype, config.device, layout, config.seed)
        shard = self.model.shard
        self.kv_shape = KVCacheShape(len(shard.layers), config.block_size, shard.num_kv_heads, shard.head_dim,
                                     config.dtype)
        self.max_model_len = config.model_len(self.model.config)
        fraction = config.kv_memory_fraction if kv_memory_fraction is None else kv_memory_fraction
        self.num_kv_blocks = config.num_kv_blocks or auto_num_blocks(
            self.kv_shape, config.device, config.max_num_seqs, self.max_model_len, fraction)
        self.sampler = Sampler()
        if allocate:
            self.allocate_kv_cache(self.num_kv_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if not 1 <= num_blocks <= self.num_kv_blocks:
            raise ValueError(f"num_blocks must be in [1, {self.num_kv_blocks}], got {num_blocks}")
        self.num_kv_blocks = num_blocks
        self.kv_cache = KVCache(self.kv_shape, num_blocks, self.config.device)
        self.model.bind_kv_cache(self.kv_cache)
        self.runner = ModelRunner(self.model, self.config.block_size, self.config.max_num_seqs,
                                  self.config.token_budget)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        logits = self.runner.run(step)
        rows = [c.sampling for c in step.chunks if c.sampling is not None]
        token_ids, logprobs = self.sampler(logits, rows)
        return StepOutput(step.step, token_ids, logprobs)

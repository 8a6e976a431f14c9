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
    its layers; block ids are shared by every worker, so one scheduler serves them all."""

    def __init__(self, config: EngineConfig, layout: ParallelLayout | None = None) -> None:
        self.config = config
        self.model = load_model(config.model, config.dtype, config.device, layout, config.seed)
        shard = self.model.shard
        shape = KVCacheShape(len(shard.layers), config.block_size, shard.num_kv_heads, shard.head_dim,
                             config.dtype)
        self.max_model_len = config.model_len(self.model.config)
        self.num_kv_blocks = config.num_kv_blocks or auto_num_blocks(
            shape, config.device, config.max_num_seqs, self.max_model_len, config.kv_memory_fraction)
        self.kv_cache = KVCache(shape, self.num_kv_blocks, config.device)
        self.model.bind_kv_cache(self.kv_cache)
        self.runner = ModelRunner(self.model, config.block_size, self.num_kv_blocks, config.max_num_seqs,
                                  config.token_budget)
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        logits = self.runner.run(step)
        rows = [c.sampling for c in step.chunks if c.sampling is not None]
        token_ids, logprobs = self.sampler(logits, rows)
        return StepOutput(step.step, token_ids, logprobs)

"""One worker: a model stage, its KV cache, the model runner and the sampler. Every
executor (in-process, tensor/pipeline-parallel worker processes) runs a step through
`Worker.execute`, so there is one step path."""
from __future__ import annotations

import time

import torch

from sarathi_rt.ops.kv_cache import KVCache, KVCacheShape
from sarathi_rt.models import CausalLM, ParallelLayout, ResolvedModel, load_model
from sarathi_rt.utils.nvtx import nvtx_detail_range, nvtx_range

from sarathi_rt.config import EngineConfig
from .compiled_forward import stage_forward
from .memory import auto_num_blocks, available_bytes
from .model_runner import ModelRunner
from .outputs import TokenLogprob
from .sampler import Sampler, token_logprobs
from .step_io import RowSampling, SequenceChunk, StepInput, StepOutput

# What a stage before the last hands the next one: (hidden, residual).
Activations = tuple[torch.Tensor, torch.Tensor]


class Worker:
    """Holds the weights of its (tensor rank, pipeline stage) shard of `model` (the
    engine's config.model, resolved once by the engine) and the KV blocks of its layers;
    block ids are shared by every worker, so one scheduler serves them all.

    `num_kv_blocks` is what fits here (config.num_kv_blocks, or what the engine can use,
    see `auto_num_blocks`). With allocate=False the cache waits for `allocate_kv_cache`,
    so that workers can agree on the smallest count. `startup_seconds` records where
    start-up went: weights, kv_cache, warm_up."""

    def __init__(self, config: EngineConfig, model: ResolvedModel, layout: ParallelLayout | None = None, *,
                 kv_memory_fraction: float | None = None, allocate: bool = True) -> None:
        self.config = config
        if config.threads is not None:  # every worker process, the engine's own included
            torch.set_num_threads(config.threads)
        start = time.perf_counter()
        self.model: CausalLM = load_model(model, config.dtype, config.device, layout, config.seed)
        self.startup_seconds = {"weights": time.perf_counter() - start}
        shard = self.model.shard
        self.is_first, self.is_last = shard.is_first, shard.is_last
        self.kv_shape = KVCacheShape(len(shard.layers), config.block_size, shard.num_kv_heads, shard.head_dim,
                                     config.dtype)
        self.max_model_len = config.model_len(self.model.config)
        fraction = config.kv_memory_fraction if kv_memory_fraction is None else kv_memory_fraction
        if config.num_kv_blocks is not None:
            wanted, free = config.num_kv_blocks * self.kv_shape.bytes_per_block, available_bytes(config.device)
            if wanted > free:
                raise ValueError(f"num_kv_blocks={config.num_kv_blocks} needs {wanted / 2**30:.2f} GiB of KV cache; "
                                 f"{config.device} has {free / 2**30:.2f} GiB free")
        self.num_kv_blocks = config.num_kv_blocks or auto_num_blocks(
            self.kv_shape, config.device, config.max_num_seqs, self.max_model_len, fraction)
        self.sampler = Sampler()
        if allocate:
            self.allocate_kv_cache(self.num_kv_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` blocks, then run one warm-up token through the stage."""
        if not 1 <= num_blocks <= self.num_kv_blocks:
            raise ValueError(f"num_blocks must be in [1, {self.num_kv_blocks}], got {num_blocks}")
        start = time.perf_counter()
        self.num_kv_blocks = num_blocks
        self.kv_cache = KVCache(self.kv_shape, num_blocks, self.config.device)
        self.model.bind_kv_cache(self.kv_cache)
        self.runner = ModelRunner(self.model, self.kv_cache, self.config.block_size, self.config.max_num_seqs,
                                  self.config.token_budget)
        self.run_stage = stage_forward(self.model, self.config.compile, self.config.token_budget)
        self.startup_seconds["kv_cache"] = time.perf_counter() - start
        start = time.perf_counter()
        self._warm_up()
        self.startup_seconds["warm_up"] = time.perf_counter() - start

    @torch.inference_mode()
    def execute(self, step: StepInput, intermediate: Activations | None = None
                ) -> StepOutput | Activations | None:
        """Run this worker's stage of one step. Stages before the last return their
        activations for the next stage (which passes them as `intermediate`); the last
        stage returns the sampled tokens, on tensor rank 0 only (None elsewhere: the
        other ranks hold no full logits)."""
        with nvtx_range("prepare"):
            input_ids, ctx = self.runner.prepare(step)
            if step.block_copies:  # before the forward writes the copies' next tokens
                self.kv_cache.copy_blocks(step.block_copies)
        with nvtx_range("forward"):
            hidden, residual = self.run_stage(ctx, input_ids=input_ids if self.is_first else None,
                                              intermediate=intermediate)
            if not self.is_last:
                assert residual is not None  # every stage runs at least one layer
                return hidden, residual
            with nvtx_detail_range("logits", "layer"):
                logits = self.model.compute_logits(hidden, residual, ctx)
        if logits is None:
            return None
        if not any(c.prompt_targets or c.num_draft for c in step.chunks):
            token_ids, logprobs = self.sampler(logits, _rows(step))
            return StepOutput(step.step, token_ids, logprobs)
        return self._split_rows(step, logits)

    def _split_rows(self, step: StepInput, logits: torch.Tensor) -> StepOutput:
        """Split the logits rows (per chunk: its prompt targets' rows, then its sampled
        rows; see ModelRunner.prepare) into the rows to sample and the prompt's scores.
        A verifying chunk (num_draft > 0) samples each of its 1 + num_draft rows, judging
        the proposal that follows each, and keeps the tokens up to the first rejection."""
        sample_rows: list[int] = []
        rows: list[RowSampling] = []
        drafts: list[int | None] = []
        spans: list[tuple[int, int] | None] = []
        row = 0
        for c in step.chunks:
            count = len(c.prompt_targets or ())
            spans.append((row, count) if count else None)
            row += count
            if c.num_draft:
                judged: list[int | None] = [*c.token_ids[len(c.token_ids) - c.num_draft:], None]
                chunk_rows = c.verify_rows()
            else:
                chunk_rows, judged = c.rows, [None] * len(c.rows)
            rows += chunk_rows
            drafts += judged
            sample_rows += range(row, row + len(chunk_rows))
            row += len(chunk_rows)
        index = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
        token_ids, logprobs = self.sampler(logits.index_select(0, index), rows, drafts)
        prompt: list[list[TokenLogprob] | None] = []
        for c, span in zip(step.chunks, spans):
            if span is None:
                prompt.append(None)
                continue
            assert c.prompt_targets is not None
            start, count = span
            prompt.append(token_logprobs(logits[start:start + count], c.prompt_targets, [c.prompt_top] * count))
        if not any(span is not None for span in spans):
            prompt = []
        if not any(c.num_draft for c in step.chunks):
            return StepOutput(step.step, token_ids, logprobs, prompt_logprobs=prompt)
        return _accept(step, token_ids, logprobs, prompt)

    def _warm_up(self) -> None:
        """One token through this stage (its layers, logits and sampling), so one-off
        costs (lazy initialisation, first allocations) fall in start-up rather than in
        the first request's time to first token. It writes block 0's first slot, which
        a request overwrites before reading it."""
        step = StepInput(0, [SequenceChunk("warm-up", [0], 0, [0], RowSampling(0.0, None, 1.0, 0, 0))])
        intermediate = None
        if not self.is_first:
            zeros = torch.zeros(1, self.model.config.hidden_size, dtype=self.model.dtype,
                                device=self.config.device)
            intermediate = (zeros, zeros)
        self.execute(step, intermediate)


def _accept(step: StepInput, token_ids: list[int], logprobs: list[TokenLogprob | None],
            prompt: list[list[TokenLogprob] | None]) -> StepOutput:
    """The step's output from its sampled rows in chunk order (a verifying chunk's 1 +
    num_draft rows together): a verifying row keeps its proposals while each row's token
    is the proposal itself, then the first token that is not (or the last row's)."""
    kept: list[int] = []
    kept_logprobs: list[TokenLogprob | None] = []
    per_row: list[int] = []
    row = 0
    for c in step.chunks:
        if not c.num_draft:
            n = len(c.rows)
            kept += token_ids[row:row + n]
            kept_logprobs += logprobs[row:row + n]
            per_row += [1] * n
            row += n
            continue
        proposals = c.token_ids[len(c.token_ids) - c.num_draft:]
        accepted = 0
        while accepted < c.num_draft and token_ids[row + accepted] == proposals[accepted]:
            accepted += 1
        kept += token_ids[row:row + accepted + 1]
        kept_logprobs += logprobs[row:row + accepted + 1]
        per_row.append(accepted + 1)
        row += c.num_draft + 1
    return StepOutput(step.step, kept, kept_logprobs, prompt_logprobs=prompt, tokens_per_row=per_row)


def _rows(step: StepInput) -> list[RowSampling]:
    """The rows the step samples, in logits order (a fork's samples after its chunk's own)."""
    rows = [c.sampling for c in step.chunks if c.sampling is not None]
    if any(c.forks for c in step.chunks):
        rows = [r for c in step.chunks for r in c.rows]
    return rows

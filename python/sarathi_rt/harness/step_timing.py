"""Timing synthetic steps on a real engine: the one timing loop behind the step-time
curve of the SLO-derived budget (`measure_step_curve`) and the shape profile of the
simulator (`shape_profiling`)."""
from __future__ import annotations

import random
import statistics
import time
from typing import TYPE_CHECKING, Sequence

from sarathi_rt.sim.budget import BudgetChoice, StepTimeCurve, SyntheticRow, check_counts, choose_token_budget, hybrid_batch

if TYPE_CHECKING:
    from sarathi_rt.engine import LLMEngine
    from sarathi_rt.engine.step_io import StepInput


def synthetic_step(engine: LLMEngine, rows: Sequence[SyntheticRow]) -> StepInput:
    """A step of one request per row, each in blocks of its own from block 0, with
    throwaway ids; running it writes throwaway KV into those blocks, so the engine must
    be idle."""
    from sarathi_rt.engine.step_io import RowSampling, SequenceChunk, StepInput

    if engine.has_unfinished():
        raise ValueError("engine has unfinished requests; profiling needs an idle engine")
    bs, num_blocks = engine.config.block_size, engine.executor.num_kv_blocks
    vocab = engine.model_config.vocab_size
    greedy = RowSampling(temperature=0.0, top_k=None, top_p=1.0, seed=0, num_generated=0)
    chunks, next_block = [], 0
    for i, row in enumerate(rows):
        need = -(-(row.start_pos + row.num_tokens) // bs)
        if next_block + need > num_blocks:
            raise ValueError(f"a step of {len(rows)} requests over {sum(r.start_pos + r.num_tokens for r in rows)} "
                             f"tokens needs more than the engine's {num_blocks} KV blocks")
        ids = [(7919 * (i + 1) + 31 * k) % vocab for k in range(row.num_tokens)]
        chunks.append(SequenceChunk(i, ids, row.start_pos, list(range(next_block, next_block + need)),
                                    greedy if row.samples else None))
        next_block += need
    return StepInput(0, chunks)


def time_steps(engine: LLMEngine, steps: Sequence[Sequence[SyntheticRow]], *, repeats: int, warmup: int,
               seed: int = 0) -> list[list[float]]:
    """Executor wall times (model forward and sampling) of the `synthetic_step` of each
    row list, `repeats` each, after `warmup` untimed runs of each.

    The repeats are rounds: each times every step once, in a fresh (seeded) random
    order. Timed step after step, a change of the machine's load during the profile
    (minutes on a CPU) lands on whole groups of steps (all decodes at one context, say)
    as a systematic error a fit cannot tell from a real cost; in shuffled rounds it is
    noise on every step, which the median over the rounds removes."""
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats!r}, {warmup!r}")
    inputs = [synthetic_step(engine, rows) for rows in steps]
    for step in inputs:
        for _ in range(warmup):
            engine.executor.execute(step)
    times: list[list[float]] = [[] for _ in inputs]
    rng = random.Random(seed)
    order = list(range(len(inputs)))
    for _ in range(repeats):
        rng.shuffle(order)
        for i in order:
            t0 = time.perf_counter()
            engine.executor.execute(inputs[i])
            times[i].append(time.perf_counter() - t0)
    return times


def measure_step_curve(engine: LLMEngine, token_counts: Sequence[int], *, num_decodes: int = 32,
                       context_len: int = 1024, repeats: int = 5, warmup: int = 2) -> StepTimeCurve:
    """T(n): the median wall time of the representative hybrid batch (`hybrid_batch`) of
    each token count through `engine`'s executor. The engine must be idle: the batches
    write throwaway KV into its cache blocks."""
    counts = check_counts(token_counts, num_decodes, context_len)
    times = time_steps(engine, [hybrid_batch(n, num_decodes, context_len) for n in counts],
                       repeats=repeats, warmup=warmup)
    return StepTimeCurve(tuple(counts), tuple(statistics.median(t) for t in times), num_decodes, context_len,
                         label=f"{engine.config.model} on {engine.config.device}")


def engine_slo_budget(engine: LLMEngine, tbt_slo: float, *, tile_size: int = 128, num_decodes: int = 32,
                      context_len: int = 1024) -> tuple[StepTimeCurve, BudgetChoice]:
    """The --budget-rule slo-static budget of a real engine: T(n) for n of 1 to 8 tiles,
    each step `num_decodes` decodes and a chunk over `context_len` tokens (less when the
    cache cannot hold the largest step: its chunk and every row's context), then the
    largest tile-aligned n within the SLO. The engine must be idle and take 8 tiles a step."""
    block_size = engine.config.block_size
    room = engine.executor.num_kv_blocks * block_size - tile_size * 8
    context = max(1, min(context_len, room // (num_decodes + 1) - 2 * block_size))
    curve = measure_step_curve(engine, [tile_size * k for k in range(1, 9)], num_decodes=num_decodes,
                               context_len=context)
    return curve, choose_token_budget(curve, tbt_slo, tile_size)

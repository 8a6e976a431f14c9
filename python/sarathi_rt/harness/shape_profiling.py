"""Measure an engine's steps by shape for ShapeCostModel (`sarathi-rt profile`): decode-
only batches on a dense grid up to max_num_seqs, prefill chunks up to the largest
chunk, and mixed batches, at the workload's mean context and at a quarter of it (two
contexts tell the attention terms from the dense ones); then a short real run of the
workload measures the host's per-step overhead. `speed_factor` re-times steps later
(a simulation's, or part of the profile), and `run_speed` reads the speed off a real run's
own steps, so that a simulation can follow the machine's speed."""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Sequence

from sarathi_rt.step_time.shape import StepShape
from sarathi_rt.sim.budget import SyntheticRow
from sarathi_rt.sim.shape_model import MeasuredStep, ShapeCostModel, ShapeProfile
from sarathi_rt.workloads import RequestSpec

from .step_timing import time_steps

if TYPE_CHECKING:
    from sarathi_rt.engine import LLMEngine
    from sarathi_rt.scheduler import BatchPlan


def decode_grid(max_decodes: int) -> list[int]:
    """Every count up to 8, then every 2 to 16, every 4 to 64, every 16 beyond."""
    grid = {d for d in range(1, max_decodes + 1)
            if d <= 8 or (d <= 16 and d % 2 == 0) or (d <= 64 and d % 4 == 0) or d % 16 == 0}
    return sorted(grid | {max_decodes})


def chunk_grid(max_chunk: int) -> list[int]:
    grid, q = set(), 16
    while q < max_chunk:
        grid.update((q, q + q // 2))
        q *= 2
    return sorted({g for g in grid if g < max_chunk} | {max_chunk})


def profile_batches(context_len: int, max_decodes: int, max_chunk: int) -> list[tuple[int, int, int, int]]:
    """(num_prefill_tokens, prefill_context, num_decodes, decode_context) of each batch."""
    batches = []
    for ctx in sorted({max(1, context_len // 4), context_len}):
        batches += [(0, 0, d, ctx) for d in decode_grid(max_decodes)]
        batches += [(q, ctx, 0, 0) for q in chunk_grid(max_chunk)]
    for d in sorted({1, max(1, max_decodes // 4), max_decodes}):
        batches += [(q, context_len, d, context_len) for q in sorted({16, max_chunk // 4, max_chunk}) if q > 0]
    return batches


def measure(engine: LLMEngine, batches: Sequence[tuple[int, int, int, int]], *, repeats: int = 3,
            warmup: int = 1, seed: int = 0) -> list[MeasuredStep]:
    """Wall time of each batch through the engine's executor (model forward and
    sampling), `repeats` times after `warmup` (see `time_steps`). The engine must be idle:
    the batches write throwaway KV into its cache blocks."""
    times = time_steps(engine, [_batch_rows(*b) for b in batches], repeats=repeats, warmup=warmup, seed=seed)
    return [MeasuredStep(q, pctx, d, dctx, False, tuple(t)) for (q, pctx, d, dctx), t in zip(batches, times)]


def _batch_rows(q: int, pctx: int, d: int, dctx: int) -> list[SyntheticRow]:
    """A profiled batch: d decodes at dctx, a q-token (middle) chunk at pctx."""
    return [SyntheticRow(dctx, 1, False, True)] * d + ([SyntheticRow(pctx, q, True, False)] if q else [])


def host_overhead(engine: LLMEngine, workload: Sequence[RequestSpec], seed: int) -> float:
    """Median over the steps of a real run of the workload of (engine step time - the
    executor's time): scheduling, building inputs and handling outputs."""
    from sarathi_rt.harness.replay import replay

    executor = engine.executor
    submit, executed = executor.submit, []

    def timed_submit(step) -> None:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        submit(step)
        executed.append(time.perf_counter() - t0)

    executor.submit = timed_submit  # type: ignore[method-assign]
    try:
        _, steps = replay(engine, workload, seed=seed)
    finally:
        del executor.submit  # back to the class's method
    return statistics.median(s.duration - e for s, e in zip(steps, executed)) if steps else 0.0


def speed_factor(engine: LLMEngine, model: ShapeCostModel, plans: Sequence[BatchPlan] | None = None, *,
                 repeats: int = 3, seed: int = 0) -> float:
    """How much slower (> 1) or faster the machine runs now than `model` predicts: the
    median over `plans` of (time now / the model's time), each re-timed `repeats` times
    now. Pass it as ShapeCostModel's time_scale to simulate a run made now.

    Against the model, not a profile's own timing of a batch: one timing carries its own
    jitter (a CPU's repeats spread 20-50%), the fit pools all of them. Give `plans` the
    steps the run will make (a simulation's, through its step_observer): where the fit
    is a few percent off, it is off by shape, so a probe of other shapes reads a speed the
    run does not have. Without plans: the profile's mixed batches (a chunk beside decodes,
    every cost term at once). The engine must be idle (as for `measure`) and configured
    as when the profile was taken."""
    if plans is None:
        ref = [s for s in model.profile.steps if s.num_prefill_tokens and s.num_decodes]
        if not ref:
            raise ValueError("profile has no mixed batch to re-time")
        rows = [_batch_rows(s.num_prefill_tokens, s.prefill_context, s.num_decodes, s.decode_context) for s in ref]
        shapes = [s.shape() for s in ref]
    else:
        if not plans or any(p.is_empty for p in plans):
            raise ValueError("plans must be a non-empty sequence of non-empty BatchPlans")
        rows = [[SyntheticRow(e.start_pos, e.num_tokens, e.is_prefill, e.emits_token) for e in p.entries]
                for p in plans]
        shapes = [StepShape.of_plan(p) for p in plans]
    times = time_steps(engine, rows, repeats=repeats, warmup=1, seed=seed)
    return statistics.median(statistics.median(t) / model.model_time(sh) for t, sh in zip(times, shapes))


def run_speed(model: ShapeCostModel, steps: Sequence[tuple[StepShape, float]]) -> float:
    """The machine's speed during a real run relative to `model`'s (pass it as
    ShapeCostModel's time_scale): the median over the run's steps, as (shape, measured
    seconds) pairs from LLMEngine's step_observer, of measured / predicted time. Unlike
    `speed_factor` it needs no idle engine, and it sees the speed the run itself had."""
    if not steps:
        raise ValueError("steps is empty: a run's speed needs at least one measured step")
    return statistics.median(seconds / model.predict_shape(shape) for shape, seconds in steps)


def profile_engine(engine: LLMEngine, context_len: int, max_decodes: int, max_chunk: int,
                   calibration: Sequence[RequestSpec], *, repeats: int = 9, seed: int = 0,
                   engine_settings: dict | None = None) -> ShapeProfile:
    """The profile `sarathi-rt profile` saves; `calibration`: requests for the host
    overhead's real run (none: no host term)."""
    steps = measure(engine, profile_batches(context_len, max_decodes, max_chunk), repeats=repeats, seed=seed)
    host = host_overhead(engine, calibration, seed) if calibration else 0.0
    return ShapeProfile(tuple(steps), host, dict(engine_settings or {}),
                        label=f"{engine.config.model} on {engine.config.device}")

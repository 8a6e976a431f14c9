"""Replay a workload against a real engine in wall-clock time: each request is added
once its arrival time has passed, and the engine steps continuously, as a server
would. Returns the engine's own per-request and per-step records."""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from sarathi_rt.measure.metrics import RequestMetrics, StepMetrics
from sarathi_rt.workloads import RequestSpec

if TYPE_CHECKING:
    from sarathi_rt.engine import LLMEngine


def synthetic_prompt(spec: RequestSpec, vocab_size: int, seed: int) -> list[int]:
    """The request's own ids if the workload has them, else seeded random token ids
    (trace lengths, no text)."""
    if spec.prompt_token_ids is not None:
        return list(spec.prompt_token_ids)
    rng = np.random.default_rng([seed, spec.request_id])
    return rng.integers(3, vocab_size, spec.num_prompt_tokens).tolist()


def warm_up(engine: LLMEngine, num_tokens: int = 32) -> None:
    """One short request end to end, so that one-time costs (allocator growth, lazy
    initialisation, kernel selection) do not land in the measured run."""
    from sarathi_rt.sampling import SamplingParams

    classes = engine.scheduler_config.qos_classes
    qos = None if classes is None or engine.scheduler_config.default_qos else next(iter(classes))
    engine.add_request("__warmup__", list(range(3, 3 + num_tokens)),
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), qos=qos)
    while engine.has_unfinished():
        engine.step()


def replay(engine: LLMEngine, workload: Sequence[RequestSpec], *, seed: int = 0,
           progress: Callable[[int], None] | None = None
           ) -> tuple[list[RequestMetrics], list[StepMetrics]]:
    """Run `workload` (sorted by arrival) on an idle `engine`; generation is greedy and
    ignores EOS, so every request produces exactly its num_decode_tokens. Returns
    the requests' metrics in workload order and the metrics of the steps taken.
    `progress(n)` is called as n requests finish."""
    from sarathi_rt.sampling import SamplingParams

    if engine.has_unfinished():
        raise ValueError("engine has unfinished requests; replay needs an idle engine")
    if any(b.arrival_time < a.arrival_time for a, b in zip(workload, workload[1:])):
        raise ValueError("workload must be sorted by arrival_time")
    vocab = engine.model_config.vocab_size
    prompts = {r.request_id: synthetic_prompt(r, vocab, seed) for r in workload}
    done: dict[object, RequestMetrics] = {}
    pending = deque(workload)
    first_step = engine.num_steps
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and t0 + pending[0].arrival_time <= now:
            r = pending.popleft()
            params = SamplingParams(max_tokens=r.num_decode_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(r.request_id, prompts[r.request_id], params, arrival_time=t0 + r.arrival_time,
                               qos=r.qos)
        if not engine.has_unfinished():
            time.sleep(max(0.0, t0 + pending[0].arrival_time - time.perf_counter()))
            continue
        finished = 0
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.metrics
                finished += 1
        if progress is not None and finished:
            progress(finished)
    return [done[r.request_id] for r in workload], engine.steps_since(first_step)

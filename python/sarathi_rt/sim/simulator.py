"""Trace-driven serving simulator: the REAL scheduler classes, a cost model in place of
the model, simulated time in place of the clock.

With pipeline_stages = k the model's layers are split evenly over k stages. A plan
(micro-batch) is issued when stage 0 is free and fewer than k plans are in flight; it
occupies each stage for step_time / k (plus the send to the next stage) in turn, and
waits before a stage that is still busy with the previous micro-batch. That wait is
the pipeline bubble: uneven micro-batches (a long prefill after short decodes) create
it; equal-sized hybrid batches avoid it.

With `speculation`, every decode has k proposals each step (Scheduler.set_proposals);
the scheduler sizes how many it verifies, and each step's accepted counts are drawn from
the request's acceptance rate (its RequestSpec.acceptance, else one drawn from the
speculation's distribution): see sim.speculation."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from sarathi_rt.measure.metrics import DEFAULT_STALL_FACTOR, MetricsSummary, RequestMetrics, StepMetrics, summarize
from sarathi_rt.scheduler import BatchPlan, PrefixCacheStats, QoSClass, Scheduler, SchedulerConfig, create_scheduler
from sarathi_rt.step_time.shape import PlannedStep, StepShape, StepTimeModel
from sarathi_rt.utils.checks import positive_int
from sarathi_rt.workloads import RequestSpec

from .cost import CostModel
from .speculation import SimSpeculation, draw_accepted


@dataclass
class SimResult:
    """Per-request (in workload order) and per-step records of one simulated run.

    stage_busy: seconds each pipeline stage computed or sent. bubble_times: per
    request, seconds its micro-batches waited between stages for a busy stage.
    prefix_cache: the scheduler's prefix-cache counters at the end of the run.
    qos_classes: the scheduler's, for the summary's per-class attainment."""

    policy: str
    pipeline_stages: int
    requests: list[RequestMetrics]
    steps: list[StepMetrics]
    makespan: float
    stage_busy: list[float] = field(default_factory=list)
    bubble_times: list[float] = field(default_factory=list)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    qos_classes: Mapping[str, QoSClass] | None = None

    @property
    def stage_idle(self) -> list[float]:
        return [self.makespan - b for b in self.stage_busy]

    def summary(self, stall_factor: float = DEFAULT_STALL_FACTOR) -> MetricsSummary:
        return summarize(self.requests, self.steps, stall_factor, self.qos_classes)


@dataclass(slots=True)
class _InFlight:
    issued_at: float
    done_at: float
    plan: BatchPlan


class PipelineLatency:
    """The adaptive budget's step-time model under pipeline parallelism: a micro-batch's
    trip through k stages (its compute split evenly over them plus k - 1 sends). That
    trip is the gap between a request's tokens when k equal micro-batches rotate
    through the pipeline (each stage is busy with one of them at a time), so sizing
    each micro-batch's trip to the SLO is what sizing a step is without a pipeline."""

    margin = 0.0  # exact, as the cost model is

    def __init__(self, cost_model: CostModel, stages: int) -> None:
        self.cost_model, self.stages = cost_model, stages

    def predict_shape(self, shape: StepShape) -> float:
        return self.cost_model.predict_shape(shape) + (self.stages - 1) * self.cost_model.comm_time(shape.num_tokens)

    def predict_bound(self, shape: StepShape) -> float:
        # A send grows with the tokens it carries.
        return self.cost_model.predict_bound(shape) + (self.stages - 1) * self.cost_model.comm_time(shape.num_tokens)

    def observe(self, plan: PlannedStep, seconds: float) -> None:
        """Exact by construction: nothing to learn."""


def simulate(workload: Sequence[RequestSpec], scheduler_config: SchedulerConfig, cost_model: CostModel,
             *, pipeline_stages: int = 1, progress: Callable[[int], None] | None = None,
             step_time_model: StepTimeModel | None = None,
             step_observer: Callable[[BatchPlan, float], None] | None = None,
             speculation: SimSpeculation | None = None) -> SimResult:
    """Replay `workload` (sorted by arrival) through `scheduler_config.policy` with step
    times from `cost_model`. Deterministic: the same inputs give the same result.
    `progress(n)` is called with the number of requests each step finished;
    `step_observer(plan, seconds)` with each step issued, as LLMEngine's is.

    With scheduler_config.tbt_slo the adaptive budget asks `step_time_model` (default:
    the cost model itself, which knows every step exactly; with pipeline stages, the
    micro-batch's trip through all of them, see PipelineLatency); a model passed in
    observes each micro-batch from its issue to its last stage, as the engine does.
    `speculation`: speculative decoding with k proposals per decode (None: none)."""
    positive_int("pipeline_stages", pipeline_stages)
    if any(b.arrival_time < a.arrival_time for a, b in zip(workload, workload[1:])):
        raise ValueError("workload must be sorted by arrival_time")
    ids = [r.request_id for r in workload]
    if len(set(ids)) != len(ids):
        raise ValueError("workload has duplicate request ids")
    k = pipeline_stages
    learner = step_time_model if step_time_model is not cost_model else None
    if scheduler_config.needs_step_time_model and step_time_model is None:
        step_time_model = cost_model if k == 1 else PipelineLatency(cost_model, k)  # type: ignore[assignment]
    sched = create_scheduler(scheduler_config, step_time_model)
    index = {rid: i for i, rid in enumerate(ids)}
    records = [RequestMetrics(r.arrival_time, r.num_prompt_tokens, qos=r.qos) for r in workload]
    bubbles = [0.0] * len(workload)
    steps: list[StepMetrics] = []
    busy = [0.0] * k
    free_at = [0.0] * k  # when each stage finishes its last micro-batch
    inflight: deque[_InFlight] = deque()
    now = workload[0].arrival_time if workload else 0.0
    nxt = 0
    drafts = None
    if speculation is not None:
        speculation.check_policy(scheduler_config.policy)
        drafts = _Drafts(speculation, workload)

    while True:
        while nxt < len(workload) and workload[nxt].arrival_time <= now:
            r = workload[nxt]
            sched.add_request(r.request_id, r.num_prompt_tokens, r.num_decode_tokens,
                              prompt_token_ids=r.prompt_token_ids, qos=r.qos, arrival_time=r.arrival_time)
            records[index[r.request_id]].qos = sched.request_info(r.request_id).qos  # default_qos applied
            if drafts is not None:
                drafts.live.add(r.request_id)
            nxt += 1
        if len(inflight) < k and free_at[0] <= now and sched.has_unfinished():
            if drafts is not None:
                drafts.propose(sched)
            plan = sched.schedule(now)
            for rid in plan.preempted:
                records[index[rid]].num_preemptions += 1
            for rid in plan.relegated:
                records[index[rid]].relegated = True
            if plan.is_empty:
                sched.update(plan)  # nothing runnable until an arrival or a completion
            else:
                done_at = _issue(plan, now, cost_model, k, free_at, busy, bubbles, index)
                if learner is not None:
                    learner.observe(plan, done_at - now)
                if step_observer is not None:
                    step_observer(plan, done_at - now)
                inflight.append(_InFlight(now, done_at, plan))
                steps.append(StepMetrics(now, done_at - now, plan.num_tokens, plan.num_prefill_tokens,
                                         plan.num_decode_tokens, len(plan.entries), plan.tile_padding))
        events = []
        if inflight:
            events.append(inflight[0].done_at)
        if nxt < len(workload):
            events.append(workload[nxt].arrival_time)
        if len(inflight) < k and free_at[0] > now:
            events.append(free_at[0])
        if not events:
            if sched.has_unfinished():
                raise RuntimeError(f"policy {scheduler_config.policy!r} scheduled nothing with "
                                   f"{sched.num_waiting} requests waiting and none in flight")
            break
        now = max(now, min(events))
        while inflight and inflight[0].done_at <= now:
            _complete(inflight.popleft(), sched, records, index, progress, drafts)

    makespan = max((r.finish_time for r in records if r.finish_time is not None), default=now)
    start = workload[0].arrival_time if workload else 0.0
    return SimResult(scheduler_config.policy, k, records, steps, makespan - start, busy, bubbles,
                     sched.prefix_cache_stats(), scheduler_config.qos_classes)


def _issue(plan: BatchPlan, now: float, cost_model: CostModel, k: int, free_at: list[float],
           busy: list[float], bubbles: list[float], index: dict) -> float:
    """Push `plan` through the stages from `now`; returns when the last stage finishes."""
    compute = cost_model.step_time(plan) / k
    if not (compute > 0 and math.isfinite(compute)):
        raise ValueError(f"cost model returned step time {compute * k!r} for a "
                         f"{plan.num_tokens}-token step; it must be positive and finite")
    send = cost_model.comm_time(plan.num_tokens) if k > 1 else 0.0
    t, waited = now, 0.0
    for s in range(k):
        start = max(t, free_at[s])
        waited += start - t
        dur = compute + (send if s < k - 1 else 0.0)
        t = free_at[s] = start + dur
        busy[s] += dur
    if waited:
        for e in plan.entries:
            bubbles[index[e.request_id]] += waited
    return t


class _Drafts:
    """The simulator's proposer and verifier: k proposals for every live request each
    step, and accepted counts drawn from each request's acceptance rate."""

    def __init__(self, spec: SimSpeculation, workload: Sequence[RequestSpec]) -> None:
        self.k = spec.k
        self.rng = spec.rng()
        self.rate = spec.rates(workload)
        self.live: set[Hashable] = set()

    def propose(self, sched: Scheduler) -> None:
        for rid in self.live:
            sched.set_proposals(rid, self.k)

    def verify(self, plan: BatchPlan) -> dict[Hashable, int]:
        return {e.request_id: draw_accepted(self.rng, self.rate[e.request_id], e.num_draft)
                for e in plan.entries if e.num_draft}


def _complete(f: _InFlight, sched, records: list[RequestMetrics], index: dict,
              progress: Callable[[int], None] | None, drafts: _Drafts | None) -> None:
    # One pass over the entries (the simulator's hot loop): first scheduling is
    # recorded here, at completion, with the time the plan was issued.
    t = f.done_at
    accepted = {} if drafts is None else drafts.verify(f.plan)
    for e in f.plan.entries:
        rec = records[index[e.request_id]]
        if rec.first_scheduled_time is None:
            rec.first_scheduled_time = f.issued_at
            rec.num_cached_tokens = e.start_pos  # cached tokens cost no compute: not in the plan
        if e.emits_token:
            rec.token_times.extend([t] * (1 + accepted.get(e.request_id, 0)))
            if rec.first_token_time is None:
                rec.first_token_time = t
    finished = sched.update(f.plan, accepted=accepted or None)
    if drafts is not None:
        drafts.live.difference_update(finished)
    for rid in finished:
        records[index[rid]].finish_time = t
    if progress is not None and finished:
        progress(len(finished))

"""Deployment planning on the simulator: the fewest GPUs (replicas x TP x PP) that serve a
target request rate within the SLOs.

Every (TP, PP, policy, token budget) candidate is first bounded without simulating:
its weights must fit beside a KV cache, a one-decode step must meet the TBT SLO, and
the most tokens per second a replica can process (the best n / T(n) of its cost model,
times PP for a full pipeline) caps its capacity, and so does Little's law (a running
request holds a sequence slot and its prompt's KV for at least one pipeline pass per
output token), hence the fewest replicas it can need. Candidates are then simulated cheapest bound first, and the search stops once
`top` deployments are known that no unsimulated candidate's bound can beat. A candidate's
capacity per replica does not depend on the target rate: it is searched (10 %
bisection, never above the ceiling) only when one run at the least rate per replica
that would enter the list found so far meets the SLO; each rate is simulated once, over
MIN_SPAN_S first and over the full span only if it passes that."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from sarathi_rt.sim.budget import choose_token_budget, cost_model_curve
from sarathi_rt.sim.capacity import SLO, find_capacity
from sarathi_rt.measure.metrics import MetricsSummary, summarize
from sarathi_rt.scheduler import BatchPlan, PlanEntry, SchedulerConfig, get_policy
from sarathi_rt.sim import HARDWARE, SimSpeculation, VidurCostModel, simulate
from sarathi_rt.utils.checks import positive_int
from sarathi_rt.workloads import RequestSpec, WorkloadConfig, make_workload

TP_SIZES = (1, 2, 4, 8, 16)  # those the profile has rows for are searched
BUDGET_TILE = 128
MIN_SPAN_S = 60.0  # seconds of arrivals per simulated run, at least
LIFETIMES = 4  # ... and at least this many request lifetimes (mean output tokens x the TBT SLO)



@dataclass(frozen=True)
class DeploymentSLO(SLO):
    """SLO with an optional P50 time-to-first-token limit (seconds)."""

    ttft_p50: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ttft_p50 is not None and not (self.ttft_p50 > 0 and math.isfinite(self.ttft_p50)):
            raise ValueError(f"ttft_p50 must be a positive finite number of seconds, got {self.ttft_p50!r}")

    def met_by(self, summary: MetricsSummary) -> bool:
        ttft_ok = self.ttft_p50 is None or summary.ttft.p50 <= self.ttft_p50
        return ttft_ok and super().met_by(summary)


@dataclass(frozen=True)
class DeploymentRequest:
    qps: float
    slo: DeploymentSLO
    profile: str
    num_layers: int = 32
    hardware: str = "a100"
    gpus_per_node: int = 8
    max_gpus: int = 64
    policies: tuple[str, ...] = ("sarathi", "vllm")
    token_budgets: tuple[int, ...] = ()  # empty: the largest budget whose step meets the TBT SLO
    max_num_seqs: int = 128
    block_size: int = 16
    top: int = 5
    speculation: SimSpeculation | None = None  # speculative decoding in every replica (chunked policies)

    def __post_init__(self) -> None:
        if not (self.qps > 0 and math.isfinite(self.qps)):
            raise ValueError(f"qps must be a positive finite number, got {self.qps!r}")
        if self.hardware not in HARDWARE:
            raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got {self.hardware!r}")
        for name in ("num_layers", "gpus_per_node", "max_gpus", "max_num_seqs", "block_size", "top"):
            positive_int(name, getattr(self, name))
        if not self.policies:
            raise ValueError("policies must name at least one policy")
        for policy in self.policies:
            get_policy(policy)
            if self.speculation is not None:
                self.speculation.check_policy(policy)
        if any(not isinstance(b, int) or b < 1 for b in self.token_budgets):
            raise ValueError(f"token_budgets must be positive ints, got {self.token_budgets!r}")


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    policy: str
    token_budget: int
    num_blocks: int
    max_qps_bound: float  # per replica: the throughput ceiling, or Little's law on sequences or KV

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp

    def min_gpus(self, qps: float) -> int:
        return math.ceil(qps / self.max_qps_bound) * self.gpus_per_replica


@dataclass(frozen=True)
class Deployment:
    """replicas x (tp x pp) GPUs; capacity_qps per replica; headroom: how much more than
    the target rate the plan serves (0.25: 25 % more)."""

    replicas: int
    tp: int
    pp: int
    policy: str
    token_budget: int
    capacity_qps: float
    headroom: float

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp * self.pp


@dataclass
class DeploymentSearch:
    deployments: list[Deployment]  # cheapest first
    simulated: int  # candidates whose capacity was searched
    pruned: dict[str, int]  # reason -> candidates dropped without simulating


def plan_deployment(request: DeploymentRequest, workload: WorkloadConfig,
                    log: Callable[[str], None] = lambda _: None) -> DeploymentSearch:
    """The `request.top` cheapest deployments (fewest GPUs, then most headroom) meeting the SLO
    at request.qps on `workload` (its qps is ignored)."""
    specs = make_workload(replace(workload, qps=request.qps))
    pruned: dict[str, int] = {}

    def prune(reason: str, count: int = 1) -> None:
        pruned[reason] = pruned.get(reason, 0) + count

    candidates = []
    for cand in _candidates(request, specs, prune):
        if cand.min_gpus(request.qps) > request.max_gpus:
            prune("its throughput ceiling needs more than max_gpus")
        else:
            candidates.append(cand)
    candidates.sort(key=lambda c: (c.min_gpus(request.qps), c.gpus_per_replica))
    # A run must outlast the filling of the KV cache and running set (a few request
    # lifetimes) before its judged half starts, or a small overload looks sustainable:
    # at 60 s the capacities came out 7-15 % high, the more so the larger the cache (PP).
    span = max(MIN_SPAN_S, LIFETIMES * request.slo.tbt_p99 * sum(r.num_decode_tokens for r in specs) / len(specs))
    deployments: list[Deployment] = []
    simulated = 0
    for i, cand in enumerate(candidates):
        if len(deployments) >= request.top and cand.min_gpus(request.qps) > deployments[request.top - 1].gpus:
            prune("cannot beat the plans already found", len(candidates) - i)
            break
        simulated += 1
        run = _runner(request, workload, cand, span)
        start = min(request.qps, cand.max_qps_bound / 2)
        if len(deployments) >= request.top:
            # To enter the list it must serve the rate with at most the last plan's GPUs:
            # one run at that rate settles most candidates without a search.
            need = request.qps / (deployments[request.top - 1].gpus // cand.gpus_per_replica)
            if not request.slo.met_by(run(need)):
                log(f"TP={cand.tp} PP={cand.pp} {cand.policy} budget={cand.token_budget}: misses the SLO at "
                    f"{need:.3g} QPS per replica, the least that beats the deployments found")
                continue
            start = need
        capacity = find_capacity(run, request.slo, policy=cand.policy, qps_start=start, rel_tol=0.1,
                                 max_probes=8, qps_max=cand.max_qps_bound).max_qps
        log(f"TP={cand.tp} PP={cand.pp} {cand.policy} budget={cand.token_budget}: {capacity:.3g} QPS "
            f"per replica (ceiling {cand.max_qps_bound:.3g})")
        if capacity <= 0 or math.ceil(request.qps / capacity) * cand.gpus_per_replica > request.max_gpus:
            continue
        replicas = math.ceil(request.qps / capacity)
        deployments.append(Deployment(replicas, cand.tp, cand.pp, cand.policy, cand.token_budget, capacity,
                          replicas * capacity / request.qps - 1))
        deployments.sort(key=lambda p: (p.gpus, -p.headroom))
    return DeploymentSearch(deployments[:request.top], simulated, pruned)


def _candidates(request: DeploymentRequest, specs: Sequence[RequestSpec], prune: Callable[[str], None]
                ) -> list[Candidate]:
    """Every (TP, PP, policy, budget) that passes the checks needing no simulation."""
    hardware = HARDWARE[request.hardware]
    longest = max(r.num_prompt_tokens + r.num_decode_tokens for r in specs)
    mean_len = sum(r.num_prompt_tokens + r.num_decode_tokens for r in specs) / len(specs)
    out = []
    for tp in TP_SIZES:
        if tp > request.gpus_per_node:  # tensor parallelism all-reduces twice a layer: one node
            break
        try:
            cost = VidurCostModel(request.profile, num_layers=request.num_layers, tp=tp, hardware=hardware)
        except ValueError as e:
            if "is not in profile" in str(e):
                continue
            raise
        for pp in range(1, request.num_layers + 1):
            if request.num_layers % pp or tp * pp > request.max_gpus:
                continue
            try:
                num_blocks = cost.kv_cache_blocks(request.block_size, pipeline_stages=pp)
            except ValueError:
                prune("the weights leave no room for the KV cache")
                continue
            if num_blocks * request.block_size < longest:
                prune("the KV cache cannot hold the longest request")
                continue
            if _pass_time(cost, pp, PlanEntry(0, int(mean_len), 1, False, True)) > request.slo.tbt_p99:
                prune("one decode step alone exceeds the TBT SLO")
                continue
            # Little's law on the running requests: each holds a sequence slot (and at
            # least its prompt's KV) for one pipeline pass per output token, at least.
            decoding = [r.num_decode_tokens * _pass_time(cost, pp, PlanEntry(0, r.num_prompt_tokens, 1, False, True))
                        for r in specs]
            held = sum(r.num_prompt_tokens * t for r, t in zip(specs, decoding)) / len(specs)
            kv_bound = num_blocks * request.block_size / held
            for policy in request.policies:
                for budget in _budgets(request, policy, cost, pp, longest, int(mean_len), prune):
                    ceiling = max(n / _stage_time(cost, pp, n) for n in _tiles(budget)) / mean_len
                    seqs_bound = min(request.max_num_seqs, budget) * len(specs) / sum(decoding)
                    out.append(Candidate(tp, pp, policy, budget, num_blocks, min(ceiling, seqs_bound, kv_bound)))
    return out


def _budgets(request: DeploymentRequest, policy: str, cost: VidurCostModel, pp: int, longest: int, context: int,
             prune: Callable[[str], None]) -> list[int]:
    """Unchunked policies batch whole prompts (their cap is the longest request); the
    chunked ones take the given budgets, or the largest tile-aligned step for
    min(32, max_num_seqs) decodes that meets the TBT SLO. With PP stages a request's
    next micro-batch also waits for stage 0 to finish the one issued after it (up to a
    step's 1/PP), so a token's gap is up to (1 + 1/PP) step times: the step gets that
    share of the SLO (at the full SLO, PP's P99 TBT sits at the limit at any load)."""
    if not get_policy(policy).chunked:
        return [longest]
    if request.token_budgets:
        return list(request.token_budgets)
    counts = list(range(BUDGET_TILE // 4, 8193, BUDGET_TILE // 4))
    profile = cost_model_curve(cost, counts, num_decodes=min(32, request.max_num_seqs), context_len=context)
    try:
        tbt = request.slo.tbt_p99 * pp / (pp + 1) if pp > 1 else request.slo.tbt_p99
        return [choose_token_budget(profile, tbt, BUDGET_TILE).token_budget]
    except ValueError:
        prune(f"no {BUDGET_TILE}-aligned token budget meets the TBT SLO")
        return []


def _tiles(budget: int) -> list[int]:
    return sorted({*range(BUDGET_TILE, budget + 1, BUDGET_TILE), budget})


def _plan(entry: PlanEntry) -> BatchPlan:
    plan = BatchPlan(0, entries=[entry])
    if entry.is_prefill:
        plan.num_prefill_tokens = entry.num_tokens
    else:
        plan.num_decode_tokens = entry.num_tokens
    return plan


def _pass_time(cost: VidurCostModel, pp: int, entry: PlanEntry) -> float:
    """Seconds for one micro-batch to go through every stage (a token's TBT floor)."""
    plan = _plan(entry)
    return cost.step_time(plan) + (pp - 1) * cost.comm_time(plan.num_tokens)


def _stage_time(cost: VidurCostModel, pp: int, num_tokens: int) -> float:
    """Seconds one stage is busy with the cheapest n-token micro-batch (a prefill from
    position 0): a full pipeline finishes one micro-batch per stage time."""
    plan = _plan(PlanEntry(0, 0, num_tokens, True, True))
    return cost.step_time(plan) / pp + (cost.comm_time(num_tokens) if pp > 1 else 0.0)


def _runner(request: DeploymentRequest, workload: WorkloadConfig, cand: Candidate, span: float
            ) -> Callable[[float], MetricsSummary]:
    """One simulated run of a replica of `cand` at a rate (each rate simulated once)."""
    hardware = HARDWARE[request.hardware]
    cost = VidurCostModel(request.profile, num_layers=request.num_layers, tp=cand.tp, hardware=hardware)
    # A prompt's next chunk waits for its previous one to leave the pipeline: each
    # micro-batch in flight needs its own partial prompt (as `sarathi-rt capacity`).
    config = SchedulerConfig(policy=cand.policy, token_budget=cand.token_budget,
                             chunk_size=None, max_num_seqs=min(request.max_num_seqs, cand.token_budget),
                             block_size=request.block_size, num_blocks=cand.num_blocks,
                             max_partial_prefills=cand.pp)

    def run(qps: float) -> MetricsSummary:
        # A rate that fails within MIN_SPAN_S fails the longer run too (capacities only
        # fell with longer runs): overloaded runs, the costliest to drain, stay short.
        if span > MIN_SPAN_S and not request.slo.met_by(short := simulated(qps, MIN_SPAN_S)):
            return short
        return simulated(qps, span)

    @functools.lru_cache(maxsize=None)
    def simulated(qps: float, seconds: float) -> MetricsSummary:
        # Arrivals span at least `seconds`, and only the later half is judged: the
        # first requests meet an empty system, and a queue that grows (a rate above
        # what the replica sustains) needs time to push the median delay past its limit.
        num_requests = max(workload.num_requests, math.ceil(qps * seconds))
        requests = make_workload(replace(workload, qps=qps, num_requests=num_requests))
        run_config = config
        if not get_policy(cand.policy).chunked:  # a longer run may hold a longer request
            longest = max(r.num_prompt_tokens + r.num_decode_tokens for r in requests)
            run_config = replace(config, token_budget=max(config.token_budget, longest))
        result = simulate(requests, run_config, cost, pipeline_stages=cand.pp, speculation=request.speculation)
        return summarize(result.requests[len(result.requests) // 2:], result.steps)

    return run

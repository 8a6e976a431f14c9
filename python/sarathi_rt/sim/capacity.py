"""Serving capacity: the highest request rate (QPS) a policy sustains within an SLO.

The paper's definition: P99 time-between-tokens <= the TBT SLO and P50 scheduling
delay <= 2 s. Latencies grow with load, so the largest passing QPS is found by
bracketing (doubling or halving from a start) and then bisection."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from sarathi_rt.measure.metrics import DEFAULT_STALL_FACTOR, MetricsSummary
from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim import CostModel, SimSpeculation, simulate
from sarathi_rt.workloads import WorkloadConfig, make_workload


@dataclass(frozen=True)
class SLO:
    tbt_p99: float
    sched_delay_p50: float = 2.0

    def __post_init__(self) -> None:
        for name in ("tbt_p99", "sched_delay_p50"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")

    def met_by(self, summary: MetricsSummary) -> bool:
        """NaN (no TBT measured, e.g. one-token outputs) counts as met for TBT only."""
        tbt_ok = math.isnan(summary.tbt.p99) or summary.tbt.p99 <= self.tbt_p99
        return tbt_ok and summary.sched_delay.p50 <= self.sched_delay_p50


@dataclass(frozen=True)
class AttainmentSLO:
    """With QoS classes: every class with requests has at least `target` of them
    meeting their deadlines (MetricsSummary.qos)."""

    target: float = 0.99

    def __post_init__(self) -> None:
        if isinstance(self.target, bool) or not isinstance(self.target, (int, float)) or not 0 < self.target <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.target!r}")

    def met_by(self, summary: MetricsSummary) -> bool:
        if not summary.qos:
            raise ValueError("attainment needs QoS classes in the summary (summarize(..., qos_classes))")
        return all(q.attainment >= self.target for q in summary.qos.values() if q.num_requests)


@dataclass(frozen=True)
class Probe:
    qps: float
    tbt_p99: float
    sched_delay_p50: float
    ok: bool


@dataclass
class CapacityResult:
    policy: str
    max_qps: float  # 0.0 when even the lowest probed rate fails
    probes: list[Probe] = field(default_factory=list)

    @property
    def lowest_failing(self) -> float | None:
        """The lowest probed rate above max_qps that failed: the capacity lies between the
        two. None when the probes ran out while every rate passed."""
        return min((p.qps for p in self.probes if not p.ok and p.qps > self.max_qps), default=None)

    @property
    def bounded(self) -> bool:
        """Whether a failing rate bounds max_qps from above; if not, max_qps is only a
        lower bound on the capacity."""
        return self.lowest_failing is not None


class CapacitySearch:
    """The search behind find_capacity, one probe at a time: `next_qps()` names the rate
    to run next (None when done) and `record(summary, passed)` takes its outcome. Grows
    by doubling from `qps_start` until a failure brackets the capacity (or halves until a
    pass when the start fails), then bisects to within `rel_tol` of the upper bound, in
    at most `max_probes` runs. Stepwise so that a benchmark can interleave the searches of
    several configurations round by round: each round's probes then share the machine's
    state, which drifts on a shared host."""

    def __init__(self, policy: str = "", *, qps_start: float = 1.0, rel_tol: float = 0.02, max_probes: int = 30,
                 min_qps: float = 1e-3, qps_max: float = math.inf) -> None:
        if not qps_start > 0:
            raise ValueError(f"qps_start must be > 0, got {qps_start!r}")
        if not 0 < rel_tol < 1:
            raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol!r}")
        if not isinstance(max_probes, int) or max_probes < 2:
            raise ValueError(f"max_probes must be an int >= 2, got {max_probes!r}")
        if not qps_max > 0:
            raise ValueError(f"qps_max must be > 0, got {qps_max!r}")
        self.result = CapacityResult(policy, 0.0)
        self._rel_tol, self._max_probes, self._min_qps, self._qps_max = rel_tol, max_probes, min_qps, qps_max
        self._lo, self._hi = 0.0, min(qps_start, qps_max)
        # grow: probe hi, doubling on a pass; shrink: probe hi / 2 after the start failed;
        # bisect: probe the middle of [lo, hi]. qps_max itself is never probed.
        self._phase = "grow" if self._hi < qps_max else "shrink"

    def next_qps(self) -> float | None:
        if self._phase == "done" or len(self.result.probes) >= self._max_probes:
            return None
        if self._phase == "grow":
            return self._hi
        if self._phase == "shrink":
            if self._hi > self._min_qps:
                return self._hi / 2
            self._phase = "done"
            return None
        if self._hi - self._lo > self._rel_tol * self._hi:
            return (self._lo + self._hi) / 2
        self._phase = "done"
        return None

    def record(self, summary: MetricsSummary, passed: bool) -> None:
        """The outcome of running the rate next_qps() named."""
        qps = self.next_qps()
        if qps is None:
            raise RuntimeError("the search is done: no probe was asked for")
        self.result.probes.append(Probe(qps, summary.tbt.p99, summary.sched_delay.p50, passed))
        if self._phase == "grow":
            if passed:
                self._lo, self._hi = self._hi, min(self._hi * 2, self._qps_max)
                if self._hi >= self._qps_max:
                    self._phase = "bisect"
            else:
                self._phase = "bisect" if self._lo > 0 else "shrink"
        elif self._phase == "shrink":
            if passed:
                self._lo, self._phase = qps, "bisect"
            else:
                self._hi = qps
        elif passed:
            self._lo = qps
        else:
            self._hi = qps
        self.result.max_qps = self._lo


def find_capacity(run: Callable[[float], MetricsSummary], slo: SLO | AttainmentSLO, *, policy: str = "",
                  qps_start: float = 1.0, rel_tol: float = 0.02, max_probes: int = 30,
                  min_qps: float = 1e-3, qps_max: float = math.inf) -> CapacityResult:
    """Largest QPS at which `run(qps)` meets `slo`, to within `rel_tol` (relative),
    using at most `max_probes` runs (CapacitySearch). Assumes latency does not fall as
    load rises. `qps_max`: a rate known to be unsustainable (a throughput ceiling),
    never probed. max_qps is 0.0 when even the lowest probed rate fails."""
    search = CapacitySearch(policy, qps_start=qps_start, rel_tol=rel_tol, max_probes=max_probes, min_qps=min_qps,
                            qps_max=qps_max)
    while (qps := search.next_qps()) is not None:
        summary = run(qps)
        search.record(summary, slo.met_by(summary))
    return search.result


def simulated_capacity(workload: WorkloadConfig, scheduler_config: SchedulerConfig, cost_model: CostModel,
                       slo: SLO | AttainmentSLO, *, pipeline_stages: int = 1, stall_factor: float = DEFAULT_STALL_FACTOR,
                       speculation: SimSpeculation | None = None, **search: float | int) -> CapacityResult:
    """find_capacity on the simulator: the same requests (seeded) at each probed rate."""

    def run(qps: float) -> MetricsSummary:
        requests = make_workload(replace(workload, qps=qps))
        return simulate(requests, scheduler_config, cost_model, pipeline_stages=pipeline_stages,
                        speculation=speculation).summary(stall_factor)

    return find_capacity(run, slo, policy=scheduler_config.policy, **search)  # type: ignore[arg-type]

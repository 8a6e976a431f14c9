"""What the engine and the simulator record: per request and per step, plus the
summaries a serving benchmark reports (P50/P90/P99, generation stalls) and JSON/CSV
export. Times are seconds on one clock (time.perf_counter in the engine, simulated
time in the simulator)."""
from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Iterable, Sequence

from sarathi_rt.scheduler.qos import QoSClass

DEFAULT_STALL_FACTOR = 5.0


@dataclass
class RequestMetrics:
    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finish_time: float | None = None
    num_preemptions: int = 0
    bubble_time: float = 0.0  # pipeline parallelism: its micro-batches' waits for a busy stage
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    qos: str | None = None  # its QoS class
    relegated: bool = False  # the scheduler found it could no longer make its first-token deadline
    # Speculative decoding: proposed tokens its steps verified, and of those the accepted
    # ones (each an output token that cost no step of its own).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tbts(self) -> list[float]:
        """Time between consecutive generated tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def scheduling_delay(self) -> float | None:
        """Time from arrival until the request first ran."""
        s = self.first_scheduled_time
        return None if s is None else s - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_times)


@dataclass
class StepMetrics:
    start_time: float
    duration: float
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int
    tile_padding: int = 0
    predicted_duration: float | None = None  # the adaptive budget's step-time model's forecast


@dataclass
class StageMetrics:
    """One pipeline stage's share of one step (micro-batch), from its tensor rank 0.
    busy: seconds it computed (and posted the send); idle: seconds from the end of its
    previous micro-batch until this one's input was there (waiting for the driver or
    for the previous stage: its bubble). start_time is time.perf_counter in the stage's
    process, the driver's clock too on one host (Linux: CLOCK_MONOTONIC)."""

    step: int
    stage: int
    start_time: float
    busy: float
    idle: float

    @property
    def end_time(self) -> float:
        return self.start_time + self.busy


def pipeline_wait(stages: Sequence[StageMetrics]) -> float:
    """Seconds one micro-batch waited for stages still busy with earlier ones: at each
    stage, from when the previous stage handed it over until the stage had finished its
    previous micro-batch (start_time - idle)."""
    ordered = sorted(stages, key=lambda s: s.stage)
    return sum(max(0.0, (cur.start_time - cur.idle) - prev.end_time) for prev, cur in zip(ordered, ordered[1:]))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default); NaN for no values, so an empty run never looks perfect."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stall_threshold(steps: Sequence[StepMetrics], stall_factor: float = DEFAULT_STALL_FACTOR,
                    requests: Iterable[RequestMetrics] = ()) -> float:
    """A TBT gap longer than this is a generation stall: stall_factor x median step time.
    Without step records (a server measured from outside) the median TBT of `requests`
    stands in for the step time: a running decode gets one token per step."""
    if not stall_factor > 0:
        raise ValueError(f"stall_factor must be > 0, got {stall_factor!r}")
    durations = [s.duration for s in steps] or [g for r in requests for g in r.tbts]
    return stall_factor * percentile(durations, 50)


def count_stalls(requests: Iterable[RequestMetrics], steps: Sequence[StepMetrics],
                 stall_factor: float = DEFAULT_STALL_FACTOR) -> int:
    """TBT gaps, over all requests, longer than `stall_threshold(steps, stall_factor, requests)`."""
    requests = list(requests)
    limit = stall_threshold(steps, stall_factor, requests)
    if math.isnan(limit):
        return 0
    return sum(1 for r in requests for gap in r.tbts if gap > limit)


@dataclass(frozen=True)
class Distribution:
    p50: float
    p90: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99),
                   math.fsum(values) / len(values), max(values))


@dataclass(frozen=True)
class QoSSummary:
    """One QoS class in a run. A request attains its SLO when it finished with its
    first token by arrival + ttft and its i-th later token by arrival + ttft + i * tbt;
    `attainment` is the fraction of the class's requests that did (NaN for none),
    `goodput` those requests per second of the run."""

    num_requests: int
    attainment: float
    goodput: float
    relegated: int
    ttft: Distribution
    tbt: Distribution


def qos_summary(requests: Sequence[RequestMetrics], qos: QoSClass, duration: float) -> QoSSummary:
    """The summary of one class's `requests` over a run of `duration` seconds."""
    met = sum(qos.attained(r.arrival_time, r.token_times, r.finish_time is not None) for r in requests)
    return QoSSummary(len(requests), met / len(requests) if requests else math.nan,
                      met / duration if duration > 0 else math.nan, sum(r.relegated for r in requests),
                      Distribution.of([r.ttft for r in requests if r.ttft is not None]),
                      Distribution.of([g for r in requests for g in r.tbts]))


@dataclass(frozen=True)
class MetricsSummary:
    """What a serving run amounts to. `tokens_per_s` counts generated tokens over the
    span from the first arrival to the last finish."""

    num_requests: int
    num_finished: int
    ttft: Distribution
    tbt: Distribution
    sched_delay: Distribution
    e2e_latency: Distribution
    step_time: Distribution
    stalls: int
    stall_threshold: float
    tokens_per_s: float
    num_generated_tokens: int
    num_steps: int
    num_preemptions: int
    duration: float
    prefix_cache_hit_rate: float = 0.0  # cached / all prompt tokens of the requests
    qos: Mapping[str, QoSSummary] = field(default_factory=dict)  # per QoS class, when classes are known

    def bench_dict(self) -> dict[str, float | int]:
        """The per-policy record of `sarathi-rt bench`'s summary.json."""
        return {"ttft_p50": self.ttft.p50, "ttft_p99": self.ttft.p99,
                "tbt_p50": self.tbt.p50, "tbt_p99": self.tbt.p99,
                "stalls": self.stalls, "tokens_per_s": self.tokens_per_s,
                "sched_delay_p50": self.sched_delay.p50}


def summarize(requests: Sequence[RequestMetrics], steps: Sequence[StepMetrics],
              stall_factor: float = DEFAULT_STALL_FACTOR,
              qos_classes: Mapping[str, QoSClass] | None = None) -> MetricsSummary:
    """P50/P90/P99 of TTFT, TBT, scheduling delay, latency and step time; stalls;
    throughput; with `qos_classes`, each class's attainment (requests by their .qos)."""
    done = [r for r in requests if r.finish_time is not None]
    ttfts = [r.ttft for r in requests if r.ttft is not None]
    delays = [r.scheduling_delay for r in requests if r.scheduling_delay is not None]
    generated = sum(r.num_generated_tokens for r in requests)
    duration = 0.0
    if done:
        duration = max(r.finish_time for r in done) - min(r.arrival_time for r in requests)  # type: ignore[type-var]
    return MetricsSummary(
        num_requests=len(requests), num_finished=len(done),
        ttft=Distribution.of(ttfts), tbt=Distribution.of([g for r in requests for g in r.tbts]),
        sched_delay=Distribution.of(delays),
        e2e_latency=Distribution.of([r.e2e_latency for r in done]),  # type: ignore[misc]
        step_time=Distribution.of([s.duration for s in steps]),
        stalls=count_stalls(requests, steps, stall_factor),
        stall_threshold=stall_threshold(steps, stall_factor, requests),
        tokens_per_s=generated / duration if duration > 0 else math.nan,
        num_generated_tokens=generated, num_steps=len(steps),
        num_preemptions=sum(r.num_preemptions for r in requests), duration=duration,
        prefix_cache_hit_rate=_hit_rate(requests),
        qos={name: qos_summary([r for r in requests if r.qos == name], cls, duration)
             for name, cls in (qos_classes or {}).items()})


def _hit_rate(requests: Sequence[RequestMetrics]) -> float:
    prompt = sum(r.num_prompt_tokens for r in requests)
    return sum(r.num_cached_tokens for r in requests) / prompt if prompt else 0.0


# ------------------------------------------------------------------ export
def save_json(path: str | os.PathLike[str], requests: Sequence[RequestMetrics],
              steps: Sequence[StepMetrics]) -> None:
    """Every record, losslessly: load_json(path) gives back equal lists."""
    with open(path, "w") as f:
        json.dump({"requests": [asdict(r) for r in requests], "steps": [asdict(s) for s in steps]}, f)


def load_json(path: str | os.PathLike[str]) -> tuple[list[RequestMetrics], list[StepMetrics]]:
    with open(path) as f:
        data = json.load(f)
    try:
        return ([RequestMetrics(**r) for r in data["requests"]], [StepMetrics(**s) for s in data["steps"]])
    except (KeyError, TypeError) as e:
        raise ValueError(f"path {os.fspath(path)!r} is not a metrics JSON file: {e}") from None


_REQUEST_CSV = ["arrival_time", "num_prompt_tokens", "first_scheduled_time", "first_token_time",
                "finish_time", "num_preemptions", "bubble_time", "num_cached_tokens", "relegated",
                "token_times"]


def save_requests_csv(path: str | os.PathLike[str], requests: Sequence[RequestMetrics]) -> None:
    """One row per request; token_times as a space-separated list, None as an empty cell.
    repr() keeps every float exact, so load_requests_csv round-trips."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_REQUEST_CSV + ["ttft", "scheduling_delay", "e2e_latency", "qos"])
        for r in requests:
            w.writerow([_cell(getattr(r, k)) for k in _REQUEST_CSV[:-1]]
                       + [" ".join(map(repr, r.token_times))]
                       + [_cell(r.ttft), _cell(r.scheduling_delay), _cell(r.e2e_latency), r.qos or ""])


def load_requests_csv(path: str | os.PathLike[str]) -> list[RequestMetrics]:
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            out.append(RequestMetrics(
                arrival_time=float(row["arrival_time"]), num_prompt_tokens=int(row["num_prompt_tokens"]),
                first_scheduled_time=_opt(row["first_scheduled_time"]),
                first_token_time=_opt(row["first_token_time"]),
                token_times=[float(t) for t in row["token_times"].split()],
                finish_time=_opt(row["finish_time"]), num_preemptions=int(row["num_preemptions"]),
                bubble_time=float(row.get("bubble_time") or 0.0),
                num_cached_tokens=int(row.get("num_cached_tokens") or 0),
                qos=row.get("qos") or None, relegated=row.get("relegated") == "True"))
    return out


def save_steps_csv(path: str | os.PathLike[str], steps: Sequence[StepMetrics]) -> None:
    names = [f.name for f in fields(StepMetrics)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        w.writerows([_cell(getattr(s, k)) for k in names] for s in steps)


def load_steps_csv(path: str | os.PathLike[str]) -> list[StepMetrics]:
    with open(path, newline="") as f:
        return [StepMetrics(float(r["start_time"]), float(r["duration"]), int(r["num_tokens"]),
                            int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]),
                            int(r["batch_size"]), int(r["tile_padding"]), _opt(r.get("predicted_duration") or ""))
                for r in csv.DictReader(f)]


def _cell(value: float | int | None) -> str:
    return "" if value is None else repr(value)


def _opt(cell: str) -> float | None:
    return float(cell) if cell else None

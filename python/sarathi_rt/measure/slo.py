"""SLO-first metrics of a serving run, beside MetricsSummary's percentiles: the tail of
time-between-tokens (P99.9, each request's worst gap), how much of the decodes' waiting
is prefill work, goodput against TTFT and TBT targets, and how well the adaptive
budget's step-time model predicted the steps. The one definition of these numbers:
`bench` and `capacity` print them and the server's /metrics exports them."""
from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass
from typing import Sequence

from .metrics import Distribution, RequestMetrics, StepMetrics, percentile


@dataclass(frozen=True)
class SLOMetrics:
    """tbt_p999 / tbt_max: over every gap of every request. request_max_tbt: each
    request's largest gap, as a distribution over requests. prefill_wait_share: of the
    time between a request's tokens, the share its steps spent on prefill tokens (a step
    counts in proportion to its prefill tokens; a prefill-only step fully). goodput:
    requests per second (from the first arrival to the last finish) that finished
    meeting the targets given (meets_targets); NaN without a target.
    step_error_p50 / p99: |actual - predicted| / actual of the steps that carry a
    prediction; under_predicted: the share of those that took longer than predicted."""

    tbt_p999: float
    tbt_max: float
    request_max_tbt: Distribution
    prefill_wait_share: float
    goodput: float
    ttft_target: float | None
    tbt_target: float | None
    step_error_p50: float
    step_error_p99: float
    under_predicted: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def prefill_wait_share(requests: Sequence[RequestMetrics], steps: Sequence[StepMetrics]) -> float:
    """See SLOMetrics. Steps are taken in start order and as not overlapping (one stage)."""
    ordered = sorted(steps, key=lambda s: s.start_time)
    starts = [s.start_time for s in ordered]
    shares = [s.num_prefill_tokens / s.num_tokens if s.num_tokens else 0.0 for s in ordered]
    cum = [0.0]  # prefill-weighted time before each step starts
    for s, share in zip(ordered, shares):
        cum.append(cum[-1] + share * s.duration)

    def prefill_time_until(t: float) -> float:
        j = bisect.bisect_right(starts, t) - 1
        if j < 0:
            return 0.0
        s = ordered[j]
        return cum[j] + shares[j] * min(max(t - s.start_time, 0.0), s.duration)

    waited = total = 0.0
    for r in requests:
        times = r.token_times
        if len(times) > 1:
            total += times[-1] - times[0]
            waited += prefill_time_until(times[-1]) - prefill_time_until(times[0])
    return waited / total if total > 0 else math.nan


def meets_targets(r: RequestMetrics, ttft_target: float | None, tbt_target: float | None) -> bool:
    """Goodput's test of one finished request: TTFT <= ttft_target and its own P99 TBT
    (its worst gap, under 100 gaps) <= tbt_target; a target of None is not tested."""
    if r.finish_time is None:
        return False
    if ttft_target is not None and (r.ttft is None or r.ttft > ttft_target):
        return False
    return tbt_target is None or not r.tbts or percentile(r.tbts, 99) <= tbt_target


def goodput(requests: Sequence[Sequence[RequestMetrics]], ttft_target: float | None = None,
            tbt_target: float | None = None) -> float:
    """See SLOMetrics; each request is given as its samples (several with n > 1), and is
    good only when every sample finished meeting the targets: its response is complete
    with its slowest choice. NaN without a target or a finished request."""
    for name, value in (("ttft_target", ttft_target), ("tbt_target", tbt_target)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number of seconds or None, got {value!r}")
    done = [r for r in requests if r and all(s.finish_time is not None for s in r)]
    if (ttft_target is None and tbt_target is None) or not done:
        return math.nan
    last = max(s.finish_time for r in done for s in r)  # type: ignore[type-var]
    span = last - min(s.arrival_time for r in requests for s in r)
    good = sum(1 for r in done if all(meets_targets(s, ttft_target, tbt_target) for s in r))
    return good / span if span > 0 else math.nan


def slo_metrics(requests: Sequence[RequestMetrics], steps: Sequence[StepMetrics],
                ttft_target: float | None = None, tbt_target: float | None = None) -> SLOMetrics:
    good = goodput([(r,) for r in requests], ttft_target, tbt_target)  # first: it checks the targets
    gaps = [g for r in requests for g in r.tbts]
    worst = [max(r.tbts) for r in requests if len(r.token_times) > 1]
    predicted = [(s.duration, s.predicted_duration) for s in steps if s.predicted_duration is not None]
    errors = [abs(a - p) / a for a, p in predicted if a > 0 and math.isfinite(p)]
    under = sum(1 for a, p in predicted if a > p) / len(predicted) if predicted else math.nan
    return SLOMetrics(tbt_p999=percentile(gaps, 99.9), tbt_max=max(gaps, default=math.nan),
                      request_max_tbt=Distribution.of(worst), prefill_wait_share=prefill_wait_share(requests, steps),
                      goodput=good, ttft_target=ttft_target, tbt_target=tbt_target,
                      step_error_p50=percentile(errors, 50), step_error_p99=percentile(errors, 99),
                      under_predicted=under)

"""The server's /metrics: counters and histograms it keeps itself, gauges read from the
engine, written in the Prometheus text exposition format (version 0.0.4). The SLO gauges
(P99.9 and max TBT, prefill-wait share, goodput) are measure.slo's, over the last
SLO_WINDOW finished requests and the engine's steps in their span."""
from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sarathi_rt.engine import LLMEngine
from sarathi_rt.measure.metrics import RequestMetrics
from sarathi_rt.measure.slo import goodput, meets_targets, slo_metrics
from sarathi_rt.scheduler import QoSClass

# Seconds; TTFT spans queueing and prefill, TBT one step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TBT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
WORST_END_FIRST = ("abort", "length", "stop")  # how a sample can end, the least complete first


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return out + [f"{name}_sum {self.total!r}", f"{name}_count {self.count}"]


class ServerStats:
    """requests by status: a finish reason (stop, length, abort), or bad_request,
    overloaded or error for requests refused or failed before they finished. A request
    counts once however many samples (n) it has; see `finished`.
    ttft_target / tbt_target (seconds): goodput's targets (measure.slo.meets_targets);
    without either, goodput is NaN and no request counts as good. qos_classes: the
    engine's; finished requests are then counted per class, with those that met every
    deadline of their class (attained) and those the scheduler relegated."""

    SLO_WINDOW = 1000  # finished requests the SLO gauges look back over

    def __init__(self, ttft_target: float | None = None, tbt_target: float | None = None,
                 qos_classes: Mapping[str, QoSClass] | None = None) -> None:
        for name, value in (("ttft_target", ttft_target), ("tbt_target", tbt_target)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number of seconds or None, got {value!r}")
        self.ttft_target, self.tbt_target = ttft_target, tbt_target
        self.requests: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tbt = Histogram(TBT_BUCKETS)
        self.request_max_tbt = Histogram(TBT_BUCKETS)
        self.good = 0
        # The samples of each request whose every sample reported its end.
        self.recent: deque[tuple[RequestMetrics, ...]] = deque(maxlen=self.SLO_WINDOW)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.qos_classes = qos_classes or {}
        self.qos_requests: Counter[str] = Counter()
        self.qos_attained: Counter[str] = Counter()
        self.qos_relegated: Counter[str] = Counter()

    def finished(self, samples: Sequence[tuple[str, RequestMetrics]], num_samples: int | None = None) -> None:
        """Count a request that ended, once. `samples`: (finish reason, metrics) of each of
        its samples that reported its end; `num_samples`: how many it had (default: that
        many), the others ended unseen (its client left first) and count as aborted.

        Its status is the least complete end among its samples, abort before length
        before stop: a response is only as whole as its least complete choice, and the
        status does not hang on which sample happened to end last. Its prompt tokens, its
        TTFT (the first token of any sample) and its largest gap between tokens count
        once; generated tokens and every gap count over all samples. It is good (it met
        the TTFT and TBT targets) and attained (it met every deadline of its QoS class,
        and did not abort) only if every sample did, since the client waits for all of
        them; it is relegated if its samples were (they share the first-token deadline)."""
        num_samples = len(samples) if num_samples is None else num_samples
        if num_samples < max(len(samples), 1):
            raise ValueError(f"num_samples must be >= 1 and >= the {len(samples)} samples given, got {num_samples}")
        ends = {reason for reason, _ in samples} | ({"abort"} if len(samples) < num_samples else set())
        if not ends <= set(WORST_END_FIRST):
            raise ValueError(f"samples: a finish reason must be one of {WORST_END_FIRST}, got {sorted(ends)}")
        status = next(end for end in WORST_END_FIRST if end in ends)
        self.requests[status] += 1
        metrics = [m for _, m in samples]
        if not metrics:
            return  # nothing was measured
        first_tokens = [m.ttft for m in metrics if m.ttft is not None]
        if first_tokens:
            self.ttft.observe(min(first_tokens))
        gaps = [gap for m in metrics for gap in m.tbts]
        for gap in gaps:
            self.tbt.observe(gap)
        if gaps:
            self.request_max_tbt.observe(max(gaps))
        if len(metrics) == num_samples:  # a sample that ended unseen cannot be judged good
            self.recent.append(tuple(metrics))
            if (self.ttft_target is not None or self.tbt_target is not None) and \
                    all(meets_targets(m, self.ttft_target, self.tbt_target) for m in metrics):
                self.good += 1
        self.prompt_tokens += metrics[0].num_prompt_tokens
        self.generation_tokens += sum(m.num_generated_tokens for m in metrics)
        name = metrics[0].qos or ""
        qos = self.qos_classes.get(name)
        if qos is not None:
            self.qos_requests[name] += 1
            self.qos_attained[name] += status != "abort" and \
                all(qos.attained(m.arrival_time, m.token_times, True) for m in metrics)
            self.qos_relegated[name] += any(m.relegated for m in metrics)

    def slo_gauges(self, engine: LLMEngine) -> list[tuple[str, str, float]]:
        """(name, help, value) of each SLO gauge; NaN where the window has nothing to measure."""
        requests = list(self.recent)
        samples = [m for request in requests for m in request]
        starts = [m.token_times[0] for m in samples if m.token_times]
        # list() copies the deque in one C call: the engine's thread may append meanwhile.
        steps = [s for s in list(engine.step_metrics) if starts and s.start_time + s.duration >= min(starts)]
        m = slo_metrics(samples, steps)  # the gaps, over every sample; goodput counts requests
        return [("sarathi_rt_slo_window_requests", "Finished requests the SLO gauges cover (the latest, "
                                                   f"at most {self.SLO_WINDOW}).", float(len(requests))),
                ("sarathi_rt_time_between_tokens_p999_seconds", "P99.9 of every gap between tokens.", m.tbt_p999),
                ("sarathi_rt_time_between_tokens_max_seconds", "Largest gap between tokens.", m.tbt_max),
                ("sarathi_rt_prefill_wait_share", "Share of the time between tokens spent on prefill work.",
                 m.prefill_wait_share),
                ("sarathi_rt_goodput_requests_per_second", "Requests per second meeting the TTFT and TBT targets.",
                 goodput(requests, self.ttft_target, self.tbt_target))]

    def render(self, engine: LLMEngine) -> str:
        scheduler = engine.scheduler
        total_blocks = engine.scheduler_config.num_blocks
        series: list[tuple[str, str, str, list[str]]] = [
            ("sarathi_rt_requests_total", "counter", "Requests by final status.",
             [f'sarathi_rt_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]),
            ("sarathi_rt_time_to_first_token_seconds", "histogram", "Time to first token.",
             self.ttft.lines("sarathi_rt_time_to_first_token_seconds")),
            ("sarathi_rt_time_between_tokens_seconds", "histogram", "Time between consecutive tokens.",
             self.tbt.lines("sarathi_rt_time_between_tokens_seconds")),
            ("sarathi_rt_request_max_time_between_tokens_seconds", "histogram",
             "Each finished request's largest gap between tokens.",
             self.request_max_tbt.lines("sarathi_rt_request_max_time_between_tokens_seconds")),
            ("sarathi_rt_requests_good_total", "counter", "Finished requests that met the TTFT and TBT targets.",
             [f"sarathi_rt_requests_good_total {self.good}"]),
            ("sarathi_rt_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
             [f"sarathi_rt_prompt_tokens_total {self.prompt_tokens}"]),
            ("sarathi_rt_generation_tokens_total", "counter", "Tokens generated by finished requests (every sample's).",
             [f"sarathi_rt_generation_tokens_total {self.generation_tokens}"]),
            ("sarathi_rt_requests_running", "gauge", "Requests holding KV blocks (prefilling or decoding).",
             [f"sarathi_rt_requests_running {scheduler.num_running}"]),
            ("sarathi_rt_requests_waiting", "gauge", "Requests queued for their first step.",
             [f"sarathi_rt_requests_waiting {scheduler.num_waiting}"]),
            ("sarathi_rt_kv_blocks_in_use", "gauge", "KV cache blocks in use.",
             [f"sarathi_rt_kv_blocks_in_use {total_blocks - scheduler.num_free_blocks}"]),
            ("sarathi_rt_kv_blocks_total", "gauge", "KV cache blocks.",
             [f"sarathi_rt_kv_blocks_total {total_blocks}"]),
        ] + [(name, "gauge", help_text, [f"{name} {_number(value)}"])
             for name, help_text, value in self.slo_gauges(engine)] + self._qos_series()
        lines = []
        for name, kind, help_text, samples in series:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"] + samples
        return "\n".join(lines) + "\n"


    def _qos_series(self) -> list[tuple[str, str, str, list[str]]]:
        if not self.qos_classes:
            return []
        names = list(self.qos_classes)

        def per_class(counter: Counter[str]) -> list[str]:
            return [f'{{qos_class="{c}"}} {counter[c]}' for c in names]

        attainment = [f'{{qos_class="{c}"}} {_number(self.qos_attained[c] / self.qos_requests[c])}'
                      if self.qos_requests[c] else f'{{qos_class="{c}"}} NaN' for c in names]
        return [(name, kind, help_text, [name + s for s in samples]) for name, kind, help_text, samples in [
            ("sarathi_rt_qos_requests_total", "counter", "Finished requests per QoS class (service tier).",
             per_class(self.qos_requests)),
            ("sarathi_rt_qos_attained_total", "counter", "Finished requests that met every deadline of their class.",
             per_class(self.qos_attained)),
            ("sarathi_rt_qos_relegated_total", "counter",
             "Finished requests relegated (they could no longer make their first-token deadline).",
             per_class(self.qos_relegated)),
            ("sarathi_rt_qos_attainment", "gauge", "Share of a class's finished requests that met every deadline.",
             attainment)]]


def _number(x: float) -> str:
    return "NaN" if math.isnan(x) else repr(x)

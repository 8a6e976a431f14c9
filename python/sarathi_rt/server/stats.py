"""The server's /metrics, through prometheus_client on a registry of the server's own (a
process may run several servers, the tests many): counters and histograms updated as
each request ends, gauges and the engine's own counters read from the engine at scrape
time. Series carry vLLM's names and `model_name` label under the prefix `sarathi_rt:`
(vllm:time_to_first_token_seconds is sarathi_rt:time_to_first_token_seconds), so a vLLM
dashboard works after a prefix change; docs/metrics.md lists every series. The SLO
gauges (P99.9 and max time between tokens, prefill-wait share, goodput, stalls, QoS
attainment) are measure.slo's, over the last SLO_WINDOW finished requests and the
engine's steps in their span."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from sarathi_rt.engine import LLMEngine
from sarathi_rt.measure.metrics import DEFAULT_STALL_FACTOR, RequestMetrics, count_stalls
from sarathi_rt.measure.slo import goodput, meets_targets, slo_metrics

PREFIX = "sarathi_rt:"
# vLLM's buckets, so bucket-wise panels line up; the time between tokens and the request
# phases get finer ones below vLLM's smallest, where a decode step and a short queue lie.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
WORST_END_FIRST = ("abort", "length", "stop")  # how a sample can end, the least complete first
FAILURES = ("bad_request", "overloaded", "error")  # how a request can fail to get a completion


class ServerStats:
    """The /metrics of a server of `engine` serving `model_name`. A request counts once
    however many samples (n) it has; see `finished`. One refused or failed before it
    finished counts by `failed`. ttft_target / tbt_target (seconds): goodput's targets
    (measure.slo.meets_targets); without either, goodput is NaN and no request counts
    as good. With the engine's QoS classes, finished requests are counted per class,
    with those that met every deadline of their class (attained) and those the
    scheduler relegated."""

    SLO_WINDOW = 1000  # finished requests the SLO gauges look back over

    def __init__(self, engine: LLMEngine, model_name: str, ttft_target: float | None = None,
                 tbt_target: float | None = None) -> None:
        for name, value in (("ttft_target", ttft_target), ("tbt_target", tbt_target)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number of seconds or None, got {value!r}")
        self.engine, self.model_name = engine, model_name
        self.ttft_target, self.tbt_target = ttft_target, tbt_target
        self.qos_classes = engine.scheduler_config.qos_classes or {}
        # Each whole request (every sample reported its end): its samples, and whether it
        # attained its QoS class.
        self.recent: deque[tuple[tuple[RequestMetrics, ...], bool]] = deque(maxlen=self.SLO_WINDOW)
        self.registry = CollectorRegistry()
        self.registry.register(self)  # collect(): the series read at scrape time

        def counter(name: str, doc: str, label: str | None = None, values: Sequence[str] = ()) -> Counter:
            family = Counter(PREFIX + name, doc, ["model_name"] + ([label] if label else []), registry=self.registry)
            for value in values:  # shown at 0 from the start, so rate() sees the first one
                family.labels(model_name, value)
            return family if label else family.labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.success = counter("request_success", "Requests that finished, by the least complete end of their "
                               "samples (abort, length, stop).", "finished_reason", WORST_END_FIRST)
        self.failures = counter("request_failures", "Requests answered with an error instead of a completion: "
                                "bad_request (4xx), overloaded (503), error (the engine or server failed).",
                                "reason", FAILURES)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests (once per request).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated by finished requests "
                                         "(every sample's).")
        self.good = counter("good_requests", "Finished requests whose every sample met the TTFT and TBT targets.")
        qos = list(self.qos_classes)
        self.qos_requests = counter("qos_requests", "Finished requests per QoS class (service tier).",
                                    "qos_class", qos)
        self.qos_attained = counter("qos_attained", "Finished requests that met every deadline of their class.",
                                    "qos_class", qos)
        self.qos_relegated = counter("qos_relegated", "Finished requests relegated (they could no longer make "
                                     "their first-token deadline).", "qos_class", qos)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to a request's first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a sample.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to a request's last sample's end.",
                             LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time from arrival to a request's first step.",
                               LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time from a request's first step to its first "
                                 "token.", LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Time from a request's first token to the last "
                                "token of any of its samples.", LATENCY_BUCKETS)
        self.request_max_itl = histogram("request_max_inter_token_latency_seconds", "Each finished request's "
                                         "largest gap between tokens, over its samples.", ITL_BUCKETS)

    def failed(self, reason: str) -> None:
        """Count a request refused or failed before it finished: one of FAILURES."""
        if reason not in FAILURES:
            raise ValueError(f"reason must be one of {FAILURES}, got {reason!r}")
        self.failures.labels(self.model_name, reason).inc()

    def finished(self, samples: Sequence[tuple[str, RequestMetrics]], num_samples: int | None = None) -> None:
        """Count a request that ended, once. `samples`: (finish reason, metrics) of each of
        its samples that reported its end; `num_samples`: how many it had (default: that
        many), the others ended unseen (its client left first) and count as aborted.

        Its status is the least complete end among its samples, abort before length
        before stop: a response is only as whole as its least complete choice, and the
        status does not hang on which sample happened to end last. Its prompt tokens, its
        TTFT (the first token of any sample) and its largest gap between tokens count
        once; generated tokens and every gap count over all samples. Its queue, prefill,
        decode and end-to-end times count once, and only if every sample reported its end
        (one that ended unseen has no end to measure). It is good (it met the TTFT and TBT
        targets) and attained (it met every deadline of its QoS class, and did not abort)
        only if every sample did, since the client waits for all of them; it is relegated
        if its samples were (they share the first-token deadline)."""
        num_samples = len(samples) if num_samples is None else num_samples
        if num_samples < max(len(samples), 1):
            raise ValueError(f"num_samples must be >= 1 and >= the {len(samples)} samples given, got {num_samples}")
        ends = {reason for reason, _ in samples} | ({"abort"} if len(samples) < num_samples else set())
        if not ends <= set(WORST_END_FIRST):
            raise ValueError(f"samples: a finish reason must be one of {WORST_END_FIRST}, got {sorted(ends)}")
        status = next(end for end in WORST_END_FIRST if end in ends)
        self.success.labels(self.model_name, status).inc()
        metrics = [m for _, m in samples]
        if not metrics:
            return  # nothing was measured
        self.prompt_tokens.inc(metrics[0].num_prompt_tokens)
        self.generation_tokens.inc(sum(m.num_generated_tokens for m in metrics))
        first_tokens = [m.first_token_time for m in metrics if m.first_token_time is not None]
        if first_tokens:
            self.ttft.observe(min(first_tokens) - metrics[0].arrival_time)
        gaps = [gap for m in metrics for gap in m.tbts]
        for gap in gaps:
            self.itl.observe(gap)
        if gaps:
            self.request_max_itl.observe(max(gaps))
        name = metrics[0].qos or ""
        qos = self.qos_classes.get(name)
        attained = qos is not None and status != "abort" and \
            all(qos.attained(m.arrival_time, m.token_times, True) for m in metrics)
        if qos is not None:
            self.qos_requests.labels(self.model_name, name).inc()
            self.qos_attained.labels(self.model_name, name).inc(attained)
            self.qos_relegated.labels(self.model_name, name).inc(any(m.relegated for m in metrics))
        if len(metrics) == num_samples:
            self._whole(metrics, attained)

    def _whole(self, metrics: list[RequestMetrics], attained: bool) -> None:
        """The phases of a request whose every sample reported its end."""
        self.recent.append((tuple(metrics), attained))
        if (self.ttft_target is not None or self.tbt_target is not None) and \
                all(meets_targets(m, self.ttft_target, self.tbt_target) for m in metrics):
            self.good.inc()
        arrival = metrics[0].arrival_time
        scheduled = min((m.first_scheduled_time for m in metrics if m.first_scheduled_time is not None), default=None)
        first = min((m.first_token_time for m in metrics if m.first_token_time is not None), default=None)
        finished = [m.finish_time for m in metrics if m.finish_time is not None]
        if len(finished) == len(metrics):
            self.e2e.observe(max(finished) - arrival)
        if scheduled is not None:
            self.queue.observe(scheduled - arrival)
            if first is not None:
                self.prefill.observe(first - scheduled)
        if first is not None:
            self.decode.observe(max(m.token_times[-1] for m in metrics if m.token_times) - first)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition the `accept` header asks for (OpenMetrics, or the text format by
        default), and its content type."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type

    def collect(self) -> Iterator[Metric]:
        """The series read at scrape time: the engine's state and counters, the SLO gauges."""
        engine, scheduler = self.engine, self.engine.scheduler
        total_blocks = engine.scheduler_config.num_blocks
        yield self._gauge("num_requests_running", "Requests holding KV blocks (prefilling or decoding).",
                          scheduler.num_running)
        yield self._gauge("num_requests_waiting", "Requests queued for their first step.", scheduler.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Share of the KV cache blocks in use (1 is all of them).",
                          (total_blocks - scheduler.num_free_blocks) / total_blocks)
        cache = engine.prefix_cache_stats()
        for name, doc, value in (
                ("num_preemptions", "Preemptions of samples by the scheduler (their KV recomputed later).",
                 engine.num_preemptions),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", cache.queries),
                ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", cache.hits),
                ("spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens verified.",
                 engine.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Speculative decoding: verified proposals accepted (tokens "
                 "generated without a step of their own).", engine.num_accepted_tokens)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        yield self._gauge("spec_decode_acceptance_rate", "Share of the verified proposals accepted, since start "
                          "(NaN before the first).", engine.num_accepted_tokens / engine.num_draft_tokens
                          if engine.num_draft_tokens else math.nan)
        yield from self._slo_gauges()

    def _slo_gauges(self) -> Iterator[Metric]:
        """NaN where the window has nothing to measure."""
        requests = [samples for samples, _ in self.recent]
        samples = [m for request in requests for m in request]
        starts = [m.token_times[0] for m in samples if m.token_times]
        # list() copies the deque in one C call: the engine's thread may append meanwhile.
        steps = [s for s in list(self.engine.step_metrics) if starts and s.start_time + s.duration >= min(starts)]
        m = slo_metrics(samples, steps)  # the gaps, over every sample; goodput counts requests
        yield self._gauge("slo_window_requests", "Finished requests the SLO gauges cover (the latest whole ones, "
                          f"at most {self.SLO_WINDOW}).", len(requests))
        yield self._gauge("inter_token_latency_p999_seconds", "P99.9 of every gap between tokens.", m.tbt_p999)
        yield self._gauge("inter_token_latency_max_seconds", "Largest gap between tokens.", m.tbt_max)
        yield self._gauge("prefill_wait_share", "Share of the time between tokens spent on prefill work.",
                          m.prefill_wait_share)
        yield self._gauge("goodput_requests_per_second", "Requests per second meeting the TTFT and TBT targets.",
                          goodput(requests, self.ttft_target, self.tbt_target))
        yield self._gauge("generation_stalls", f"Gaps between tokens longer than {DEFAULT_STALL_FACTOR:g}x the "
                          "median step time.", count_stalls(samples, steps))
        if self.qos_classes:
            family = GaugeMetricFamily(PREFIX + "qos_attainment", "Share of a class's requests that met every "
                                       "deadline of their class.", labels=["model_name", "qos_class"])
            for name in self.qos_classes:
                attained = [ok for request, ok in self.recent if request[0].qos == name]
                family.add_metric([self.model_name, name], sum(attained) / len(attained) if attained else math.nan)
            yield family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

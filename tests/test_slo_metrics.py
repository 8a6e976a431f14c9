"""SLO-first metrics on hand-made timelines."""
from __future__ import annotations

import math

import pytest

from sarathi_rt.measure.metrics import RequestMetrics, StepMetrics, load_steps_csv, save_steps_csv
from sarathi_rt.measure.slo import prefill_wait_share, slo_metrics


def _timeline() -> tuple[list[RequestMetrics], list[StepMetrics]]:
    # Steps: [0, 1) prefill only, [1, 2) one decode, [2, 4) 3 prefill + 1 decode tokens.
    steps = [StepMetrics(0.0, 1.0, 8, 8, 0, 1), StepMetrics(1.0, 1.0, 1, 0, 1, 1),
             StepMetrics(2.0, 2.0, 4, 3, 1, 2, predicted_duration=1.6)]
    a = RequestMetrics(0.0, 8, 0.0, 1.0, [1.0, 2.0, 4.0], 4.0)  # gaps 1 and 2
    b = RequestMetrics(1.5, 3, 2.0, 4.0, [4.0], 4.0)  # one token, no gap
    return [a, b], steps


def test_prefill_wait_share_and_tails() -> None:
    requests, steps = _timeline()
    # a waits 3 s between its tokens: 0 s of prefill in [1, 2), 2 s x 3/4 in [2, 4).
    assert prefill_wait_share(requests, steps) == pytest.approx(1.5 / 3)
    m = slo_metrics(requests, steps, ttft_target=1.5, tbt_target=1.5)
    assert m.tbt_max == 2.0 and m.tbt_p999 == pytest.approx(1 + 0.999)
    assert m.request_max_tbt.p50 == 2.0
    # a: TTFT 1 s, but its worst gap 2 s > 1.5; b: TTFT 2.5 s: none meets both.
    assert m.goodput == 0.0
    assert slo_metrics(requests, steps, ttft_target=3.0, tbt_target=2.0).goodput == pytest.approx(2 / 4)
    assert math.isnan(slo_metrics(requests, steps).goodput)
    # One target alone: a meets TTFT <= 1.5 (b does not); both meet TBT <= 2.
    assert slo_metrics(requests, steps, ttft_target=1.5).goodput == pytest.approx(1 / 4)
    assert slo_metrics(requests, steps, tbt_target=2.0).goodput == pytest.approx(2 / 4)
    assert m.step_error_p50 == pytest.approx(0.2) and m.under_predicted == 1.0
    with pytest.raises(ValueError, match="ttft_target"):
        slo_metrics(requests, steps, ttft_target=-1.0)


def test_predicted_duration_round_trips_through_csv(tmp_path) -> None:
    _, steps = _timeline()
    save_steps_csv(tmp_path / "s.csv", steps)
    assert load_steps_csv(tmp_path / "s.csv") == steps


def _engine(steps: list[StepMetrics], qos_classes: dict | None = None) -> object:
    """What ServerStats reads of an engine: 2 of 8 KV blocks in use, 1 request running,
    2 waiting, 3 preemptions, 40 prompt tokens looked up in the prefix cache, 16 hits,
    10 speculative proposals verified, 4 accepted."""
    from types import SimpleNamespace

    from sarathi_rt.scheduler.prefix_cache import PrefixCacheStats

    return SimpleNamespace(step_metrics=steps, num_preemptions=3, prefix_cache_stats=lambda: PrefixCacheStats(40, 16),
                           num_draft_tokens=10, num_accepted_tokens=4,
                           scheduler_config=SimpleNamespace(num_blocks=8, qos_classes=qos_classes),
                           scheduler=SimpleNamespace(num_running=1, num_waiting=2, num_free_blocks=6))


def _scraped(stats) -> dict[str, float]:
    from metrics_text import samples

    body, content_type = stats.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    return samples(body.decode())


def test_server_metrics_export_the_same_slo_numbers() -> None:
    """/metrics' SLO gauges and counters are slo_metrics' over the finished requests and
    the engine's steps: one definition for bench, capacity and the server; the request
    phases are RequestMetrics'; the engine's gauges and counters are read at scrape time."""
    pytest.importorskip("prometheus_client")
    from sarathi_rt.server.stats import ServerStats

    requests, steps = _timeline()
    stats = ServerStats(_engine(steps), "tiny", ttft_target=3.0, tbt_target=2.0)  # type: ignore[arg-type]
    for r in requests:
        stats.finished([("length", r)])
    got = _scraped(stats)
    m = slo_metrics(requests, steps, 3.0, 2.0)
    p = "sarathi_rt:"
    assert got[p + "inter_token_latency_p999_seconds"] == m.tbt_p999
    assert got[p + "inter_token_latency_max_seconds"] == m.tbt_max == 2.0
    assert got[p + "prefill_wait_share"] == m.prefill_wait_share == pytest.approx(0.5)
    assert got[p + "goodput_requests_per_second"] == m.goodput == pytest.approx(0.5)
    assert got[p + "good_requests_total"] == 2 and got[p + "slo_window_requests"] == 2
    assert got[p + "generation_stalls"] == 0  # gaps of 1 and 2 s; the median step takes 1 s
    assert got[f'{p}request_max_inter_token_latency_seconds_bucket{{le="+Inf"}}'] == 1  # b has no gap
    assert got["gauge sarathi_rt:prefill_wait_share"] == got["histogram sarathi_rt:e2e_request_latency_seconds"] == 1
    assert got[f'{p}request_success_total{{finished_reason="length"}}'] == 2
    assert got[f'{p}request_success_total{{finished_reason="abort"}}'] == 0  # shown before the first one
    assert got[p + "prompt_tokens_total"] == 8 + 3 and got[p + "generation_tokens_total"] == 3 + 1
    # (count, sum) of each phase: a arrives at 0, runs at 0, first token 1, last 4; b: 1.5, 2, 4, 4.
    for name, count, total in (("time_to_first_token_seconds", 2, 1.0 + 2.5),
                               ("inter_token_latency_seconds", 2, 1.0 + 2.0),
                               ("e2e_request_latency_seconds", 2, 4.0 + 2.5),
                               ("request_queue_time_seconds", 2, 0.0 + 0.5),
                               ("request_prefill_time_seconds", 2, 1.0 + 2.0),
                               ("request_decode_time_seconds", 2, 3.0 + 0.0)):
        assert (got[f"{p}{name}_count"], got[f"{p}{name}_sum"]) == (count, pytest.approx(total)), name
    assert (got[p + "num_requests_running"], got[p + "num_requests_waiting"]) == (1, 2)
    assert got[p + "kv_cache_usage_perc"] == 2 / 8
    assert got[p + "num_preemptions_total"] == 3
    assert (got[p + "prefix_cache_queries_total"], got[p + "prefix_cache_hits_total"]) == (40, 16)
    # A gap of 10.5 s, over 5x the median step: a stall.
    stats.finished([("stop", RequestMetrics(5.0, 2, 5.0, 5.5, [5.5, 16.0], 16.0))])
    assert _scraped(stats)[p + "generation_stalls"] == 1
    untargeted = _scraped(ServerStats(_engine(steps), "tiny"))  # type: ignore[arg-type]
    assert math.isnan(untargeted[p + "goodput_requests_per_second"]) and untargeted[p + "good_requests_total"] == 0
    with pytest.raises(ValueError, match="tbt_target"):
        ServerStats(_engine(steps), "tiny", tbt_target=0.0)  # type: ignore[arg-type]


def test_server_stats_count_failures_by_reason() -> None:
    pytest.importorskip("prometheus_client")
    from sarathi_rt.server.stats import ServerStats

    stats = ServerStats(_engine([]), "tiny")  # type: ignore[arg-type]
    stats.failed("overloaded")
    stats.failed("overloaded")
    stats.failed("error")
    with pytest.raises(ValueError, match="reason must be one of"):
        stats.failed("teapot")
    got = _scraped(stats)
    assert {r: got[f'sarathi_rt:request_failures_total{{reason="{r}"}}'] for r in ("bad_request", "overloaded",
                                                                                   "error")} == \
        {"bad_request": 0, "overloaded": 2, "error": 1}
    body, content_type = stats.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


def test_server_stats_count_a_request_of_several_samples_once() -> None:
    """n > 1: one request with its status, prompt tokens, TTFT and goodput once; generated
    tokens and gaps over every sample; good and attained only if every sample is."""
    pytest.importorskip("prometheus_client")
    from sarathi_rt.scheduler import QoSClass
    from sarathi_rt.server.stats import ServerStats

    engine = _engine([], qos_classes={"chat": QoSClass(ttft=2.0, tbt=1.5)})
    stats = ServerStats(engine, "tiny", ttft_target=2.0, tbt_target=1.5)  # type: ignore[arg-type]

    def sample(times: list[float], relegated: bool = False) -> RequestMetrics:
        return RequestMetrics(0.0, 8, 0.0, times[0], times, times[-1], qos="chat", relegated=relegated)

    stats.finished([("stop", sample([1.0, 2.0])), ("length", sample([1.0, 2.0, 3.0]))])  # good, attained
    # Sample 1's gap of 3 s misses the TBT target and its second token's deadline (3.5 s).
    stats.finished([("length", sample([1.0, 4.0], relegated=True)), ("stop", sample([1.0, 2.0], relegated=True))])
    stats.finished([("stop", sample([1.0]))], num_samples=2)  # the client left before sample 1 ended
    got = _scraped(stats)
    p = "sarathi_rt:"
    assert {end: got[f'{p}request_success_total{{finished_reason="{end}"}}'] for end in ("stop", "length", "abort")} \
        == {"stop": 0, "length": 2, "abort": 1}
    assert got[p + "prompt_tokens_total"] == 3 * 8 and got[p + "generation_tokens_total"] == 2 + 3 + 2 + 2 + 1
    assert got[p + "time_to_first_token_seconds_count"] == 3
    assert got[p + "inter_token_latency_seconds_count"] == 1 + 2 + 1 + 1
    assert got[p + "request_max_inter_token_latency_seconds_count"] == 2
    # The phases of the two whole requests only: the third's second sample has no end.
    assert got[p + "e2e_request_latency_seconds_count"] == got[p + "request_decode_time_seconds_count"] == 2
    assert got[p + "e2e_request_latency_seconds_sum"] == 3.0 + 4.0  # each request's last sample's end
    assert got[p + "good_requests_total"] == 1
    assert [got[f'{p}qos_{name}_total{{qos_class="chat"}}'] for name in ("requests", "attained", "relegated")] \
        == [3, 1, 1]
    # The window holds the two whole requests, one good and attained, from 0 s to the last finish at 4 s.
    assert got[p + "slo_window_requests"] == 2
    assert got[p + "goodput_requests_per_second"] == pytest.approx(1 / 4)
    assert got[p + "inter_token_latency_max_seconds"] == 3.0
    assert got[f'{p}qos_attainment{{qos_class="chat"}}'] == 0.5
    with pytest.raises(ValueError, match="samples: a finish reason must be one of"):
        stats.finished([("done", sample([1.0]))])
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        stats.finished([("stop", sample([1.0])), ("stop", sample([1.0]))], num_samples=1)
    refused = _scraped(stats)  # refused calls count nothing
    assert sum(v for k, v in refused.items() if k.startswith(p + "request_success_total")) == 3


def test_every_series_is_documented() -> None:
    """docs/metrics.md names every series /metrics has, QoS ones included, and no other."""
    pytest.importorskip("prometheus_client")
    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    from sarathi_rt.scheduler import QoSClass
    from sarathi_rt.server.stats import ServerStats

    engine = _engine([], qos_classes={"chat": QoSClass(ttft=2.0, tbt=1.5)})
    stats = ServerStats(engine, "tiny")  # type: ignore[arg-type]
    families = text_string_to_metric_families(stats.render()[0].decode())
    served = {f.name + ("_total" if f.type == "counter" else "") for f in families if not f.name.endswith("_created")}
    docs = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    assert served == set(re.findall(r"sarathi_rt:[a-z0-9_]+", docs))

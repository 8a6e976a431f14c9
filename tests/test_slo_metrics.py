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


def test_server_metrics_export_the_same_slo_numbers() -> None:
    """/metrics' SLO gauges and counters are slo_metrics' over the finished requests and
    the engine's steps: one definition for bench, capacity and the server."""
    pytest.importorskip("fastapi")
    from types import SimpleNamespace

    from sarathi_rt.server.stats import ServerStats

    requests, steps = _timeline()
    engine = SimpleNamespace(step_metrics=steps, scheduler_config=SimpleNamespace(num_blocks=8),
                             scheduler=SimpleNamespace(num_running=0, num_waiting=0, num_free_blocks=8))
    stats = ServerStats(ttft_target=3.0, tbt_target=2.0)
    for r in requests:
        stats.finished([("length", r)])
    text = stats.render(engine)  # type: ignore[arg-type]
    samples = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}
    m = slo_metrics(requests, steps, 3.0, 2.0)
    assert samples["sarathi_rt_time_between_tokens_p999_seconds"] == m.tbt_p999
    assert samples["sarathi_rt_time_between_tokens_max_seconds"] == m.tbt_max == 2.0
    assert samples["sarathi_rt_prefill_wait_share"] == m.prefill_wait_share == pytest.approx(0.5)
    assert samples["sarathi_rt_goodput_requests_per_second"] == m.goodput == pytest.approx(0.5)
    assert samples["sarathi_rt_requests_good_total"] == 2 and samples["sarathi_rt_slo_window_requests"] == 2
    assert samples['sarathi_rt_request_max_time_between_tokens_seconds_bucket{le="+Inf"}'] == 1  # b has no gap
    assert "# TYPE sarathi_rt_prefill_wait_share gauge" in text
    untargeted = ServerStats().render(engine)  # type: ignore[arg-type]
    assert "sarathi_rt_goodput_requests_per_second NaN" in untargeted
    assert "sarathi_rt_requests_good_total 0" in untargeted
    with pytest.raises(ValueError, match="tbt_target"):
        ServerStats(tbt_target=0.0)


def test_server_stats_count_a_request_of_several_samples_once() -> None:
    """n > 1: one request with its status, prompt tokens, TTFT and goodput once; generated
    tokens and gaps over every sample; good and attained only if every sample is."""
    pytest.importorskip("fastapi")
    from types import SimpleNamespace

    from sarathi_rt.scheduler import QoSClass
    from sarathi_rt.server.stats import ServerStats

    stats = ServerStats(ttft_target=2.0, tbt_target=1.5, qos_classes={"chat": QoSClass(ttft=2.0, tbt=1.5)})

    def sample(times: list[float], relegated: bool = False) -> RequestMetrics:
        return RequestMetrics(0.0, 8, 0.0, times[0], times, times[-1], qos="chat", relegated=relegated)

    stats.finished([("stop", sample([1.0, 2.0])), ("length", sample([1.0, 2.0, 3.0]))])  # good, attained
    # Sample 1's gap of 3 s misses the TBT target and its second token's deadline (3.5 s).
    stats.finished([("length", sample([1.0, 4.0], relegated=True)), ("stop", sample([1.0, 2.0], relegated=True))])
    stats.finished([("stop", sample([1.0]))], num_samples=2)  # the client left before sample 1 ended
    assert stats.requests == {"length": 2, "abort": 1}
    assert stats.prompt_tokens == 3 * 8 and stats.generation_tokens == 2 + 3 + 2 + 2 + 1
    assert stats.ttft.count == 3 and stats.tbt.count == 1 + 2 + 1 + 1 and stats.request_max_tbt.count == 2
    assert stats.good == 1
    assert (stats.qos_requests["chat"], stats.qos_attained["chat"], stats.qos_relegated["chat"]) == (3, 1, 1)
    engine = SimpleNamespace(step_metrics=[], scheduler_config=SimpleNamespace(num_blocks=8),
                             scheduler=SimpleNamespace(num_running=0, num_waiting=0, num_free_blocks=8))
    gauges = {name: value for name, _, value in stats.slo_gauges(engine)}  # type: ignore[arg-type]
    # The window holds the two whole requests, one good, from 0 s to the last finish at 4 s.
    assert gauges["sarathi_rt_slo_window_requests"] == 2
    assert gauges["sarathi_rt_goodput_requests_per_second"] == pytest.approx(1 / 4)
    assert gauges["sarathi_rt_time_between_tokens_max_seconds"] == 3.0
    with pytest.raises(ValueError, match="samples: a finish reason must be one of"):
        stats.finished([("done", sample([1.0]))])
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        stats.finished([("stop", sample([1.0])), ("stop", sample([1.0]))], num_samples=1)
    assert sum(stats.requests.values()) == 3  # refused calls count nothing

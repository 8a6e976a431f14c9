"""Metrics on hand-made timelines with known answers."""
from __future__ import annotations

import math

import pytest

from sarathi_rt.measure.metrics import (Distribution, RequestMetrics, StepMetrics, count_stalls, load_json,
                                load_requests_csv, load_steps_csv, percentile, save_json, save_requests_csv,
                                save_steps_csv, stall_threshold, summarize)


def _timeline() -> tuple[list[RequestMetrics], list[StepMetrics]]:
    # Steps of 0.1 s, except one 0.9 s step (a whole prefill) at t = 1.2.
    steps = [StepMetrics(0.1 * i, 0.1, 8, 6, 2, 3) for i in range(12)]
    steps.append(StepMetrics(1.2, 0.9, 512, 510, 2, 3, tile_padding=0))
    a = RequestMetrics(arrival_time=0.0, num_prompt_tokens=6, first_scheduled_time=0.25, first_token_time=0.5,
                       token_times=[0.5, 0.6, 0.7, 1.6, 1.7], finish_time=1.7, num_preemptions=1)
    b = RequestMetrics(arrival_time=1.0, num_prompt_tokens=4, first_scheduled_time=1.0, first_token_time=1.2,
                       token_times=[1.2, 1.3], finish_time=1.3)
    unfinished = RequestMetrics(arrival_time=1.5, num_prompt_tokens=9)
    return [a, b, unfinished], steps


def test_request_properties() -> None:
    (a, b, c), _ = _timeline()
    assert a.ttft == pytest.approx(0.5) and b.ttft == pytest.approx(0.2) and c.ttft is None
    assert a.tbts == pytest.approx([0.1, 0.1, 0.9, 0.1])
    assert a.scheduling_delay == pytest.approx(0.25) and c.scheduling_delay is None
    assert a.e2e_latency == pytest.approx(1.7) and c.e2e_latency is None
    assert a.num_generated_tokens == 5


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile(list(range(11)), 90) == pytest.approx(9.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([1, 2], 0) == 1 and percentile([1, 2], 100) == 2
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_stalls_use_stall_factor_times_median_step() -> None:
    requests, steps = _timeline()
    assert stall_threshold(steps) == pytest.approx(0.5)  # 5 x median 0.1
    assert count_stalls(requests, steps) == 1  # the 0.9 s gap only
    assert count_stalls(requests, steps, stall_factor=10.0) == 0
    assert count_stalls(requests, steps, stall_factor=0.9) == 5  # all five gaps > 0.09
    assert count_stalls([], []) == 0
    # no step records: the median TBT stands in for the step time
    assert stall_threshold([], 5.0, requests) == pytest.approx(0.5)  # 5 x median of 0.1 0.1 0.9 0.1 0.1
    assert count_stalls(requests, []) == 1 and count_stalls(requests, [], stall_factor=20.0) == 0
    with pytest.raises(ValueError, match="stall_factor"):
        stall_threshold(steps, 0.0)


def test_summary_known_values() -> None:
    requests, steps = _timeline()
    s = summarize(requests, steps)
    assert (s.num_requests, s.num_finished, s.stalls, s.num_steps) == (3, 2, 1, 13)
    assert s.ttft.p50 == pytest.approx(0.35) and s.ttft.max == pytest.approx(0.5)
    gaps = [0.1, 0.1, 0.9, 0.1, 0.1]
    assert s.tbt.p50 == pytest.approx(0.1) and s.tbt.p99 == pytest.approx(percentile(gaps, 99))
    assert s.tbt.mean == pytest.approx(sum(gaps) / 5)
    assert s.sched_delay.p50 == pytest.approx(0.125)
    assert s.duration == pytest.approx(1.7)  # first arrival 0 .. last finish 1.7
    assert s.tokens_per_s == pytest.approx(7 / 1.7)
    assert s.num_preemptions == 1
    bench = s.bench_dict()
    assert list(bench) == ["ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "stalls", "tokens_per_s",
                           "sched_delay_p50"]
    assert bench["stalls"] == 1 and isinstance(bench["stalls"], int)


def test_empty_summary_is_nan_not_perfect() -> None:
    s = summarize([RequestMetrics(0.0)], [])
    assert math.isnan(s.tbt.p99) and math.isnan(s.tokens_per_s) and s.num_finished == 0
    assert math.isnan(Distribution.of([]).p50)


def test_json_and_csv_round_trip(tmp_path) -> None:
    requests, steps = _timeline()
    save_json(tmp_path / "m.json", requests, steps)
    assert load_json(tmp_path / "m.json") == (requests, steps)
    save_requests_csv(tmp_path / "r.csv", requests)
    assert load_requests_csv(tmp_path / "r.csv") == requests
    save_steps_csv(tmp_path / "s.csv", steps)
    assert load_steps_csv(tmp_path / "s.csv") == steps
    (tmp_path / "bad.json").write_text('{"requests": [{"nope": 1}], "steps": []}')
    with pytest.raises(ValueError, match="not a metrics JSON"):
        load_json(tmp_path / "bad.json")

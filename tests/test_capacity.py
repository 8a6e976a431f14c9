"""Capacity search: bisection on synthetic and simulated runs with known answers."""
from __future__ import annotations

import json
import math
import random

import pytest

from sarathi_rt.sim.capacity import SLO, CapacitySearch, find_capacity, simulated_capacity
from sarathi_rt.measure.metrics import Distribution, MetricsSummary
from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim import LinearCostModel
from sarathi_rt.workloads import WorkloadConfig


def _summary(tbt_p99: float, delay_p50: float) -> MetricsSummary:
    nan = Distribution.of([])
    return MetricsSummary(1, 1, nan, Distribution(0, 0, tbt_p99, 0, tbt_p99), Distribution(delay_p50, 0, 0, 0, 0),
                          nan, nan, 0, 0.0, 1.0, 1, 1, 0, 1.0)


def test_bisection_finds_a_known_threshold() -> None:
    # P99 TBT grows with load and crosses the 0.1 s SLO at exactly 3.7 QPS.
    res = find_capacity(lambda q: _summary(0.1 * q / 3.7, 0.0), SLO(0.1), rel_tol=0.001, max_probes=40)
    assert 3.7 * (1 - 0.001) <= res.max_qps <= 3.7
    assert all(p.ok == (p.qps <= 3.7) for p in res.probes)
    low = find_capacity(lambda q: _summary(0.0, 2.0 * q / 0.3), SLO(0.1), rel_tol=0.01, max_probes=40)
    assert 0.3 * 0.99 <= low.max_qps <= 0.3  # bracketed from above by halving
    never = find_capacity(lambda q: _summary(1.0, 0.0), SLO(0.1), max_probes=8)
    assert never.max_qps == 0.0 and len(never.probes) == 8
    assert res.bounded and low.bounded and never.bounded  # a failing rate lies above each answer


def test_a_search_that_never_fails_is_only_a_lower_bound() -> None:
    # Every rate passes: the probes run out doubling, and the answer says so.
    res = find_capacity(lambda q: _summary(0.0, 0.0), SLO(0.1), max_probes=4)
    assert res.max_qps == 8.0 and not res.bounded


def test_a_known_ceiling_is_never_probed() -> None:
    # Capacity 3.7 under a ceiling of 4.5: doubling from 1 would probe 4 then 8.
    res = find_capacity(lambda q: _summary(0.1 * q / 3.7, 0.0), SLO(0.1), rel_tol=0.01, max_probes=40, qps_max=4.5)
    assert 3.7 * 0.99 <= res.max_qps <= 3.7
    assert max(p.qps for p in res.probes) < 4.5
    above = find_capacity(lambda q: _summary(0.0, 0.0), SLO(0.1), qps_start=8.0, rel_tol=0.01, qps_max=4.5)
    assert max(p.qps for p in above.probes) < 4.5 and 4.5 * 0.99 <= above.max_qps < 4.5  # the ceiling bounds it
    with pytest.raises(ValueError, match="qps_max"):
        find_capacity(lambda q: _summary(0.0, 0.0), SLO(0.1), qps_max=0.0)


def test_stepwise_searches_interleaved_match_find_capacity() -> None:
    # Random thresholds, starts, tolerances and ceilings: each CapacitySearch, driven
    # round-robin beside two others, probes exactly what find_capacity probes alone, and
    # its answer brackets the threshold from below within rel_tol.
    rng = random.Random(7)
    for _ in range(50):
        cases = [(rng.uniform(0.05, 40), rng.uniform(0.1, 10), rng.choice([0.01, 0.05, 0.1]),
                  rng.choice([math.inf, rng.uniform(1, 60)]), rng.randint(2, 12)) for _ in range(3)]

        def run(threshold: float):
            return lambda q: _summary(0.1 * q / threshold, 0.0)

        searches = [CapacitySearch(qps_start=start, rel_tol=tol, qps_max=cap, max_probes=probes)
                    for _, start, tol, cap, probes in cases]
        while any(s.next_qps() is not None for s in searches):
            for s, (threshold, *_rest) in zip(searches, cases):
                if (q := s.next_qps()) is not None:
                    s.record(run(threshold)(q), q <= threshold)
        for s, (threshold, start, tol, cap, probes) in zip(searches, cases):
            alone = find_capacity(run(threshold), SLO(0.1), qps_start=start, rel_tol=tol, qps_max=cap,
                                  max_probes=probes)
            assert s.result.probes == alone.probes and s.result.max_qps == alone.max_qps
            assert s.result.max_qps <= threshold and all(p.qps < cap for p in s.result.probes)
            if len(alone.probes) < probes and alone.max_qps > 0 and threshold < cap:
                bracket = min([p.qps for p in alone.probes if not p.ok] + [cap])  # the ceiling brackets too
                assert bracket - alone.max_qps <= tol * bracket
    done = CapacitySearch(max_probes=2)
    for _ in range(2):
        done.record(_summary(0.0, 0.0), False)
    assert done.next_qps() is None
    with pytest.raises(RuntimeError, match="done"):
        done.record(_summary(0.0, 0.0), False)


def test_nan_tbt_counts_as_met() -> None:
    assert SLO(0.1).met_by(_summary(math.nan, 1.0))
    assert not SLO(0.1).met_by(_summary(math.nan, 3.0))


@pytest.mark.slow
def test_simulated_capacity_toy_known_answer() -> None:
    # One request at a time (max_num_seqs=1), 10 steps of 0.1 s each: service rate is
    # exactly 1 QPS. With evenly spaced arrivals at q > 1 QPS request i waits
    # i * (1 - 1/q) s; the median of 101 requests (i = 50) stays <= 2 s up to
    # q = 1 / (1 - 2/50) = 1.041666... TBT is always one 0.1 s step (SLO 0.15 s).
    workload = WorkloadConfig(num_requests=101, arrival="fixed", lengths="fixed", prompt_len=4, decode_len=10)
    sched = SchedulerConfig(token_budget=16, max_num_seqs=1, num_blocks=64)
    res = simulated_capacity(workload, sched, LinearCostModel(0.1, 0.0), SLO(0.15), rel_tol=0.002, max_probes=30)
    assert 1 / 0.96 * (1 - 0.003) <= res.max_qps <= 1 / 0.96 + 1e-9
    # The same toy under a 0.05 s TBT SLO fails at every rate.
    assert simulated_capacity(workload, sched, LinearCostModel(0.1, 0.0), SLO(0.05), max_probes=6).max_qps == 0.0


@pytest.mark.parametrize("kwargs, match", [({"qps_start": 0.0}, "qps_start"), ({"rel_tol": 1.5}, "rel_tol"),
                                           ({"max_probes": 1}, "max_probes")])
def test_bad_search_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        find_capacity(lambda q: _summary(0.0, 0.0), SLO(0.1), **kwargs)


def test_bad_slo() -> None:
    with pytest.raises(ValueError, match="tbt_p99"):
        SLO(0.0)
    with pytest.raises(ValueError, match="sched_delay_p50"):
        SLO(0.1, float("nan"))


@pytest.mark.slow
def test_capacity_command_on_the_simulator(tmp_path, capsys) -> None:
    from sarathi_rt.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{200 + 37 * i % 900},{20 + i % 30}\n"
                                                                          for i in range(40)))
    out = tmp_path / "cap"
    assert main(["capacity", "--simulate", "--policy", "sarathi,vllm", "--tbt-slo", "0.1", "--trace", str(trace),
                 "--num-requests", "40", "--max-probes", "6", "--out", str(out)]) == 0
    caps = json.loads((out / "capacity.json").read_text())
    assert set(caps) == {"sarathi", "vllm"} and all(v > 0 for v in caps.values())
    assert (out / "capacity.png").stat().st_size > 0
    # The default rule sizes each step to the SLO; the old static rule profiles T(n) first.
    probes = json.loads((out / "capacity_probes.json").read_text())
    assert probes["token_budget"]["sarathi"] == 4096
    # At the found rate: the SLO-first metrics of measure.slo, from the passing probe's run.
    for policy, qps in caps.items():
        at = probes["at_capacity"][policy]
        passing = next(p for p in probes["probes"][policy] if p["qps"] == qps and p["ok"])
        assert at == passing["slo"] and at["tbt_target"] == 0.1
        assert passing["tbt_p99"] <= at["tbt_p999"] <= at["tbt_max"] and 0 <= at["prefill_wait_share"] <= 1
        assert at["goodput"] > 0  # with --tbt-slo alone, goodput counts the TBT target
    assert "at capacity:" in capsys.readouterr().out
    assert main(["capacity", "--simulate", "--policy", "sarathi", "--tbt-slo", "0.1", "--trace", str(trace),
                 "--num-requests", "40", "--max-probes", "3", "--budget-rule", "slo-static", "--out", str(out)]) == 0
    assert (out / "step_time.png").stat().st_size > 0
    with pytest.raises(ValueError, match="--policy"):
        main(["capacity", "--simulate", "--policy", "fifo", "--tbt-slo", "0.1", "--out", str(out)])

"""Metrics recorded by the real engine: workload replay, step-time profiling and the
CPU bench on the tiny preset."""
from __future__ import annotations

import json

import pytest
import torch

from sarathi_rt import LLM
from sarathi_rt.harness.step_timing import measure_step_curve
from sarathi_rt.sim.budget import choose_token_budget
from sarathi_rt.cli import main
from sarathi_rt.measure.metrics import summarize
from sarathi_rt.harness.replay import replay, synthetic_prompt, warm_up
from sarathi_rt.workloads import RequestSpec, WorkloadConfig, make_workload


@pytest.fixture(scope="module")
def engine():
    return LLM(model="tiny", token_budget=32, max_num_seqs=8, num_kv_blocks=128).engine


@pytest.mark.slow
def test_replay_records_every_token(engine) -> None:
    warm_up(engine)
    workload = make_workload(WorkloadConfig(num_requests=6, qps=50.0, lengths="uniform", prompt_range=(5, 40),
                                            decode_range=(2, 6), seed=1))
    done = []
    requests, steps = replay(engine, workload, progress=done.append)
    assert sum(done) == 6 and not engine.has_unfinished()
    for spec, r in zip(workload, requests):
        assert len(r.token_times) == spec.num_decode_tokens and r.num_prompt_tokens == spec.num_prompt_tokens
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time
        assert r.token_times == sorted(r.token_times) and r.finish_time == r.token_times[-1]
    assert sum(s.num_prefill_tokens for s in steps) == sum(r.num_prompt_tokens for r in workload)
    assert sum(s.num_tokens for s in steps) == sum(r.num_prompt_tokens + r.num_decode_tokens - 1 for r in workload)
    assert summarize(requests, steps).num_finished == 6


def test_replay_rejects_unsorted_workload(engine) -> None:
    with pytest.raises(ValueError, match="sorted"):
        replay(engine, [RequestSpec(0, 1.0, 4, 2), RequestSpec(1, 0.0, 4, 2)])


def test_synthetic_prompts_are_seeded() -> None:
    spec = RequestSpec(3, 0.0, 10, 2)
    assert synthetic_prompt(spec, 512, 0) == synthetic_prompt(spec, 512, 0) != synthetic_prompt(spec, 512, 1)
    assert all(3 <= t < 512 for t in synthetic_prompt(spec, 512, 0))


@pytest.mark.slow
def test_profile_step_time_on_the_engine(engine) -> None:
    profile = measure_step_curve(engine, [4, 16, 32], num_decodes=4, context_len=20, repeats=2, warmup=1)
    assert profile.num_tokens == (4, 16, 32) and all(s > 0 for s in profile.seconds)
    choice = choose_token_budget(profile, 10.0, 16)
    assert choice.token_budget == 32
    with pytest.raises(ValueError, match="KV blocks"):
        measure_step_curve(engine, [32], num_decodes=8, context_len=400)


@pytest.mark.slow
def test_bench_on_the_engine(tmp_path) -> None:
    out = tmp_path / "b"
    assert main(["bench", "--model", "tiny", "--num-requests", "6", "--qps", "20", "--length-scale", "0.01",
                 "--token-budget", "16", "--max-num-seqs", "8", "--num-kv-blocks", "256",
                 "--threads", str(torch.get_num_threads()), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"sarathi", "vllm", "orca"}
    assert all(v["tokens_per_s"] > 0 for v in summary.values())


@pytest.mark.slow
def test_capacity_on_the_engine_with_slo_budget(tmp_path) -> None:
    out = tmp_path / "c"
    assert main(["capacity", "--model", "tiny", "--num-requests", "4", "--max-probes", "2", "--tbt-slo", "5",
                 "--budget-rule", "slo-static",
                 "--qps-start", "8", "--max-num-seqs", "8", "--num-kv-blocks", "256", "--budget-tile", "16",
                 "--threads", str(torch.get_num_threads()), "--out", str(out)]) == 0
    probes = json.loads((out / "capacity_probes.json").read_text())
    assert probes["token_budget"]["sarathi"] == 128  # every profiled step of the tiny model is far below 5 s
    assert set(json.loads((out / "capacity.json").read_text())) == {"sarathi", "vllm"}

"""Simulator: exact timelines on toy cost models, determinism, pipelining, vidur costs."""
from __future__ import annotations

import pytest

from sarathi_rt.scheduler import BatchPlan, PlanEntry, SchedulerConfig
from sarathi_rt.step_time.shape import StepShape
from sarathi_rt.sim import LinearCostModel, TableCostModel, VidurCostModel, interpolate_measured, simulate
from sarathi_rt.workloads import RequestSpec, WorkloadConfig, data_path, make_workload

PROFILE = data_path("a100_llama-2-7b_mlp.csv.gz")


def test_single_request_exact_timeline() -> None:
    cost = LinearCostModel(fixed_s=0.01, per_token_s=0.001)
    res = simulate([RequestSpec(0, 0.5, 10, 3)], SchedulerConfig(token_budget=16, max_num_seqs=8), cost)
    r = res.requests[0]
    # Prefill (10 tokens, 0.02 s) emits the first token; two decodes of 0.011 s follow.
    assert r.first_scheduled_time == 0.5
    assert r.token_times == pytest.approx([0.52, 0.531, 0.542])
    assert r.finish_time == pytest.approx(0.542) and r.ttft == pytest.approx(0.02)
    assert [s.num_tokens for s in res.steps] == [10, 1, 1]
    assert res.makespan == pytest.approx(0.042) and res.stage_busy == pytest.approx([0.042])


def test_chunked_prefill_and_decode_share_steps() -> None:
    wl = [RequestSpec(0, 0.0, 4, 5), RequestSpec(1, 0.001, 40, 2)]
    res = simulate(wl, SchedulerConfig(token_budget=16, max_num_seqs=8), LinearCostModel(0.01, 0.0))
    assert [(s.num_decode_tokens, s.num_prefill_tokens) for s in res.steps[:4]] == \
        [(0, 4), (1, 15), (1, 15), (1, 10)]
    # Every TBT of request 0 is one 10 ms step: no stall while request 1 prefills.
    assert res.requests[0].tbts == pytest.approx([0.01] * 4)


def test_step_observer_sees_every_step_and_its_time() -> None:
    wl = [RequestSpec(0, 0.0, 4, 5), RequestSpec(1, 0.001, 40, 2)]
    seen: list[tuple[BatchPlan, float]] = []
    res = simulate(wl, SchedulerConfig(token_budget=16, max_num_seqs=8), LinearCostModel(0.01, 0.001),
                   step_observer=lambda plan, seconds: seen.append((plan, seconds)))
    assert [(p.num_prefill_tokens, p.num_decode_tokens) for p, _ in seen] == \
        [(s.num_prefill_tokens, s.num_decode_tokens) for s in res.steps]
    assert [t for _, t in seen] == pytest.approx([s.duration for s in res.steps])
    assert seen[1][1] == pytest.approx(0.01 + 0.001 * 16)


def test_vllm_stalls_decodes_sarathi_does_not() -> None:
    wl = make_workload(WorkloadConfig(num_requests=60, qps=20.0, lengths="uniform", prompt_range=(50, 400),
                                      decode_range=(20, 60), seed=3))
    cost = LinearCostModel(0.005, 2e-4)
    sar = simulate(wl, SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=32, num_blocks=2048), cost)
    vll = simulate(wl, SchedulerConfig(policy="vllm", token_budget=512, max_num_seqs=32, num_blocks=2048), cost)
    assert all(r.finish_time is not None for r in sar.requests + vll.requests)
    assert sar.summary().tbt.max <= 0.005 + 64 * 2e-4 + 1e-12
    assert vll.summary().tbt.p99 > 2 * sar.summary().tbt.p99
    assert sar.summary().stalls <= vll.summary().stalls


def test_deterministic_for_a_seed() -> None:
    cfg = WorkloadConfig(num_requests=80, qps=4.0, length_scale=0.05, seed=11)
    sched = SchedulerConfig(token_budget=128, max_num_seqs=16, num_blocks=512)
    cost = VidurCostModel(PROFILE)
    a = simulate(make_workload(cfg), sched, cost, pipeline_stages=2)
    b = simulate(make_workload(cfg), sched, cost, pipeline_stages=2)
    assert a == b
    c = simulate(make_workload(WorkloadConfig(num_requests=80, qps=4.0, length_scale=0.05, seed=12)), sched, cost)
    assert c.requests != a.requests


def test_pipeline_stages_busy_comm_and_bubbles() -> None:
    cost = LinearCostModel(fixed_s=0.0, per_token_s=0.01, comm_s=0.002)
    wl = [RequestSpec(0, 0.0, 100, 1), RequestSpec(1, 0.1, 1, 1)]
    res = simulate(wl, SchedulerConfig(token_budget=128), cost, pipeline_stages=2)
    # A: stage 0 0.5 s + send, stage 1 0.5 s. B is issued when stage 0 frees (0.502) and
    # runs stage 0 and its send until 0.509, then waits for stage 1 (busy until 1.002).
    assert res.requests[0].finish_time == pytest.approx(1.002)
    assert res.requests[1].first_scheduled_time == pytest.approx(0.502)
    assert res.bubble_times == pytest.approx([0.0, 0.493])
    assert res.requests[1].finish_time == pytest.approx(1.007)
    assert res.stage_busy == pytest.approx([0.502 + 0.007, 0.505])
    assert res.stage_idle == pytest.approx([1.007 - 0.509, 1.007 - 0.505])


def test_pipeline_keeps_several_plans_in_flight() -> None:
    wl = make_workload(WorkloadConfig(num_requests=40, qps=50.0, lengths="fixed", prompt_len=32, decode_len=20))
    cost = LinearCostModel(0.01, 1e-4)
    one = simulate(wl, SchedulerConfig(token_budget=128, max_num_seqs=40), cost)
    four = simulate(wl, SchedulerConfig(token_budget=128, max_num_seqs=40), cost, pipeline_stages=4)
    assert four.makespan < one.makespan  # stages overlap different micro-batches
    assert one.bubble_times == [0.0] * len(wl)  # one stage never waits for another
    assert any(b > 0 for b in four.bubble_times)  # uneven micro-batches make later ones wait
    for b, r in zip(four.bubble_times, four.requests):
        assert b <= r.finish_time - r.arrival_time


def test_bad_inputs() -> None:
    cfg = SchedulerConfig()
    with pytest.raises(ValueError, match="pipeline_stages"):
        simulate([], cfg, LinearCostModel(), pipeline_stages=0)
    with pytest.raises(ValueError, match="sorted"):
        simulate([RequestSpec(0, 1.0, 5, 5), RequestSpec(1, 0.0, 5, 5)], cfg, LinearCostModel())
    with pytest.raises(ValueError, match="duplicate"):
        simulate([RequestSpec(0, 0.0, 5, 5), RequestSpec(0, 0.0, 5, 5)], cfg, LinearCostModel())
    with pytest.raises(ValueError, match="positive and finite"):
        simulate([RequestSpec(0, 0.0, 5, 5)], cfg, LinearCostModel(0.0, 0.0))
    with pytest.raises(ValueError, match="per_token_s"):
        LinearCostModel(per_token_s=-1.0)
    assert simulate([], cfg, LinearCostModel()).requests == []


def test_interpolation_keeps_measured_steps() -> None:
    xs, ys = [1, 128, 136, 256], [1.0, 1.0, 2.0, 2.0]
    assert interpolate_measured(xs, ys, 128) == 1.0 and interpolate_measured(xs, ys, 132) == 1.5
    assert interpolate_measured(xs, ys, 200) == 2.0 and interpolate_measured(xs, ys, 512) == 4.0
    assert interpolate_measured(xs, ys, 0) == 1.0
    table = TableCostModel([256, 1, 136, 128], [2.0, 1.0, 2.0, 1.0])
    plan = BatchPlan(1, [PlanEntry(0, 0, 132, True, True)], num_prefill_tokens=132)
    assert table.step_time(plan) == 1.5
    with pytest.raises(ValueError, match="distinct"):
        TableCostModel([1, 1], [1.0, 2.0])


def _plan(entries: list[tuple[int, int, bool]]) -> BatchPlan:
    plan = BatchPlan(1)
    for i, (start, n, prefill) in enumerate(entries):
        plan.entries.append(PlanEntry(i, start, n, prefill, not prefill))
        plan.num_prefill_tokens += n * prefill
        plan.num_decode_tokens += n * (not prefill)
    return plan


def test_vidur_cost_model_terms() -> None:
    cm = VidurCostModel(PROFILE, num_layers=32)
    assert (cm.n_head, cm.n_kv_head, cm.head_dim, cm.hidden) == (32, 32, 128, 4096)
    # The tile staircase between 128 and 136 tokens is kept (measured: +44% per layer).
    assert cm.dense_time(136) > 1.3 * cm.dense_time(128)
    assert cm.dense_time(8192) == pytest.approx(2 * cm.dense_time(4096), rel=1e-9)
    # One decode over 1023 cached tokens: memory-bound, 2 (K,V) x 1024 x 32 heads x 128 x 2 B.
    attention, head = cm.attention_and_head_time(StepShape.of_plan(_plan([(1023, 1, False)])))
    assert attention == pytest.approx(32 * 2 * 1024 * 32 * 128 * 2 / (2039e9 * 0.7))
    assert head == pytest.approx(2 * 4096 * 32768 / (312e12 * 0.7))
    # A 1024-token prefill from scratch: compute-bound, 4 x 32 x 128 x (1024 x 1025 / 2) FLOPs.
    attention, head = cm.attention_and_head_time(StepShape.of_plan(_plan([(0, 1024, True)])))
    assert attention == pytest.approx(32 * 4 * 32 * 128 * 1024 * 1025 / 2 / (312e12 * 0.5))
    assert head == 0.0
    assert 2000 < cm.kv_cache_blocks(16) < 10000  # ~ 60 GB of 80 GB at 512 KiB per token
    tp2 = VidurCostModel(PROFILE, tp=2)
    assert tp2.dense_time(512) < cm.dense_time(512)
    with pytest.raises(ValueError, match="tp=3"):
        VidurCostModel(PROFILE, tp=3)
    with pytest.raises(ValueError, match="num_layers"):
        VidurCostModel(PROFILE, num_layers=0)


def test_vidur_profile_errors(tmp_path) -> None:
    (tmp_path / "x.csv").write_text("num_tokens,foo\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        VidurCostModel(str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match="cannot be read"):
        VidurCostModel(str(tmp_path / "none.csv"))


def _profile_rows(tmp_path, name: str, edit: dict[str, str] | None = None, every_row: bool = False) -> str:
    """The bundled profile's first 4 rows of tp=1, with `edit`'s cells set in the second
    row (file line 3), or in every row."""
    import csv
    import gzip

    with gzip.open(PROFILE, "rt", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["num_tensor_parallel_workers"] == "1"][:4]
    for r in rows if every_row else rows[1:2]:
        r.update(edit or {})
    path = tmp_path / name
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


@pytest.mark.parametrize("edit, match", [
    ({"time_stats.mlp_act.median": "nan"}, r"line 3: time_stats.mlp_act.median is 'nan', not a finite time"),
    ({"time_stats.emb.median": "-1"}, r"line 3: time_stats.emb.median is '-1'"),
    ({"time_stats.add.median": "fast"}, r"line 3: time_stats.add.median is 'fast'"),
    ({"num_tokens": "0"}, r"line 3: num_tokens is '0', not a positive integer"),
    ({"n_embd": "5120"}, r"mixes models"),
    ({"n_kv_head": "0"}, r"n_kv_head is '0'"),
])
def test_vidur_profile_bad_cells_name_the_file_and_line(tmp_path, edit: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match="bad_mlp.csv'.* " + match):
        VidurCostModel(_profile_rows(tmp_path, "bad_mlp.csv", edit))


def test_vidur_profile_that_does_not_fit(tmp_path) -> None:
    (tmp_path / "empty.csv").write_text(",".join(["num_tokens", "n_head"]) + "\n")
    with pytest.raises(ValueError, match=r"empty.csv' has no rows"):
        VidurCostModel(str(tmp_path / "empty.csv"))
    (tmp_path / "text.csv.gz").write_text("not gzip")
    with pytest.raises(ValueError, match=r"text.csv.gz' cannot be read"):
        VidurCostModel(str(tmp_path / "text.csv.gz"))
    heads = _profile_rows(tmp_path, "heads.csv", {"n_head": "30", "n_kv_head": "8"}, every_row=True)
    with pytest.raises(ValueError, match=r"heads.csv': n_embd=4096 must split into n_head=30"):
        VidurCostModel(heads)
    assert VidurCostModel(_profile_rows(tmp_path, "ok.csv")).dense_time(64) > 0  # the 4 rows alone fit

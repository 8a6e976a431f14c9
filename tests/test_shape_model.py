"""The plan-shape cost model: its fit on a known truth, its profile file, measuring an
engine by shape (tiny preset, few shapes), and simulating from a saved profile."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sarathi_rt.cli import main
from sarathi_rt.scheduler import BatchPlan, PlanEntry
from sarathi_rt.step_time.shape import StepShape
from sarathi_rt.harness.shape_profiling import chunk_grid, decode_grid, measure, profile_batches, run_speed, speed_factor
from sarathi_rt.sim.shape_model import MeasuredStep, ShapeCostModel, ShapeProfile


def _truth(shape: StepShape) -> float:
    # A dense part with a non-monotonic dip at 8 rows, then attention, KV and LM head.
    dense = {1: 0.010, 2: 0.011, 4: 0.013, 8: 0.012, 16: 0.016}.get(shape.num_tokens, 0.001 * shape.num_tokens)
    return dense + 2e-8 * shape.prefill_pairs + 1e-7 * (shape.prefill_kv + shape.decode_kv) + 3e-4 * shape.num_sampled


def _truth_with_head(shape: StepShape) -> float:
    # Plus a fixed LM head read whenever the step samples a row.
    return _truth(shape) + (0.006 if shape.num_sampled else 0.0)


def _profile(truth=_truth) -> ShapeProfile:
    steps = []
    for q, s, d, c in profile_batches(256, 16, 64):
        m = MeasuredStep(q, s, d, c, False, (0.0,))
        t = truth(m.shape())
        steps.append(MeasuredStep(q, s, d, c, False, (t * 0.99, t, t * 1.01)))
    return ShapeProfile(tuple(steps), host_overhead_s=0.002, engine={"num_kv_blocks": 77})


def test_grids() -> None:
    assert decode_grid(12) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    assert decode_grid(40)[-4:] == [28, 32, 36, 40]
    assert chunk_grid(100) == [16, 24, 32, 48, 64, 96, 100]


def test_fit_recovers_the_shape_terms(tmp_path) -> None:
    profile = _profile()
    model = ShapeCostModel(profile)
    for step in profile.steps:  # every measured batch, decode dip included
        assert model.model_time(step.shape()) == pytest.approx(step.median, rel=0.02)
    # A shape it never saw: 7 decodes at context 1000 beside a 40-token chunk at 500.
    shape = StepShape.hybrid(40, 500, 7, 7 * 1001)
    assert model.predict_shape(shape) == pytest.approx(0.002 + _truth(shape), rel=0.05)
    # Reading the shape, not the count: a 32-token chunk costs less than 32 decodes' step.
    assert model.predict_shape(StepShape.hybrid(32, 0, 0, 0)) < model.predict_shape(StepShape.hybrid(0, 0, 32, 32 * 257))
    profile.save(tmp_path / "p.json")
    assert ShapeProfile.load(tmp_path / "p.json") == profile
    assert profile.spread() == pytest.approx(0.02, rel=1e-6)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a sarathi-rt step profile"):
        ShapeProfile.load(tmp_path / "bad.json")


def test_fit_recovers_the_lm_head_cost() -> None:
    model = ShapeCostModel(_profile(_truth_with_head))
    assert model.head_s == pytest.approx(0.006, rel=0.05)
    assert model.a_sampled == pytest.approx(3e-4, rel=0.05)
    # The hybrid step the sarathi policy runs: a chunk beside a few decodes at the budget.
    for shape in (StepShape.hybrid(31, 200, 1, 201), StepShape.hybrid(24, 90, 8, 8 * 300)):
        assert model.model_time(shape) == pytest.approx(_truth_with_head(shape), rel=0.02)
    # A chunk that does not finish its prompt samples nothing and skips the LM head.
    chunk = StepShape(32, 32 * 100 + 32 * 33 // 2, 132, 0, 0, 0)
    assert model.model_time(chunk) == pytest.approx(_truth(chunk), rel=0.02)
    # And it finds no such cost where there is none.
    assert ShapeCostModel(_profile()).head_s < 1e-4
    mixed_only = ShapeProfile(tuple(s for s in _profile().steps if s.num_prefill_tokens and s.num_decodes), 0.0)
    with pytest.raises(ValueError, match="no decode-only or prefill-only batch"):
        ShapeCostModel(mixed_only)


def test_time_scale_follows_the_machine_speed() -> None:
    profile = _profile(_truth_with_head)
    base, slow = ShapeCostModel(profile), ShapeCostModel(profile, time_scale=1.5)
    for shape in (StepShape.hybrid(40, 500, 7, 7 * 1001), StepShape.hybrid(0, 0, 16, 16 * 257)):
        assert slow.predict_shape(shape) == pytest.approx(1.5 * base.predict_shape(shape), rel=1e-9)
        assert slow.model_time(shape) == pytest.approx(1.5 * base.model_time(shape), rel=1e-9)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="time_scale"):
            ShapeCostModel(profile, time_scale=bad)


def test_run_speed_is_the_median_of_measured_over_predicted() -> None:
    model = ShapeCostModel(_profile())
    shapes = [m.shape() for m in _profile().steps[:9]]
    # Seven steps ran 1.3x the prediction; two outliers (a hiccup, a fast one) do not move it.
    times = [1.3 * model.predict_shape(sh) for sh in shapes[:7]] + [9 * model.predict_shape(shapes[7]), 0.0]
    assert run_speed(model, list(zip(shapes, times))) == pytest.approx(1.3, rel=1e-9)
    with pytest.raises(ValueError, match="steps is empty"):
        run_speed(model, [])


@pytest.mark.slow
def test_speed_factor_retimes_mixed_batches_or_given_plans() -> None:
    from sarathi_rt import LLM

    engine = LLM(model="tiny", token_budget=64, max_num_seqs=4, num_kv_blocks=64).engine
    now = measure(engine, profile_batches(30, 4, 24), repeats=3)
    # A profile that says the machine took 50x as long: it runs 1/50 as long now.
    then = ShapeProfile(tuple(replace(s, seconds=tuple(50 * t for t in s.seconds)) for s in now), 0.0)
    assert 1 / 150 < speed_factor(engine, ShapeCostModel(then)) < 3 / 50
    with pytest.raises(ValueError, match="no mixed batch"):
        speed_factor(engine, ShapeCostModel(ShapeProfile(tuple(s for s in then.steps if not s.num_decodes), 0.0)))
    # Given the steps a run will make (here two of a simulation's plans), it re-times those.
    plans = [BatchPlan(0, [PlanEntry(0, 10, 14, True, True), PlanEntry(1, 20, 1, False, True)], 14, 1),
             BatchPlan(1, [PlanEntry(1, 21, 1, False, True)], 0, 1)]
    run, ran = engine.executor.execute, []
    engine.executor.execute = lambda step: ran.append(sorted((c.start_pos, len(c.token_ids)) for c in step.chunks)) \
        or run(step)
    assert 1 / 150 < speed_factor(engine, ShapeCostModel(then), plans) < 3 / 50
    del engine.executor.execute
    assert {tuple(r) for r in ran} == {((10, 14), (20, 1)), ((21, 1),)}
    with pytest.raises(ValueError, match="plans must be"):
        speed_factor(engine, ShapeCostModel(then), [])


@pytest.mark.slow
def test_measure_the_engine_by_shape() -> None:
    from sarathi_rt import LLM

    engine = LLM(model="tiny", token_budget=64, max_num_seqs=4, num_kv_blocks=64).engine
    run, ran = engine.executor.execute, []
    engine.executor.execute = lambda step: ran.append(id(step)) or run(step)
    steps = measure(engine, [(0, 0, 4, 30), (24, 10, 0, 0), (8, 30, 2, 30)], repeats=2, warmup=0)
    del engine.executor.execute
    assert [(s.num_prefill_tokens, s.num_decodes, len(s.seconds)) for s in steps] == [(0, 4, 2), (24, 0, 2), (8, 2, 2)]
    # In rounds: every batch once before any batch twice (load drift becomes noise).
    assert len(set(ran[:3])) == 3 and set(ran[3:]) == set(ran[:3])
    assert all(t > 0 for s in steps for t in s.seconds)
    with pytest.raises(ValueError, match="KV blocks"):
        measure(engine, [(0, 0, 4, 1000)])


@pytest.mark.slow
def test_bench_simulates_a_saved_profile(tmp_path) -> None:
    _profile().save(tmp_path / "p.json")
    out = tmp_path / "b"
    assert main(["bench", "--simulate", "--step-profile", str(tmp_path / "p.json"), "--policy", "sarathi",
                 "--num-requests", "10", "--length-scale", "0.02", "--token-budget", "64", "--max-num-seqs", "8",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())["sarathi"]
    assert summary["tbt_p50"] >= 0.002 + 0.010  # host + at least a one-row step

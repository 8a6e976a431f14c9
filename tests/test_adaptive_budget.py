"""Hardware presets, the step shape, the SLO-adaptive budget of the sarathi policy and
the engine's online step-time model (all without torch or a model)."""
from __future__ import annotations

import random
import shutil

import pytest

from sarathi_rt.measure.metrics import percentile
from sarathi_rt.scheduler import BatchPlan, PlanEntry, SchedulerConfig, create_scheduler
from sarathi_rt.scheduler.adaptive import MAX_DECODE_HEADROOM_STEPS
from sarathi_rt.step_time.shape import MAX_RATE_PROBES, StepShape, adaptive_prefill_tokens, predict
from sarathi_rt.sim import (A100, H100, H200, LinearCostModel, PipelineLatency, TableCostModel, VidurCostModel,
                            get_hardware, infer_hardware, simulate)
from sarathi_rt.step_time.online import OnlineStepTimeModel
from sarathi_rt.workloads import WorkloadConfig, data_path, make_workload

PROFILE = data_path("a100_llama-2-7b_mlp.csv.gz")


def test_hardware_presets_and_inference(tmp_path) -> None:
    assert (A100.peak_flops, A100.mem_bw, A100.mem_bytes) == (312e12, 2039e9, 80e9)
    assert (H100.peak_flops, H100.mem_bw, H100.mem_bytes) == (989e12, 3.35e12, 80e9)
    assert (H200.peak_flops, H200.mem_bw, H200.mem_bytes) == (989e12, 4.8e12, 141e9)
    assert get_hardware("H100") is H100 and get_hardware(H200) is H200
    with pytest.raises(ValueError, match="hardware must be one of"):
        get_hardware("v100")
    assert infer_hardware("profiles/h100_llama-2-7b_mlp.csv.gz") is H100
    assert infer_hardware("/x/h200/mlp.csv") is H200
    assert infer_hardware("a100_vs_h100.csv") is None and infer_hardware("mlp.csv") is None
    h100_path = tmp_path / "h100_llama-2-7b_mlp.csv.gz"
    shutil.copy(PROFILE, h100_path)
    a100, h100 = VidurCostModel(PROFILE), VidurCostModel(str(h100_path))
    assert a100.hw is A100 and h100.hw is H100
    assert VidurCostModel(str(h100_path), hardware="h200").hw is H200
    decodes = StepShape.hybrid(0, 0, 64, 64 * 2048)  # memory-bound: scales with HBM bandwidth
    att_a, head_a = a100.attention_and_head_time(decodes)
    att_h, head_h = h100.attention_and_head_time(decodes)
    assert att_a / att_h == pytest.approx(3.35e12 / 2039e9)
    assert head_a / head_h == pytest.approx(989 / 312)
    # KV capacity follows memory: the same weights leave 141 GB * 0.9 - 13.5 GB on an H200.
    a, h = VidurCostModel(PROFILE, hardware="a100"), VidurCostModel(PROFILE, hardware="h200")
    assert h.kv_cache_blocks(16) / a.kv_cache_blocks(16) == pytest.approx((126.9 - 13.5) / (72 - 13.5), rel=0.02)


def test_step_shape_of_plan_and_hybrid() -> None:
    plan = BatchPlan(1, [PlanEntry("a", 10, 4, True, False), PlanEntry("b", 99, 1, False, True),
                         PlanEntry("c", 0, 3, True, True)], num_prefill_tokens=7, num_decode_tokens=1)
    s = StepShape.of_plan(plan)
    assert s == StepShape(7, 4 * 10 + 10 + 6, 14 + 3, 1, 100, 2)
    assert StepShape.hybrid(3, 0, 1, 100) == StepShape(3, 6, 3, 1, 100, 2)
    assert StepShape.hybrid(0, 50, 2, 30) == StepShape(0, 0, 0, 2, 30, 2)
    cost = LinearCostModel(0.01, 0.001)
    assert predict(cost, 20, [5, 6]) == pytest.approx(0.01 + 0.022)


def test_adaptive_prefill_tokens_search() -> None:
    cost = LinearCostModel(0.01, 0.001)  # limit 0.1 s -> at most 90 tokens
    assert adaptive_prefill_tokens(cost, 0.1, 0, 0, 0, 512, 1) == 90
    assert adaptive_prefill_tokens(cost, 0.1, 10, 100, 0, 512, 16) == 80 - 10  # step of 80 = 5 tiles
    assert adaptive_prefill_tokens(cost, 0.1, 10, 100, 0, 48, 16) == 38  # capped by max_tokens
    assert adaptive_prefill_tokens(cost, 0.1, 95, 100, 0, 512, 1) == 0  # decodes alone break it


class _KneeModel:
    """1 ms per token up to 256 tokens, 3 ms per token beyond: the most tokens per second
    is a step of exactly 256, though bigger ones fit a loose limit."""

    margin = 0.0

    def predict_shape(self, shape: StepShape) -> float:
        n = shape.num_tokens
        return 0.01 + 0.001 * min(n, 256) + 0.003 * max(n - 256, 0)

    def predict_bound(self, shape: StepShape) -> float:
        return self.predict_shape(shape)  # monotone

    def observe(self, plan, seconds: float) -> None:
        pass


def test_adaptive_prefill_tokens_takes_the_fastest_step_within_the_limit() -> None:
    knee = _KneeModel()
    assert adaptive_prefill_tokens(knee, 10.0, 16, 16, 0, 4096, 128) == 256 - 16
    assert adaptive_prefill_tokens(knee, 0.2, 16, 16, 0, 4096, 128) == 128 - 16  # the limit binds first
    # Untiled, the scan prices at most MAX_RATE_PROBES sizes (+ the binary search), not
    # one per token, and lands within one probe spacing of the best.
    calls = []
    counted = lambda self, s: calls.append(s) or knee.predict_shape(s)  # noqa: E731
    counting = type("Counting", (), {"predict_shape": counted, "predict_bound": counted})()
    assert abs(adaptive_prefill_tokens(counting, 10.0, 0, 0, 0, 4096, 1) - 256) <= 4096 // MAX_RATE_PROBES
    assert len(calls) <= 13 + MAX_RATE_PROBES + 1


def test_adaptive_prefill_tokens_with_min_tokens_adds_the_least_time_per_prefill_token() -> None:
    """With min_tokens (the arrival pace while the cache binds) the step takes, of the
    sizes that fit and hold that many prefill tokens, the one whose prefill tokens add
    the least to the decodes' own step. On the knee model that cost only grows with the
    step, so that is the smallest size holding min_tokens (not the fastest step, 256,
    when fewer will do), and the largest that fits when the limit binds first."""
    knee = _KneeModel()
    assert adaptive_prefill_tokens(knee, 10.0, 16, 16, 0, 4096, 128, min_tokens=1) == 128 - 16
    assert adaptive_prefill_tokens(knee, 10.0, 16, 16, 0, 4096, 128, min_tokens=200) == 256 - 16
    assert adaptive_prefill_tokens(knee, 10.0, 16, 16, 0, 4096, 128, min_tokens=300) == 384 - 16
    assert adaptive_prefill_tokens(knee, 0.2, 16, 16, 0, 4096, 128, min_tokens=300) == 128 - 16  # the limit binds


class _SpikeModel(_KneeModel):
    """1 ms per token, but a step of 200-219 tokens (the GEMM library's worst kernel
    choice) takes 0.5 s: not monotone, as a measured profile between two points."""

    def predict_shape(self, shape: StepShape) -> float:
        n = shape.num_tokens
        return 0.5 if 200 <= n < 220 else 0.01 + 0.001 * n

    def predict_bound(self, shape: StepShape) -> float:
        n = shape.num_tokens
        return 0.5 if n >= 200 else self.predict_shape(shape)


def test_adaptive_prefill_tokens_fits_the_bound_of_every_smaller_step() -> None:
    """A step sized for 256 tokens (0.266 s) holds 210 when a prompt ends inside it, and
    that step takes 0.5 s: within a 0.3 s limit the size must be 128, the largest whose
    every smaller step fits. With a limit above the spike, 256 again (the fastest)."""
    spike = _SpikeModel()
    assert spike.predict_shape(StepShape.hybrid(256, 0, 0, 0)) < 0.3
    assert adaptive_prefill_tokens(spike, 0.3, 0, 0, 0, 4096, 128) == 128
    assert adaptive_prefill_tokens(spike, 0.6, 0, 0, 0, 512, 128) == 512


def test_measured_cost_models_bound_every_smaller_step_exactly() -> None:
    """predict_bound of a measured model is the most its prediction takes at any token
    count up to the step's (the measured part's running max; attention and sampling
    only grow), checked by brute force over every count on the A100 vidur profile and
    on a table with a dip, at random sizes."""
    vidur = VidurCostModel(PROFILE)
    table = TableCostModel([16, 64, 128, 192, 256], [0.02, 0.05, 0.09, 0.07, 0.12])
    rng = random.Random(5)
    for n in [1, 2, 100, 1226, 4096, 5000] + [rng.randrange(1, 4200) for _ in range(12)]:
        dense = max(vidur.dense_time(m) for m in range(1, n + 1))
        shape = StepShape.hybrid(n, 0, 0, 0)
        assert vidur.predict_bound(shape) == pytest.approx(dense + sum(vidur.attention_and_head_time(shape)), rel=1e-12)
        assert vidur.predict_bound(shape) >= vidur.predict_shape(shape)
        m = min(n, 300)
        assert table.predict_bound(StepShape.hybrid(m, 0, 0, 0)) == pytest.approx(
            max(table.predict_shape(StepShape.hybrid(k, 0, 0, 0)) for k in range(1, m + 1)), rel=1e-12)
    # The profile is not monotone: some step costs more than a larger one.
    times = [vidur.dense_time(m) for m in range(1, 4097)]
    assert any(a > b for a, b in zip(times, times[1:]))
    assert table.predict_bound(StepShape.hybrid(192, 0, 0, 0)) == pytest.approx(0.09)


class _DecodeOverheadModel:
    """The knee model's cost for the prefill chunk alone (fastest at 256 tokens) plus
    1 s per decode (a long-context decode, exaggerated): beside a decode, a step's
    prefill tokens per second keep growing with the chunk (the decode's second spread
    over more of them)."""

    margin = 0.0

    def predict_shape(self, shape: StepShape) -> float:
        p = shape.num_prefill_tokens
        return 0.01 + 1.0 * shape.num_decodes + 0.001 * min(p, 256) + 0.003 * max(p - 256, 0)

    def predict_bound(self, shape: StepShape) -> float:
        return self.predict_shape(shape)  # monotone

    def observe(self, plan, seconds: float) -> None:
        pass


def test_adaptive_prefill_tokens_takes_the_chunk_fastest_alone_while_the_decodes_set_the_steps() -> None:
    """A decode that runs 10 more steps anyway: a backlog of 2000 prefill tokens clears
    within them at 255 a step (the chunk that prefills fastest on its own), so a larger
    chunk saves no step and only slows each one. 3000 do not clear: the prefill sets the
    number of steps, and the step that prefills the most tokens per second (the largest
    within the 10 s limit, 24 tiles) takes the fewest seconds. Without a backlog or
    steps ahead given, that step as well."""
    m = _DecodeOverheadModel()
    assert adaptive_prefill_tokens(m, 10.0, 1, 1, 0, 4096, 128) == 24 * 128 - 1
    assert adaptive_prefill_tokens(m, 10.0, 1, 1, 0, 4096, 128, backlog=2000, decode_steps=10) == 256 - 1
    assert adaptive_prefill_tokens(m, 10.0, 1, 1, 0, 4096, 128, backlog=3000, decode_steps=10) == 24 * 128 - 1
    assert adaptive_prefill_tokens(m, 10.0, 1, 1, 0, 4096, 128, backlog=2000, decode_steps=0) == 24 * 128 - 1


def test_adaptive_budget_sizes_the_chunk_by_who_sets_the_steps() -> None:
    """Request 0 decodes with 40 (or 2) tokens to go when request 1's 2000-token prompt
    arrives, and the cache holds both. With 40 steps of decoding ahead the prompt clears
    within them at 255 tokens a step (the chunk fastest on its own beside the decode),
    so the step takes that; with 2 steps ahead it would not, the prefill sets the number
    of steps, and the step that prefills the most tokens per second takes it whole."""
    def first_chunk(decode_tokens: int) -> int:
        s = _adaptive(10.0, _DecodeOverheadModel(), token_budget=4096, tile_size=128, block_size=16)
        s.add_request(0, 4, decode_tokens + 1)
        s.update(s.schedule())
        s.add_request(1, 2000, 2)
        return s.schedule().num_prefill_tokens

    assert first_chunk(40) == 256 - 1
    assert first_chunk(2) == 2000



def test_slo_margin_defaults_to_the_step_time_models_own() -> None:
    """The budget holds back the step-time model's margin unless the config names one:
    none for the simulator's cost model (its predictions are the steps' times), 10% for
    the engine's learned model. LinearCostModel(0.01, 0.001) at a 0.1 s SLO: 90 prefill
    tokens with no margin, 80 with 10%."""
    def first_chunk(model, **kw) -> int:
        s = create_scheduler(SchedulerConfig(token_budget=512, max_num_seqs=4, tbt_slo=0.1, **kw), model)
        s.add_request(0, 1000, 2)
        return s.schedule().num_prefill_tokens

    cost = LinearCostModel(0.01, 0.001)
    assert SchedulerConfig().slo_margin is None
    assert cost.margin == 0.0 and PipelineLatency(cost, 2).margin == 0.0 and OnlineStepTimeModel().margin == 0.1
    assert first_chunk(cost) == 90
    assert first_chunk(cost, slo_margin=0.1) == 80
    learned = OnlineStepTimeModel()
    for n in [16, 64, 128, 256, 512, 32, 100, 8, 300, 200] * 20:  # the early misfits leave its error window
        learned.observe(BatchPlan(1, [PlanEntry("x", 0, n, True, True)], num_prefill_tokens=n), 0.01 + 0.001 * n)
    # The fit is exact up to rounding, and the guard a hair above 0.
    assert 78 <= first_chunk(learned) == first_chunk(learned, slo_margin=0.1) <= 80
    assert 88 <= first_chunk(learned, slo_margin=0.0) <= 90


def _adaptive(slo: float, cost, **kw):
    base = dict(policy="sarathi", token_budget=512, max_num_seqs=64, num_blocks=4096, tbt_slo=slo, slo_margin=0.0)
    base.update(kw)
    return create_scheduler(SchedulerConfig(**base), cost)


def test_adaptive_budget_schedules_decodes_first_and_fills_to_the_slo() -> None:
    cost = LinearCostModel(0.01, 0.001)
    s = _adaptive(0.1, cost, tile_size=16)
    for i in range(3):
        s.add_request(i, 1000, 100)
    plan = s.schedule()  # nothing else runs: 80 prefill tokens (5 tiles, 0.09 s)
    assert plan.num_prefill_tokens == 80 and plan.num_decode_tokens == 0
    s.update(plan)
    for _ in range(20):  # request 0 finishes its prompt, then decodes beside request 1's chunks
        plan = s.schedule()
        assert cost.step_time(plan) <= 0.1 and plan.num_tokens % 16 == 0
        s.update(plan)
    assert plan.num_decode_tokens == 1 and plan.num_prefill_tokens == 79
    # A static config with the same budget is the old policy, byte for byte.
    static = create_scheduler(SchedulerConfig(token_budget=512, max_num_seqs=64, tile_size=16))
    static.add_request(0, 1000, 4)
    assert static.schedule().num_prefill_tokens == 512


def test_adaptive_budget_never_starves_decodes_nor_the_prompts_beside_them() -> None:
    cost = LinearCostModel(0.05, 0.001)
    s = _adaptive(0.04, cost, tile_size=16)  # no step of any size meets 40 ms
    s.add_request(0, 100, 3)
    plan = s.schedule()
    assert plan.num_prefill_tokens == 16  # one tile: nothing else runs
    s.update(plan)
    while s.request_info(0).num_computed < 100:
        s.update(s.schedule())
    s.add_request(1, 100, 3)
    # A decode is running and misses the SLO alone: holding prefill back cannot help it and
    # would keep request 1 out until request 0 finishes, so prefill fills the decode's tile.
    plan = s.schedule()
    assert plan.num_decode_tokens == 1 and plan.num_prefill_tokens == 15 and plan.tile_padding == 0
    s.update(plan)
    s.update(s.schedule())  # request 0 finishes
    assert s.schedule().num_prefill_tokens == 16


def _run(s) -> tuple[list, list]:
    plans, preempted = [], []
    while s.has_unfinished():
        plan = s.schedule()
        plans.append(plan)
        preempted += plan.preempted
        s.update(plan)
    return plans, preempted


def test_adaptive_budget_leaves_running_decodes_their_blocks() -> None:
    """A 10-block cache (4 tokens a block): request 0 decodes and will need a third
    block in 4 steps; request 1's 32-token prompt needs 8 blocks and 8 are free. A
    budget that allows the whole prompt takes them all, and request 0's next block then
    comes from preempting request 1, whose prompt is thrown away and recomputed. The
    adaptive budget leaves that block free: request 1 prefills 28 tokens while request 0
    decodes (paced to its arrival, see the next test: 16, 11, then the 1 token the
    headroom leaves) and the rest once request 0 is done; nothing is preempted."""
    def scheduler(**kw):
        base = dict(token_budget=64, max_num_seqs=4, block_size=4, num_blocks=10, watermark=0.0)
        base.update(kw)
        s = create_scheduler(SchedulerConfig(**base), LinearCostModel(0.01, 0.001) if "tbt_slo" in kw else None)
        s.add_request(0, 4, 8)
        s.update(s.schedule())  # request 0's prompt; it decodes from now on
        s.update(s.schedule())  # its first decode takes its second block
        s.add_request(1, 32, 2)
        return s

    static_plans, static_preempted = _run(scheduler())
    assert static_plans[0].num_prefill_tokens == 32 and set(static_preempted) == {1}
    assert sum(p.num_prefill_tokens for p in static_plans) > 32  # the prompt again, at least once
    plans, preempted = _run(scheduler(tbt_slo=1.0, slo_margin=0.0))
    assert preempted == []
    assert sum(p.num_prefill_tokens for p in plans if p.entries[0].request_id == 0) == 28
    assert sum(p.num_prefill_tokens for p in plans) == 32  # nothing recomputed


def test_adaptive_budget_paces_prefill_to_arrivals_while_the_cache_binds() -> None:
    """Request 0 decodes (40 tokens to go); requests 1 and 2 (64-token prompts) arrive
    together. With 400 blocks everything fits, and the step takes the SLO-sized chunk:
    all 127 tokens the budget leaves. With 40 blocks the three cannot all run to their
    end, so prefilling faster than the prompts arrived would only fill the cache
    sooner: the step prefills the 128 pending tokens over the 2 steps since they arrived
    (64), then request 2's 64 over 3 (22), and so on; every prompt token runs once."""
    def scheduler(num_blocks: int):
        s = create_scheduler(SchedulerConfig(token_budget=128, max_num_seqs=4, block_size=4, num_blocks=num_blocks,
                                             watermark=0.0, tbt_slo=1.0, slo_margin=0.0),
                             LinearCostModel(0.01, 0.001))
        s.add_request(0, 4, 41)
        s.update(s.schedule())
        s.add_request(1, 64, 2)
        s.add_request(2, 64, 2)
        return s

    plans, preempted = _run(scheduler(400))
    assert plans[0].num_prefill_tokens == 127
    plans, preempted = _run(scheduler(40))
    assert [p.num_prefill_tokens for p in plans[:2]] == [64, 22]
    assert preempted == [] and sum(p.num_prefill_tokens for p in plans) == 128


def test_adaptive_budget_caps_one_prompts_chunk_while_the_cache_binds() -> None:
    """While the cache binds, one prompt's chunk is at most the larger of the chunk that
    prefills fastest alone (256 on the decode-overhead model) and the recent arrival rate
    (prompt tokens of the last MAX_DECODE_HEADROOM_STEPS steps per step, tile-aligned).
    Two 1000-token prompts that just arrived pace at their whole length, but arrive at
    32 tokens a step: 256 (less the decode's token, for the tile). Forty arrive at 625 a
    step: 640. With room for all, no cap: the prefill sets the steps (the decode ends in
    2), and the step that prefills fastest beside the decode takes a whole prompt."""
    def first_chunk(num_prompts: int, num_blocks: int) -> int:
        s = create_scheduler(SchedulerConfig(token_budget=4096, max_num_seqs=64, block_size=16, num_blocks=num_blocks,
                                             watermark=0.0, tile_size=128, tbt_slo=100.0, slo_margin=0.0),
                             _DecodeOverheadModel())
        s.add_request("decode", 4, 3)
        s.update(s.schedule())
        for i in range(num_prompts):
            s.add_request(i, 1000, 2)
        plan = s.schedule()
        assert plan.num_decode_tokens == 1
        return max(e.num_tokens for e in plan.entries if e.is_prefill)

    assert MAX_DECODE_HEADROOM_STEPS == 64
    assert first_chunk(2, 100) == 256 - 1
    assert first_chunk(40, 100) == 640 - 1
    assert first_chunk(2, 400) == 1000


def test_adaptive_budget_config_errors() -> None:
    with pytest.raises(ValueError, match="tbt_slo"):
        SchedulerConfig(tbt_slo=0.0)
    with pytest.raises(ValueError, match="slo_margin"):
        SchedulerConfig(tbt_slo=0.1, slo_margin=1.0)
    with pytest.raises(ValueError, match="not supported by policy 'vllm'"):
        SchedulerConfig(policy="vllm", tbt_slo=0.1)
    with pytest.raises(ValueError, match="step_time_model"):
        create_scheduler(SchedulerConfig(tbt_slo=0.1))


@pytest.mark.slow
@pytest.mark.parametrize("online", [False, True])
def test_adaptive_simulation_meets_the_slo(online: bool) -> None:
    """ShareGPT on the A100 profile at a load where a 2048 budget breaks 100 ms: the
    adaptive budget keeps every prefill-carrying step within the SLO, whether it asks
    the cost model or learns the steps online."""
    cost = VidurCostModel(PROFILE)
    workload = make_workload(WorkloadConfig(num_requests=60, qps=2.0, seed=1))
    blocks = cost.kv_cache_blocks()
    static = simulate(workload, SchedulerConfig(token_budget=2048, max_num_seqs=128, num_blocks=blocks), cost)
    assert static.summary().tbt.p99 > 0.1
    cfg = SchedulerConfig(token_budget=4096, max_num_seqs=128, num_blocks=blocks, tile_size=128, tbt_slo=0.1)
    model = OnlineStepTimeModel() if online else None
    res = simulate(workload, cfg, cost, step_time_model=model)
    over = [s for s in res.steps if s.num_prefill_tokens and s.duration > 0.1]
    assert len(over) <= (0.01 * len(res.steps) if online else 0)
    assert res.summary().tbt.p99 <= 0.1 and res.summary().num_finished == 60
    assert max(s.num_tokens for s in res.steps) > 512  # it does fill steps, not just play safe


def test_online_model_starts_conservative_and_learns() -> None:
    m = OnlineStepTimeModel(quantile=0.9, min_observations=8)
    shape = StepShape.hybrid(100, 0, 4, 400)
    assert m.predict_shape(shape) == float("inf")
    rng = random.Random(0)
    truth = LinearCostModel(0.005, 2e-4)

    def run(n: int, d: int) -> None:
        plan = BatchPlan(0, [PlanEntry(i, 100, 1, False, True) for i in range(d)])
        plan.num_decode_tokens = d
        if n:
            plan.entries.append(PlanEntry("p", 0, n, True, False))
            plan.num_prefill_tokens = n
        m.observe(plan, truth.step_time(plan) * (1 + 0.05 * rng.random()))

    run(64, 4)
    # Cold: the largest step seen, scaled up linearly with tokens, never below it.
    assert m.predict_shape(StepShape.hybrid(132, 0, 4, 400)) == pytest.approx(2 * m.predict_shape(
        StepShape.hybrid(2, 0, 4, 400)), rel=1e-9)
    for _ in range(200):
        run(rng.randrange(0, 400), rng.randrange(1, 16))
    errors = []
    for _ in range(200):
        n, d = rng.randrange(1, 400), rng.randrange(1, 16)
        p = m.predict_shape(StepShape.hybrid(n, 0, d, 101 * d))
        actual = truth.fixed_s + truth.per_token_s * (n + d)
        errors.append((p - actual) / actual)
    # It over-predicts by about the 90th percentile of the 5% noise, rarely more, never under.
    assert min(errors) >= 0 and percentile(errors, 50) < 0.08
    # Beyond the largest step seen it does not extrapolate down.
    big = StepShape.hybrid(4000, 0, 4, 400)
    assert m.predict_shape(big) >= 0.9 * (truth.fixed_s + truth.per_token_s * 4004)
    with pytest.raises(ValueError, match="seconds"):
        m.observe(BatchPlan(0, [PlanEntry(0, 0, 1, True, True)], num_prefill_tokens=1), float("nan"))
    with pytest.raises(ValueError, match="quantile"):
        OnlineStepTimeModel(quantile=1.0)
    with pytest.raises(ValueError, match="error_window"):
        OnlineStepTimeModel(error_window=4)


def test_online_guard_scales_with_the_step_and_follows_a_change_of_mix() -> None:
    """Noise that is a share of the step (10%): a quiet phase of small steps with a rare
    large one, then a burst of large steps. A guard of the small steps' absolute errors
    would under-forecast about half of the large ones; the relative guard covers them
    from the first, and a noisier burst shows in it within a few steps."""
    rng = random.Random(1)
    truth = LinearCostModel(0.005, 2e-4)
    m = OnlineStepTimeModel()

    def plan_of(n: int) -> BatchPlan:
        return BatchPlan(0, [PlanEntry("p", 0, n, True, True)], num_prefill_tokens=n)

    def step(n: int, noise: float) -> bool:
        plan = plan_of(n)
        seconds = truth.step_time(plan) * (1 + noise * rng.random())
        under = m.predict_shape(StepShape.of_plan(plan)) < seconds
        m.observe(plan, seconds)
        return under

    for i in range(600):
        step(500 if i % 150 == 0 else rng.randrange(16, 64), 0.1)
    assert sum(step(rng.randrange(400, 500), 0.1) for _ in range(100)) <= 3
    noisier = [step(rng.randrange(400, 500), 0.3) for _ in range(60)]
    assert sum(noisier[10:]) <= 2


@pytest.mark.slow
def test_engine_with_tbt_slo_learns_its_steps() -> None:
    from sarathi_rt import LLM, SamplingParams

    llm = LLM("tiny", token_budget=128, max_num_seqs=8, num_kv_blocks=64, tbt_slo=10.0)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[5 + i] * (20 + 7 * i) for i in range(4)], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6] * 4
    steps = list(llm.engine.step_metrics)
    assert all(s.predicted_duration is not None for s in steps)
    assert llm.engine.step_time_model.num_observed == len(steps)
    # Having seen no step, the model forecasts nothing (inf): the first step gets the
    # minimum progress of 128 tokens (all four prompts); later ones are forecast.
    assert steps[0].num_prefill_tokens == 122 and steps[0].predicted_duration == float("inf")
    assert all(0 < s.predicted_duration < 10.0 for s in steps[1:])
    with pytest.raises(ValueError, match="tbt_slo"):
        LLM("tiny", num_kv_blocks=64, tbt_slo=-1.0)
    with pytest.raises(ValueError, match="not supported by policy 'vllm'"):
        LLM("tiny", num_kv_blocks=64, policy="vllm", tbt_slo=0.1)


def test_adaptive_budget_with_pipeline_stages_sizes_each_micro_batch() -> None:
    """Two stages: each micro-batch's trip through both (compute plus one send) is sized
    to the SLO, which keeps P99 TBT within it where a static 2048 budget breaks it."""
    cost = VidurCostModel(PROFILE)
    trip = PipelineLatency(cost, 2)
    shape = StepShape.hybrid(256, 0, 8, 8 * 500)
    assert trip.predict_shape(shape) == pytest.approx(cost.predict_shape(shape) + cost.comm_time(264))
    workload = make_workload(WorkloadConfig(num_requests=60, qps=4.0, seed=1))
    blocks = cost.kv_cache_blocks()
    static = SchedulerConfig(token_budget=2048, max_num_seqs=128, num_blocks=blocks, max_partial_prefills=2)
    assert simulate(workload, static, cost, pipeline_stages=2).summary().tbt.p99 > 0.1
    cfg = SchedulerConfig(token_budget=4096, max_num_seqs=128, num_blocks=blocks, tile_size=128, tbt_slo=0.1,
                          max_partial_prefills=2)
    res = simulate(workload, cfg, cost, pipeline_stages=2)
    assert res.summary().tbt.p99 <= 0.1 and res.summary().num_finished == 60
    assert max(s.num_tokens for s in res.steps) > 512


@pytest.mark.slow
def test_engine_adaptive_budget_learns_micro_batches_of_a_pipeline() -> None:
    """With two micro-batches in flight the online model learns each one's time from its
    submission to its output (what its requests wait for their next token)."""
    from sarathi_rt import SamplingParams
    from sarathi_rt.engine import EngineConfig, LLMEngine
    from sarathi_rt.engine.executor import InProcessExecutor
    from sarathi_rt.models import resolve_model

    class TwoDeep(InProcessExecutor):  # a pipeline's driver-side behaviour, in-process
        pipeline_depth = 2
        most_in_flight = 0

        def submit(self, step) -> None:
            super().submit(step)
            self.most_in_flight = max(self.most_in_flight, len(self._done))

    config = EngineConfig(model="tiny", token_budget=32, max_num_seqs=8, num_kv_blocks=64, tbt_slo=10.0,
                          pipeline_parallel_size=2)
    executor = TwoDeep(config, resolve_model(config.model))
    engine = LLMEngine(config, executor=executor)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i in range(4):  # a whole prompt per micro-batch (the budget) keeps both stages fed
        engine.add_request(i, [5 + i] * 32, params)
    tokens: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    assert [len(tokens[i]) for i in range(4)] == [5] * 4
    steps = list(engine.step_metrics)
    assert executor.most_in_flight == 2  # two micro-batches did run at once
    assert engine.step_time_model.num_observed == len(steps) > 5
    assert all(0 < s.predicted_duration < 10.0 for s in steps[-3:])

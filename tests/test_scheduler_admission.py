"""Admission on slow hardware: a running decode that already misses its TBT target never
keeps a new request out (the sarathi policy's AdaptiveBudget.size rule), with the server's
default service tiers and any step time from 0.01 s to 2 s."""
from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sarathi_rt.commands.serve import DEFAULT_SERVICE_TIERS
from sarathi_rt.scheduler import SchedulerConfig, create_scheduler
from sarathi_rt.sim.cost import LinearCostModel
from sarathi_rt.step_time.shape import StepShape

TIERS = list(DEFAULT_SERVICE_TIERS)


def _config(qos_policy: str) -> SchedulerConfig:
    """The server's defaults: the sarathi policy, its three tiers under `qos_policy`."""
    return SchedulerConfig(token_budget=512, max_num_seqs=64, block_size=16, num_blocks=4096,
                           qos_classes=DEFAULT_SERVICE_TIERS, default_qos="default", qos_policy=qos_policy)


def _first_step_of_second(qos_policy: str, step_s: float) -> tuple[int, bool]:
    """One request generating 600 tokens, a second added at step 200, steps of `step_s`
    seconds: (the step the second first runs in, whether it was relegated)."""
    cost = LinearCostModel(fixed_s=step_s, per_token_s=0.0)
    sched = create_scheduler(_config(qos_policy), cost)
    sched.add_request("long", 20, 600, arrival_time=0.0)
    now, step = 0.0, 0
    while sched.has_unfinished():
        if step == 200:
            sched.add_request("late", 20, 5, arrival_time=now)
        plan = sched.schedule(now)
        if any(e.request_id == "late" for e in plan.entries):
            return step, sched.request_info("late").relegated
        sched.update(plan)
        now += cost.predict_shape(StepShape.of_plan(plan))
        step += 1
    raise AssertionError("the second request never ran")


def test_a_decode_over_the_default_tier_does_not_starve_admission() -> None:
    """The defect: with 0.3 s steps (the default tier's TBT is 0.25 s) the deadline policy
    gave prefill 0 tokens while the first request decoded, so the second first ran at
    step 600; FCFS runs it at once. Now both do, at every step time in the range."""
    for step_s in (0.01, 0.2, 0.3, 0.5, 1.0, 2.0):
        assert _first_step_of_second("fcfs", step_s) == (200, False)
        assert _first_step_of_second("deadline", step_s) == (200, False), step_s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fixed_s=st.floats(0.01, 2.0), per_token_s=st.sampled_from([0.0, 1e-5, 1e-4, 1e-3]),
       requests=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 300), st.integers(1, 80),
                                   st.sampled_from(TIERS)), min_size=1, max_size=10))
def test_admission_waits_only_for_decodes_that_meet_their_target(fixed_s: float, per_token_s: float,
                                                                 requests: list[tuple[int, int, int, str]]) -> None:
    """Random step times, class mixes and arrivals under the server's tiers: in every step
    that leaves a waiting request out with room to admit it (no prefill at all), the
    step's decodes alone meet their limit, so the wait ends when the next of them
    finishes; and every request finishes with every block back."""
    cost = LinearCostModel(fixed_s=fixed_s, per_token_s=per_token_s)
    cfg = _config("deadline")
    sched = create_scheduler(cfg, cost)
    todo = sorted(enumerate(requests), key=lambda x: x[1][0])
    now, step, arrived = 0.0, 0, {}
    while todo or sched.has_unfinished():
        assert step < 5000, "no progress"
        while todo and todo[0][1][0] <= step:
            rid, (_, prompt, max_new, tier) = todo.pop(0)
            sched.add_request(rid, prompt, max_new, qos=tier, arrival_time=now)
            arrived[rid] = now
        waiting = sched.num_waiting > 0 and sched.num_running < cfg.max_num_seqs
        plan = sched.schedule(now)
        prefill = plan.num_tokens - plan.num_decode_tokens
        if waiting and prefill == 0 and plan.entries:
            decodes = StepShape.hybrid(0, 0, plan.num_decode_tokens,
                                       sum(e.start_pos + 1 for e in plan.entries))
            # Each decode's limit as adaptive.step_limit has it: its next token's deadline,
            # or its tier's TBT once it is behind.
            limit = float("inf")
            for e in plan.entries:
                info = sched.request_info(e.request_id)
                tier = DEFAULT_SERVICE_TIERS[info.qos]
                if not info.relegated:
                    due = tier.deadline(arrived[e.request_id], info.num_generated)
                    limit = min(limit, max(due - now, tier.tbt))
            assert cost.predict_shape(decodes) <= limit, \
                f"step {step}: decodes over their limit kept a waiting request out"
        sched.update(plan)
        now += cost.predict_shape(StepShape.of_plan(plan)) if plan.entries else 0.05
        step += 1
    assert sched.num_free_blocks == cfg.num_blocks


def _token_times(qos_policy: str, cost: LinearCostModel,
                 requests: list[tuple[int, int, int, str]]) -> dict[int, tuple[float, list[float], bool]]:
    """Each request's (arrival time, token times, relegated) under `qos_policy`."""
    sched = create_scheduler(_config(qos_policy), cost)
    todo = sorted(enumerate(requests), key=lambda x: x[1][0])
    now, step, out = 0.0, 0, {}
    while todo or sched.has_unfinished():
        while todo and todo[0][1][0] <= step:
            rid, (_, prompt, max_new, tier) = todo.pop(0)
            sched.add_request(rid, prompt, max_new, qos=tier, arrival_time=now)
            out[rid] = (now, [], False)
        plan = sched.schedule(now)
        now += cost.predict_shape(StepShape.of_plan(plan)) if plan.entries else 0.05
        for e in plan.entries:
            arrival, times, relegated = out[e.request_id]
            if e.emits_token:
                times.append(now)
            out[e.request_id] = (arrival, times, relegated or sched.request_info(e.request_id).relegated)
        sched.update(plan)
        step += 1
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fixed_s=st.floats(0.01, 2.0), per_token_s=st.sampled_from([0.0, 1e-5, 1e-4, 1e-3]),
       tier=st.sampled_from(TIERS),
       requests=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 300), st.integers(1, 80)),
                         min_size=1, max_size=10))
# Urgency counted for the first waiting prompt only: it needed 1 token, the 257 behind it more.
@example(fixed_s=2.0, per_token_s=0.0, tier="default", requests=[(0, 1, 1), (0, 255, 2), (0, 257, 1), (0, 257, 1)])
def test_nothing_is_relegated_where_fcfs_meets_every_deadline(fixed_s: float, per_token_s: float, tier: str,
                                                              requests: list[tuple[int, int, int]]) -> None:
    """One tier at a time (across tiers the deadline policy saves a higher tier at a lower
    one's expense by design). Where FCFS meets every deadline of every request, the
    deadline policy relegates nobody. (Where FCFS misses some, the two trade: FCFS may
    serve a first token on time by making a running decode late, which the deadline
    policy does not do, and relegates the prompt instead.)"""
    cost = LinearCostModel(fixed_s=fixed_s, per_token_s=per_token_s)
    reqs = [(t, p, m, tier) for t, p, m in requests]
    cls = DEFAULT_SERVICE_TIERS[tier]
    fcfs = _token_times("fcfs", cost, reqs)
    if all(cls.attained(arrival, times, True) for arrival, times, _ in fcfs.values()):
        relegated = [rid for rid, (_, _, r) in _token_times("deadline", cost, reqs).items() if r]
        assert not relegated, f"relegated {relegated}, which FCFS served on time"

"""Property tests: random arrivals, lengths, aborts, stops, cache sizes and pipeline
depths for every policy, checked step by step against a shadow model."""
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sarathi_rt.scheduler import (RequestStatus, SchedulerConfig, available_policies,
                                  create_scheduler, get_policy)

pytestmark = pytest.mark.slow  # long: runs in the full suite (scripts/test.sh), not the quick lane

HYBRID = {"sarathi", "orca", "decode_maximal"}  # every idle decode runs every step

request_st = st.tuples(
    st.integers(0, 30),  # arrival step
    st.integers(1, 120),  # prompt tokens
    st.integers(1, 40),  # max new tokens
    st.one_of(st.none(), st.integers(0, 60)),  # abort at this step
    st.one_of(st.none(), st.integers(1, 40)),  # stop (e.g. EOS) after this many tokens
)

scenario_st = st.fixed_dictionaries({
    "requests": st.lists(request_st, min_size=1, max_size=16),
    "token_budget": st.sampled_from([16, 64, 128, 256]),
    "chunk_frac": st.sampled_from([0.25, 0.5, 1.0]),
    "block_size": st.sampled_from([1, 4, 16]),
    "num_blocks": st.integers(4, 80),
    "max_num_seqs": st.integers(1, 16),
    "tile_size": st.sampled_from([None, 8, 32]),
    "max_partial_prefills": st.integers(1, 3),
    "long_prefill_threshold": st.sampled_from([None, 24]),
    "watermark": st.sampled_from([0.0, 0.05]),
    "depth": st.sampled_from([1, 1, 2, 3]),  # plans in flight (pipeline stages)
})


class Shadow:
    """What the test expects of one request."""

    def __init__(self, rid, prompt, max_new, stop):
        self.rid, self.prompt, self.max_new, self.stop = rid, prompt, max_new, stop
        self.target, self.computed, self.generated = prompt, 0, 0
        self.state = "waiting"  # running / finished / aborted
        self.in_flight = False
        self.finished_count = 0
        self.preemptions = 0

    @property
    def is_decode(self):
        return self.state == "running" and self.computed >= self.target


def make_config(policy, sc):
    budget = sc["token_budget"]
    return SchedulerConfig(
        policy=policy, token_budget=budget,
        chunk_size=max(1, int(budget * sc["chunk_frac"])) if get_policy(policy).chunked else None,
        max_num_seqs=min(sc["max_num_seqs"], budget), block_size=sc["block_size"],
        # A budget below one tile is a config error: such draws run untiled.
        num_blocks=sc["num_blocks"], tile_size=sc["tile_size"] if (sc["tile_size"] or 0) <= budget else None,
        max_partial_prefills=sc["max_partial_prefills"],
        long_prefill_threshold=sc["long_prefill_threshold"] if get_policy(policy).adaptive else None,
        watermark=sc["watermark"])


def fits(cfg, sched, prompt, max_new):
    kv = prompt + max_new - 1
    if -(-kv // cfg.block_size) > cfg.num_blocks:
        return False
    return sched.chunked or kv <= cfg.token_budget


def check_plan(cfg, policy, plan, shadows, idle_decodes, in_flight):
    assert plan.num_tokens == plan.num_prefill_tokens + plan.num_decode_tokens
    assert plan.num_tokens == sum(e.num_tokens for e in plan.entries)
    if policy != "vllm" and policy != "request_level":
        assert plan.num_tokens <= cfg.token_budget
    assert plan.num_prefill_tokens <= cfg.token_budget
    if policy in ("vllm", "request_level"):
        assert plan.num_prefill_tokens == 0 or plan.num_decode_tokens == 0
    if cfg.tile_size:
        assert (plan.num_tokens + plan.tile_padding) % cfg.tile_size == 0
    ids = [e.request_id for e in plan.entries]
    assert len(set(ids)) == len(ids)
    assert not set(ids) & in_flight, "a request in an un-updated plan was rescheduled"
    for rid in plan.preempted:
        sh = shadows[rid]
        assert sh.state == "running" and not sh.in_flight
        sh.state, sh.computed, sh.target = "waiting", 0, sh.prompt + sh.generated
        sh.preemptions += 1
    for e in plan.entries:
        sh = shadows[e.request_id]
        assert sh.state in ("waiting", "running") and e.num_tokens >= 1
        assert e.start_pos == sh.computed
        assert e.is_prefill == (sh.computed < sh.target)
        if e.is_prefill:
            assert sh.computed + e.num_tokens <= sh.target
            assert e.emits_token == (sh.computed + e.num_tokens == sh.target)
        else:
            assert e.num_tokens == 1 and e.emits_token
        sh.state, sh.in_flight = "running", True
    if policy in HYBRID:
        left_out = idle_decodes - set(ids) - set(plan.preempted)
        assert not left_out, f"running decodes left out of a step: {left_out}"


def apply_update(sched, plan, shadows, finished_order):
    stopped = []
    for e in plan.entries:
        sh = shadows[e.request_id]
        sh.in_flight = False
        if sh.state != "running":
            continue
        sh.computed += e.num_tokens
        if e.emits_token:
            sh.generated += 1
            if sh.stop is not None and sh.generated >= sh.stop:
                stopped.append(sh.rid)
    finished = sched.update(plan, stopped)
    expect = [e.request_id for e in plan.entries if e.emits_token
              and shadows[e.request_id].state == "running"
              and (shadows[e.request_id].generated >= shadows[e.request_id].max_new
                   or e.request_id in stopped)]
    assert finished == expect
    for rid in finished:
        shadows[rid].state = "finished"
        shadows[rid].finished_count += 1
        finished_order.append(rid)


def check_blocks(cfg, sched, shadows):
    held = sum(sched.request_info(rid).num_blocks for rid in shadows)
    assert cfg.num_blocks - sched.num_free_blocks == held


def check_fcfs(plan, shadows, unscheduled):
    """Requests are first scheduled in arrival order (aborted ones drop out)."""
    new = {e.request_id for e in plan.entries} & set(unscheduled)
    while unscheduled and (unscheduled[0] in new or shadows[unscheduled[0]].state == "aborted"):
        new.discard(unscheduled.popleft())
    assert not new, f"{new} admitted before earlier arrivals"


def run_scenario(policy, sc):
    cfg = make_config(policy, sc)
    sched = create_scheduler(cfg)
    arrivals = sorted(enumerate(sc["requests"]), key=lambda x: (x[1][0], x[0]))
    shadows, pending, finished_order, unscheduled = {}, deque(), [], deque()
    aborts = {}
    steps = 0
    while arrivals or sched.has_unfinished() or pending:
        steps += 1
        assert steps < 20_000, "no progress"
        while arrivals and arrivals[0][1][0] <= steps:
            rid, (_, prompt, max_new, abort_at, stop) = arrivals.pop(0)
            if not fits(cfg, sched, prompt, max_new):
                with pytest.raises(ValueError):
                    sched.add_request(rid, prompt, max_new)
                continue
            sched.add_request(rid, prompt, max_new)
            shadows[rid] = Shadow(rid, prompt, max_new, stop)
            unscheduled.append(rid)
            if abort_at is not None:
                aborts.setdefault(abort_at, []).append(rid)
        for rid in aborts.pop(steps, []):
            live = shadows[rid].state in ("waiting", "running")
            assert sched.abort(rid) == live
            if live:
                shadows[rid].state = "aborted"
        in_flight = {rid for rid, sh in shadows.items() if sh.in_flight}
        idle_decodes = {rid for rid, sh in shadows.items() if sh.is_decode and not sh.in_flight}
        work = sched.has_unfinished()
        plan = sched.schedule()
        # A simulator or engine with nothing in flight must always get work to do.
        assert plan.entries or not work or in_flight, "empty plan with work waiting"
        check_plan(cfg, policy, plan, shadows, idle_decodes, in_flight)
        check_fcfs(plan, shadows, unscheduled)
        pending.append(plan)
        while pending and (len(pending) >= sc["depth"] or plan.is_empty):
            apply_update(sched, pending.popleft(), shadows, finished_order)
        check_blocks(cfg, sched, shadows)
    assert sched.num_free_blocks == cfg.num_blocks
    assert len(finished_order) == len(set(finished_order))
    for rid, sh in shadows.items():
        info = sched.request_info(rid)
        if sh.state == "aborted":
            assert info.status is RequestStatus.ABORTED and sh.finished_count == 0
            continue
        assert sh.state == "finished" and sh.finished_count == 1
        assert info.status is RequestStatus.FINISHED
        assert info.num_generated == sh.generated == min(sh.max_new, sh.stop or sh.max_new)
        assert info.num_preemptions == sh.preemptions and info.first_scheduled_step >= 1


@pytest.mark.parametrize("policy", available_policies())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario_st)
def test_every_policy_finishes_every_request_exactly_once(policy, sc):
    run_scenario(policy, sc)

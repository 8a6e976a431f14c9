"""Shared-prefix workloads, and the simulator with prefix caching: cached tokens cost no
compute and are counted."""
import pytest

from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim import LinearCostModel, simulate
from sarathi_rt.workloads import multi_turn_workload, system_prompt_workload


def test_system_prompt_workload_shares_its_system_prompts():
    wl = system_prompt_workload(40, 2.0, num_system_prompts=3, system_len=64, user_range=(5, 9), seed=1)
    assert [r.request_id for r in wl] == list(range(40))
    assert all(a.arrival_time <= b.arrival_time for a, b in zip(wl, wl[1:])) and wl[0].arrival_time == 0
    heads = {r.prompt_token_ids[:64] for r in wl}
    assert len(heads) == 3
    assert all(69 <= r.num_prompt_tokens == len(r.prompt_token_ids) <= 73 for r in wl)
    assert wl == system_prompt_workload(40, 2.0, num_system_prompts=3, system_len=64, user_range=(5, 9), seed=1)
    with pytest.raises(ValueError, match="num_system_prompts"):
        system_prompt_workload(4, 1.0, num_system_prompts=0)


def test_multi_turn_workload_resends_the_conversation():
    wl = multi_turn_workload(5, 1.0, turns=3, first_len=20, user_range=(4, 6), decode_range=(3, 5),
                             think_time=2.0, seed=2)
    assert len(wl) == 15 and all(a.arrival_time <= b.arrival_time for a, b in zip(wl, wl[1:]))
    by_prefix = {r.prompt_token_ids: r for r in wl}
    follow_ups = 0
    for r in wl:
        for q in wl:  # the turn before r: its prompt and answer open r's prompt
            n = q.num_prompt_tokens + q.num_decode_tokens
            if q is not r and r.prompt_token_ids[:q.num_prompt_tokens] == q.prompt_token_ids and \
                    4 <= r.num_prompt_tokens - n <= 6 and q.arrival_time <= r.arrival_time:
                follow_ups += 1
    assert follow_ups == 10 and len(by_prefix) == 15


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_simulator_charges_no_compute_for_cached_tokens(policy):
    wl = system_prompt_workload(30, 4.0, num_system_prompts=2, system_len=256, user_range=(16, 48),
                                decode_range=(4, 8), seed=0)
    cost = LinearCostModel(0.005, 1e-4)
    cfg = dict(policy=policy, token_budget=512, max_num_seqs=16, block_size=16, num_blocks=512)
    off = simulate(wl, SchedulerConfig(**cfg, enable_prefix_caching=False), cost)
    on = simulate(wl, SchedulerConfig(**cfg, enable_prefix_caching=True), cost)
    cached = sum(r.num_cached_tokens for r in on.requests)
    prompt = sum(r.num_prompt_tokens for r in wl)
    assert off.prefix_cache.queries == 0 and all(r.num_cached_tokens == 0 for r in off.requests)
    assert on.prefix_cache.hits == cached > 0.7 * prompt  # all but the first use of each system prompt
    assert sum(s.num_prefill_tokens for s in on.steps) == prompt - cached
    assert sum(s.num_prefill_tokens for s in off.steps) == prompt
    assert on.summary().prefix_cache_hit_rate == pytest.approx(cached / prompt)
    assert on.summary().ttft.p50 < off.summary().ttft.p50

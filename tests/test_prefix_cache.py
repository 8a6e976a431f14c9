"""Prefix caching in the scheduler: chained keys, hits at admission, LRU eviction,
every policy, and a randomized run that checks refcounts, block accounting and tokens."""

import pytest

from sarathi_rt.scheduler import get_policy, SchedulerConfig, available_policies, block_hashes, create_scheduler


def make(**kw):
    base = dict(policy="sarathi", token_budget=64, max_num_seqs=8, block_size=4, num_blocks=64,
                watermark=0.0, enable_prefix_caching=True)
    base.update(kw)
    return create_scheduler(SchedulerConfig(**base))


def drain(s, limit=1000):
    starts = {}
    for _ in range(limit):
        if not s.has_unfinished():
            return starts
        plan = s.schedule()
        for e in plan.entries:
            starts.setdefault(e.request_id, e.start_pos)
        s.update(plan)
    raise AssertionError("scheduler did not finish")


def test_keys_chain_over_the_prefix_and_skip_a_partial_block():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and all(len(k) == 32 for k in a)
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    # the same block of tokens after a different prefix gets a different key
    assert block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4)[0] == a[0]
    assert block_hashes([1, 2, 3], 4) == []


def test_a_hit_skips_whole_cached_blocks_but_never_the_last_token():
    s = make()
    s.add_request("a", 10, 2, prompt_token_ids=list(range(10)))
    assert drain(s) == {"a": 0}
    s.add_request("b", 13, 2, prompt_token_ids=list(range(10)) + [50, 51, 52])
    s.add_request("c", 8, 2, prompt_token_ids=list(range(8)))  # fully cached: recomputes its last block
    s.add_request("d", 9, 2, prompt_token_ids=[99] + list(range(8)))
    assert drain(s) == {"b": 8, "c": 4, "d": 0}
    assert s.request_info("b").num_cached_tokens == 8 and s.request_info("d").num_cached_tokens == 0
    st = s.prefix_cache_stats()
    assert (st.queries, st.hits, st.evictions) == (10 + 13 + 8 + 9, 12, 0)
    assert st.hit_rate == pytest.approx(12 / 40)
    assert s.num_free_blocks == 64 and s.num_cached_free_blocks > 0


def test_requests_admitted_in_one_step_share_the_same_blocks():
    s = make()
    prefix = list(range(100, 116))
    s.add_request("warm", 17, 1, prompt_token_ids=prefix + [1])
    drain(s)
    for i in range(3):
        s.add_request(i, 18, 4, prompt_token_ids=prefix + [i, i])
    plan = s.schedule()
    assert [(e.start_pos, e.num_tokens) for e in plan.entries] == [(16, 2)] * 3
    tables = [s.block_table(i) for i in range(3)]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert all(s._blocks.refcount(b) == 3 for b in tables[0][:4])
    s.update(plan)
    drain(s)
    assert s.num_free_blocks == 64


def test_caching_off_or_no_ids_changes_nothing():
    ids = list(range(12))
    for s in (make(enable_prefix_caching=False), make()):
        s.add_request("a", 12, 1, prompt_token_ids=ids if s.config.enable_prefix_caching is False else None)
        drain(s)
        s.add_request("b", 12, 1, prompt_token_ids=ids if s.config.enable_prefix_caching is False else None)
        assert drain(s) == {"b": 0} and s.prefix_cache_stats().hits == 0
    with pytest.raises(ValueError, match="prompt_token_ids has 3 ids but num_prompt_tokens is 4"):
        make().add_request("x", 4, 1, prompt_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="prompt_token_ids must hold ints"):
        make().add_request("x", 2, 1, prompt_token_ids=[1, "a"])


def test_eviction_takes_the_least_recently_released_block_only_when_nothing_is_free():
    s = make(num_blocks=6)
    s.add_request("old", 8, 1, prompt_token_ids=[1] * 8)  # 2 blocks, both full
    drain(s)
    s.add_request("new", 8, 1, prompt_token_ids=[2] * 8)
    drain(s)
    assert s.num_cached_free_blocks == 4  # (old, new) x 2 full blocks; their third held 0 tokens
    s.add_request("fill", 8, 1, prompt_token_ids=[3] * 8)  # 2 never-cached blocks are free: no eviction
    drain(s)
    assert s.prefix_cache_stats().evictions == 0
    s.add_request("big", 12, 1, prompt_token_ids=[4] * 12)  # needs 3: evicts the oldest, "old"'s
    drain(s)
    assert s.prefix_cache_stats().evictions == 3
    s.add_request("new2", 8, 1, prompt_token_ids=[2] * 8)
    s.add_request("old2", 8, 1, prompt_token_ids=[1] * 8)
    assert drain(s) == {"new2": 4, "old2": 0}


def test_a_waiting_request_whose_matched_blocks_are_evicted_recomputes_them():
    s = make(num_blocks=8, token_budget=32)
    s.add_request("a", 8, 1, prompt_token_ids=list(range(8)))
    drain(s)
    a_blocks = s._blocks.match(block_hashes(list(range(8)), 4), 2)[0]
    s.add_request("hog", 24, 6, prompt_token_ids=list(range(50, 74)))  # takes the 6 free blocks
    s.add_request("b", 9, 1, prompt_token_ids=list(range(9)))
    s.update(s.schedule())
    assert s._waiting[0].matched == a_blocks  # b matched a's blocks, but no block is left for its last token
    s.update(s.schedule())  # hog's decode needs a 7th block: evicts a's last block, the older
    assert s._waiting[0].matched == a_blocks[:1]
    starts = drain(s)  # hog's 8th block evicts the other: b computes its whole prompt
    assert starts["b"] == 0
    # b's third block evicts one of hog's prompt blocks: its 2 decode blocks were the only free ones
    assert s.prefix_cache_stats().evictions == 3 and s.num_free_blocks == 8


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_uses_the_cache(policy):
    s = make(policy=policy, token_budget=64, **({"chunk_size": 16} if get_policy(policy).chunked else {}))
    shared = list(range(200, 232))
    s.add_request("warm", 33, 2, prompt_token_ids=shared + [1])
    drain(s)
    for i in range(5):
        s.add_request(i, 36, 3, prompt_token_ids=shared + [i] * 4)
    starts = drain(s)
    assert all(starts[i] == 32 for i in range(5)), starts
    assert s.num_free_blocks == 64 and not s.has_unfinished()

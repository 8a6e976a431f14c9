"""Scheduler behaviour: the papers' worked examples, each policy's shape, blocks,
preemption, aborts, pipelining and validation."""
import pytest

from sarathi_rt.scheduler import (BatchPlan, RequestStatus, SchedulerConfig, get_policy,
                                  available_policies, create_scheduler, suggest_chunk_size)


def make(**kw):
    base = dict(policy="sarathi", token_budget=512, chunk_size=None, max_num_seqs=128,
                block_size=16, num_blocks=4096, watermark=0.0)
    base.update(kw)
    return create_scheduler(SchedulerConfig(**base))


def step(s, stopped=()):
    plan = s.schedule()
    return plan, s.update(plan, stopped)


def shape(plan):
    return [(e.request_id, e.num_tokens) for e in plan.entries]


def run_to_end(s, limit=10_000):
    finished = []
    for _ in range(limit):
        if not s.has_unfinished():
            return finished
        finished += step(s)[1]
    raise AssertionError("scheduler did not finish")


def test_paper_worked_example_4_decodes_30_left_then_80_and_150():
    s = make(token_budget=100, chunk_size=100, max_num_seqs=10)
    for i in range(4):
        s.add_request(f"d{i}", 10, 50)
    s.add_request("p", 90, 50)
    plan, _ = step(s)
    assert shape(plan) == [("d0", 10), ("d1", 10), ("d2", 10), ("d3", 10), ("p", 60)]
    s.add_request("a", 80, 5)
    s.add_request("b", 150, 5)
    plan, _ = step(s)
    assert shape(plan) == [("d0", 1), ("d1", 1), ("d2", 1), ("d3", 1), ("p", 30), ("a", 66)]
    assert (plan.num_decode_tokens, plan.num_prefill_tokens, plan.num_tokens) == (4, 96, 100)
    p_entry = plan.entries[4]
    assert p_entry.is_prefill and p_entry.emits_token and p_entry.start_pos == 60
    assert not plan.entries[5].emits_token


def ten_decodes_then(prompt, **kw):
    """A scheduler with 10 running decodes and a `prompt`-token request just added."""
    s = make(token_budget=512, **kw)
    for i in range(10):
        s.add_request(i, 8, 100)
    step(s)
    s.add_request("long", prompt, 4)
    return s


def test_tile_alignment_chunk_is_tile_minus_decodes():
    plan, _ = step(ten_decodes_then(5000, chunk_size=256, tile_size=128))
    assert plan.num_decode_tokens == 10
    assert shape(plan)[-1] == ("long", 246)  # 256 - 10 decodes: total lands on 2 tiles
    assert plan.num_tokens == 256 and plan.tile_padding == 0
    plan, _ = step(ten_decodes_then(5000, chunk_size=256))
    assert shape(plan)[-1] == ("long", 256)


def test_tile_alignment_budget_cut_and_padding_of_last_piece():
    s = ten_decodes_then(552, tile_size=128)
    plan, _ = step(s)
    assert shape(plan)[-1] == ("long", 502) and plan.num_tokens == 512
    plan, _ = step(s)  # the prompt's last 50 tokens are never trimmed
    assert shape(plan)[-1] == ("long", 50)
    assert plan.num_tokens == 60 and plan.tile_padding == 128 - 60


def first_token_step(s, rid, limit):
    for k in range(1, limit + 1):
        plan, _ = step(s)
        if any(e.request_id == rid and e.emits_token for e in plan.entries):
            return k
    return None


def test_fairness_short_prompt_behind_32k_prompt():
    fair = make(max_partial_prefills=2, long_prefill_threshold=256)
    fair.add_request("huge", 32768, 4)
    starts = []
    for _ in range(3):
        plan, _ = step(fair)
        starts.append(plan.entries[0].start_pos)
    fair.add_request("short", 600, 4)
    progress = []
    for k in range(1, 4):
        plan, _ = step(fair)
        got = dict(shape(plan))
        progress.append(got.get("huge", 0))
        if any(e.request_id == "short" and e.emits_token for e in plan.entries):
            break
    assert k <= 3, "short prompt waited more than a few steps"
    assert all(n > 0 for n in progress), "the long prompt must advance every step"
    assert starts == [0, 256, 512]
    # Without the limits the same short prompt waits for the whole 32k prefill.
    unfair = make()
    unfair.add_request("huge", 32768, 4)
    step(unfair)
    unfair.add_request("short", 600, 4)
    assert first_token_step(unfair, "short", 20) is None


def test_max_partial_prefills_bounds_half_done_prompts():
    s = make(max_partial_prefills=2, long_prefill_threshold=256)
    for i in range(3):
        s.add_request(i, 32768, 2)
    plan, _ = step(s)
    assert shape(plan) == [(0, 256), (1, 256)]  # FCFS: the third waits for a slot


def test_preemption_by_recompute_keeps_generated_tokens():
    s = make(token_budget=64, chunk_size=64, max_num_seqs=4, block_size=4, num_blocks=6)
    s.add_request("old", 8, 12)
    s.add_request("new", 8, 12)
    preempted_at = None
    for k in range(30):
        plan, _ = step(s)
        if plan.preempted:
            preempted_at = k
            assert plan.preempted == ["new"]  # the most recently arrived goes
            assert all(e.request_id != "new" for e in plan.entries)
            break
    assert preempted_at is not None
    info = s.request_info("new")
    assert info.status is RequestStatus.WAITING and info.num_blocks == 0
    assert info.num_preemptions == 1 and info.num_generated >= 1
    hits = []
    while not (hits and hits[-1].emits_token):
        plan = s.schedule()
        if "new" in plan.preempted:  # the tiny cache may evict it again mid-prefill
            hits = []
        hits += [e for e in plan.entries if e.request_id == "new"]
        generated = s.request_info("new").num_generated
        s.update(plan)
    # Re-prefill prompt + generated tokens; the last chunk samples the next token.
    assert hits[0].start_pos == 0 and all(e.is_prefill for e in hits)
    assert sum(e.num_tokens for e in hits) == 8 + generated
    run_to_end(s)
    assert s.request_info("new").num_generated == 12
    assert s.num_free_blocks == 6


def test_prefills_stuck_on_each_others_blocks_preempt_the_newest():
    # Two half-done prompts fill the cache between them; neither can grow.
    s = make(token_budget=64, chunk_size=32, max_num_seqs=4, max_partial_prefills=2,
             block_size=4, num_blocks=16)
    s.add_request("a", 60, 2)
    s.add_request("b", 60, 2)
    assert shape(step(s)[0]) == [("a", 32), ("b", 32)]
    plan, _ = step(s)
    assert plan.preempted == ["b"] and shape(plan) == [("a", 28)]
    assert run_to_end(s) == ["a", "b"] and s.num_free_blocks == 16


def test_request_that_can_never_fit_is_rejected():
    s = make(block_size=16, num_blocks=10)  # 160 tokens of KV
    s.add_request("ok", 100, 61)  # 160 KV tokens: the last token is never stored
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request("big", 100, 62)
    assert s.num_waiting == 1
    v = make(policy="vllm", token_budget=256)
    with pytest.raises(ValueError, match="token_budget"):
        v.add_request("long", 300, 4)


@pytest.mark.parametrize("policy", available_policies())
def test_abort_in_every_state(policy):
    chunk = {"chunk_size": 64} if get_policy(policy).chunked else {}
    s = make(policy=policy, token_budget=256, max_num_seqs=2, **chunk)
    s.add_request("decoding", 10, 20)
    s.add_request("prefilling", 200, 20)
    s.add_request("waiting", 10, 20)
    for _ in range(2):
        step(s)
    assert s.abort("waiting") and s.request_info("waiting").status is RequestStatus.ABORTED
    assert s.abort("prefilling") and s.abort("decoding")
    assert s.num_free_blocks == 4096 and not s.has_unfinished()
    s.add_request("inflight", 10, 20)
    plan = s.schedule()
    assert shape(plan) == [("inflight", 10)]
    assert s.abort("inflight")
    assert s.num_free_blocks == 4095  # still written by the plan in flight
    assert s.update(plan) == [] and s.num_free_blocks == 4096
    assert not s.abort("inflight") and not s.abort("never-added")


def test_pipelined_plans_never_share_a_request():
    s = make(token_budget=64, chunk_size=32, max_num_seqs=8, max_partial_prefills=4)
    for i in range(4):
        s.add_request(i, 40, 3)
    p1 = s.schedule()
    p2 = s.schedule()
    ids1 = {e.request_id for e in p1.entries}
    ids2 = {e.request_id for e in p2.entries}
    assert ids1 == {0, 1} and ids2 == {2, 3} and s.num_plans_in_flight == 2
    p3 = s.schedule()
    assert p3.is_empty  # everything is in flight
    s.update(p2)  # out of order is fine
    s.update(p3)
    with pytest.raises(ValueError, match="not in flight"):
        s.update(p2)
    assert [e.start_pos for e in s.schedule().entries] == [32, 32]
    assert s.update(p1) == []


def test_stopped_finishes_now_and_is_validated():
    s = make()
    s.add_request("a", 10, 100)
    s.add_request("b", 10, 100)
    plan = s.schedule()
    with pytest.raises(ValueError, match="stopped"):
        s.update(plan, stopped=["zzz"])
    assert s.update(plan, stopped=["a"]) == ["a"]
    info = s.request_info("a")
    assert info.status is RequestStatus.FINISHED and info.num_generated == 1
    assert s.num_running == 1


def test_finishes_after_max_new_tokens_and_reports_ids():
    s = make()
    s.add_request("x", 5, 3)
    finished, emitted = [], 0
    while s.has_unfinished():
        plan, done = step(s)
        emitted += sum(e.emits_token for e in plan.entries)
        finished += done
    assert finished == ["x"] and emitted == 3
    info = s.request_info("x")
    assert info.first_scheduled_step == 1 and info.num_preemptions == 0
    s.release("x")
    with pytest.raises(KeyError):
        s.request_info("x")


def test_vllm_prefill_only_then_decode_only():
    s = make(policy="vllm", token_budget=100)
    s.add_request("a", 60, 5)
    plan, _ = step(s)
    s.add_request("b", 30, 5)
    s.add_request("c", 80, 5)
    plan, _ = step(s)
    assert shape(plan) == [("b", 30)]  # prefill-only: the decode of "a" stalls
    plan, _ = step(s)
    assert shape(plan) == [("c", 80)]
    plan, _ = step(s)
    assert shape(plan) == [("a", 1), ("b", 1), ("c", 1)]


def test_orca_hybrid_with_whole_prompts():
    s = make(policy="orca", token_budget=100, max_num_seqs=10)
    s.add_request("a", 60, 5)
    step(s)
    s.add_request("b", 30, 5)
    s.add_request("c", 80, 5)
    plan, _ = step(s)
    assert shape(plan) == [("a", 1), ("b", 30)]  # "c" would need chunking: not orca


def test_request_level_waits_for_the_whole_batch():
    s = make(policy="request_level", token_budget=200, max_num_seqs=2)
    s.add_request("a", 10, 2)
    s.add_request("b", 10, 5)
    s.add_request("c", 10, 2)
    plan, _ = step(s)
    assert shape(plan) == [("a", 10), ("b", 10)]
    seen_c = []
    while s.request_info("b").status is not RequestStatus.FINISHED:
        plan, _ = step(s)
        seen_c.append(any(e.request_id == "c" for e in plan.entries))
    assert not any(seen_c)
    assert shape(step(s)[0]) == [("c", 10)]


def test_decode_maximal_one_chunk_with_decodes():
    s = make(policy="decode_maximal", token_budget=512, chunk_size=64, max_num_seqs=4)
    for i in range(3):
        s.add_request(i, 10, 50)
    for _ in range(3):
        step(s)
    s.add_request("p", 200, 5)
    plan, _ = step(s)
    assert shape(plan) == [(0, 1), (1, 1), (2, 1), ("p", 64)]


def test_suggest_chunk_size_follows_pd_ratio_and_tiles():
    assert suggest_chunk_size(10, 9, None) == 80  # P:D = C/(B-1)
    assert suggest_chunk_size(10, 9, 128) == 120  # 120 + 8 decodes = one tile
    c = suggest_chunk_size(3.7, 33, 128)
    assert (c + 32) % 128 == 0 and c > 0
    with pytest.raises(ValueError, match="batch_size"):
        suggest_chunk_size(10, 1)
    with pytest.raises(ValueError, match="pd_ratio"):
        suggest_chunk_size(0, 8)


@pytest.mark.parametrize("kw, field", [
    (dict(policy="fifo"), "policy"),
    (dict(token_budget=0), "token_budget"),
    (dict(chunk_size=1024), "chunk_size"),
    (dict(max_num_seqs=600), "max_num_seqs"),
    (dict(block_size=-1), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(tile_size=0), "tile_size"),
    (dict(max_partial_prefills=0), "max_partial_prefills"),
    (dict(long_prefill_threshold=0), "long_prefill_threshold"),
    (dict(watermark=1.5), "watermark"),
    (dict(token_budget=True), "token_budget"),
])
def test_config_rejects_impossible_settings(kw, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kw)


def test_config_defaults_and_unchunked_policies_allow_large_batches():
    assert SchedulerConfig(token_budget=256).chunk_size == 256
    assert SchedulerConfig(policy="vllm", token_budget=64, max_num_seqs=256).max_num_seqs == 256


@pytest.mark.parametrize("args, field", [
    (("a", 0, 4), "num_prompt_tokens"),
    (("a", 4, -1), "max_new_tokens"),
    (("a", 4.0, 4), "num_prompt_tokens"),
])
def test_add_request_validates_arguments(args, field):
    s = make()
    with pytest.raises(ValueError, match=field):
        s.add_request(*args)


def test_add_request_rejects_duplicate_live_id_but_allows_reuse_after_finish():
    s = make()
    s.add_request(7, 4, 1)
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(7, 4, 1)
    assert run_to_end(s) == [7]
    s.add_request(7, 4, 1)
    assert s.request_info(7).status is RequestStatus.WAITING


def test_update_rejects_foreign_plan():
    s = make()
    with pytest.raises(ValueError, match="not in flight"):
        s.update(BatchPlan(step=99))


@pytest.mark.parametrize("token, shown", [(True, "True"), (-1, "-1"), (1 << 63, str(1 << 63)), (2.0, "2.0"),
                                          ("7", "'7'"), ([3, 1.5], "1.5")])
def test_update_names_a_token_that_is_no_token_id_and_changes_nothing(token, shown):
    s = make(enable_prefix_caching=True)
    s.add_request("a", 4, 8)
    s.add_request("b", 4, 8)
    plan = s.schedule()
    with pytest.raises(ValueError, match=rf"token_ids must map to ints in \[0, 2\*\*63\), got {shown}"):
        s.update(plan, token_ids={"a": 5, "b": token})
    assert s.update(plan, token_ids={"a": 5, "b": 6}) == []  # still in flight: a good update completes it
    assert s.request_info("b").num_generated == 1

"""Multi-turn prefix caching: full blocks of generated tokens are keyed as they fill and
cached once their KV is computed, so a conversation's next turn, which re-sends the
previous answer, skips it; outputs stay bit-identical with the cache on and off."""
import random

import pytest

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.scheduler import SchedulerConfig, create_scheduler
from sarathi_rt.scheduler.prefix_cache import block_hashes

BS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, logprobs=0)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def _chat(on: bool, turns: int, **kw) -> tuple[LLM, list[list]]:
    """Two conversations side by side (a mixed batch each turn): every turn re-sends the
    conversation so far, the previous answer included, plus a new user message."""
    llm = LLM("tiny", enable_prefix_caching=on, **{**dict(block_size=BS, token_budget=32, chunk_size=16,
                                                          max_num_seqs=8), **kw})
    rng = random.Random(7)
    contexts = [_ids(rng, 30), _ids(rng, 45)]
    outputs = []
    for turn in range(turns):
        if turn:
            contexts = [c + _ids(rng, 7) for c in contexts]
        outs = llm.generate(contexts, PARAMS, use_tqdm=False)
        outputs.append(outs)
        contexts = [c + o.token_ids for c, o in zip(contexts, outs)]
    return llm, outputs


def test_next_turn_hits_the_previous_answer_and_outputs_are_bit_identical() -> None:
    _, off = _chat(False, 4)
    llm, on = _chat(True, 4)
    for x, y in zip(off, on):
        for a, b in zip(x, y):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    for prev, cur in zip(on, on[1:]):
        for p, c in zip(prev, cur):
            # Every full block of the previous prompt + answer but the one holding the
            # last answer token, whose KV was never computed (it was not fed back).
            computed = p.metrics.num_prompt_tokens + len(p.token_ids) - 1
            assert c.num_cached_tokens == computed // BS * BS
            assert c.num_cached_tokens > p.metrics.num_prompt_tokens  # the answer, not just the prompt
    assert all(o.num_cached_tokens == 0 for turn in off for o in turn)
    assert llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks


def test_preemption_and_eviction_keep_outputs_identical() -> None:
    # 12 blocks of 8 for two conversations of 6 + 8 blocks after the first turn: decodes
    # preempt each other (a recompute then finds its own generated blocks), and the
    # second turn evicts.
    _, off = _chat(False, 2, num_kv_blocks=12)
    llm, on = _chat(True, 2, num_kv_blocks=12)
    assert [[(o.token_ids, o.logprobs) for o in t] for t in off] == [[(o.token_ids, o.logprobs) for o in t] for t in on]
    assert sum(o.metrics.num_preemptions for t in on for o in t) > 0
    stats = llm.engine.prefix_cache_stats()
    assert stats.evictions > 0
    assert stats.hits > sum(o.num_cached_tokens for t in on for o in t)  # the recomputes hit too


def test_scheduler_keys_generated_blocks_only_with_their_tokens() -> None:
    config = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=4, block_size=4, num_blocks=32,
                             enable_prefix_caching=True)
    sched = create_scheduler(config)
    prompt, answer = list(range(10, 16)), [40, 41, 42, 43, 44, 45, 46]
    sched.add_request("a", len(prompt), len(answer), prompt_token_ids=prompt)
    sched.add_request("blind", len(prompt), len(answer), prompt_token_ids=[t + 100 for t in prompt])
    step = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        emitted = {e.request_id for e in plan.entries if e.emits_token}
        with pytest.raises(ValueError, match="token_ids names"):
            sched.update(plan, token_ids={"nobody": 1})
        with pytest.raises(ValueError, match="token_ids must map"):
            sched.update(plan, token_ids={r: -1 for r in emitted})
        sched.update(plan, token_ids={"a": answer[step]} if "a" in emitted else {})
        step += "a" in emitted
    # 6 prompt + 6 fed-back answer tokens have KV: blocks 0-2 (the last answer token has none).
    follow = prompt + answer + [7]
    sched.add_request("b", len(follow), 1, prompt_token_ids=follow)
    sched.add_request("c", len(follow), 1, prompt_token_ids=[t + 100 for t in prompt] + answer + [7])
    plan = sched.schedule()
    starts = {e.request_id: e.start_pos for e in plan.entries}
    assert starts == {"b": 12, "c": 4}  # "blind" gave no tokens: only its prompt's full block
    assert len(block_hashes(follow, 4)) == 3


# A prompt of 29 leaves a partial block, which each sample copies; of 31, the samples'
# first tokens fill it.
@pytest.mark.parametrize("k, prompt_len", [(1, 29), (2, 31)])
def test_next_turn_hits_a_forked_samples_answer(k: int, prompt_len: int) -> None:
    """Samples 1..n-1 are forked onto the prompt's blocks; their own answers are keyed too."""
    rng = random.Random(5)
    prompt, question = _ids(rng, prompt_len), _ids(rng, 7)
    n3 = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=13, ignore_eos=True)
    results = {}
    for on in (False, True):
        llm = LLM("tiny", enable_prefix_caching=on, block_size=BS, token_budget=32, chunk_size=16, max_num_seqs=8)
        answer = llm.generate([prompt], n3, use_tqdm=False)[0].outputs[k]
        follow = prompt + list(answer.token_ids) + question
        results[on] = answer, llm.generate([follow], PARAMS, use_tqdm=False)[0]
        assert llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks
    (answer, off), (same, on) = results[False], results[True]
    assert answer.index == k and answer.token_ids == same.token_ids
    assert on.token_ids == off.token_ids and on.logprobs == off.logprobs
    # Every full block of prompt + sample k's answer but the last answer token's (never fed back).
    assert on.num_cached_tokens == (len(prompt) + len(answer.token_ids) - 1) // BS * BS > len(prompt)
    assert off.num_cached_tokens == 0

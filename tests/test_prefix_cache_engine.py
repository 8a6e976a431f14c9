"""Prefix caching in the engine: greedy tokens and their logprobs are bit-identical with
the cache on and off, whatever was cached before and however the prompts were chunked."""
import random

import pytest

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.measure.metrics import summarize
from sarathi_rt.scheduler import get_policy

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
SHARED = [random.Random(0).randrange(3, 512) for _ in range(100)]
OTHER = [random.Random(1).randrange(3, 512) for _ in range(100)]
KW = dict(block_size=8, token_budget=32, chunk_size=16, max_num_seqs=8)


def _prompts(seed: int, shares: list[int], suffix: int = 20, text: list[int] = SHARED) -> list[list[int]]:
    """Prompts made of the first `share` tokens of a shared text and 1..suffix others."""
    rng = random.Random(seed)
    return [text[:n] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, suffix + 1))] for n in shares]


def _run(on: bool, batches: list[list[list[int]]], **kw) -> tuple[LLM, list]:
    llm = LLM("tiny", enable_prefix_caching=on, **{**KW, **kw})
    return llm, [llm.generate(b, PARAMS) for b in batches]


@pytest.mark.slow
def test_outputs_are_bit_identical_with_the_cache_on_and_off() -> None:
    warm = _prompts(0, [100, 16, 40])
    # three prompts sharing 100 tokens, admitted in the first step, read the same blocks;
    # then shares of 0, 1, 7, 16 tokens; 40 puts the first computed token mid-chunk
    # (without the cache, chunks of 16 start at 0, 16, 32, 48)
    main = _prompts(1, [100] * 3, suffix=3) + _prompts(1, [0, 1, 7, 16, 40])
    llm_off, off = _run(False, [warm, main])
    llm_on, on = _run(True, [warm, main])
    for a, b in zip(off[0] + off[1], on[0] + on[1]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    cached = [o.num_cached_tokens for o in on[1]]
    assert cached == [96, 96, 96, 0, 0, 0, 16, 40]
    assert all(o.num_cached_tokens == 0 for o in off[1])
    assert len({o.metrics.first_scheduled_time for o in on[1][:3]}) == 1
    stats = llm_on.engine.prefix_cache_stats()
    assert stats.hits == sum(o.num_cached_tokens for o in on[0] + on[1]) > sum(cached)
    assert stats.queries == sum(map(len, warm + main))
    requests = [o.metrics for o in on[1]]
    assert summarize(requests, []).prefix_cache_hit_rate == pytest.approx(sum(cached) / sum(map(len, main)))
    assert llm_off.engine.prefix_cache_stats().queries == 0


@pytest.mark.slow
def test_eviction_keeps_outputs_identical() -> None:
    batches = [_prompts(1, [100, 60, 100, 40]), _prompts(2, [100, 70, 100, 7], text=OTHER),
               _prompts(3, [100, 60, 100, 40])]
    kw = dict(num_kv_blocks=32)  # 256 tokens: the second text evicts the first
    llm_off, off = _run(False, batches, **kw)
    llm_on, on = _run(True, batches, **kw)
    for x, y in zip(off, on):
        for a, b in zip(x, y):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    stats = llm_on.engine.prefix_cache_stats()
    assert stats.evictions > 0 and stats.hits > 0
    assert llm_on.engine.scheduler.num_free_blocks == 32


@pytest.mark.parametrize("policy", ["decode_maximal", "vllm"])
def test_other_policies_hit_and_match(policy: str) -> None:
    batches = [_prompts(3, [30, 30]), _prompts(4, [30, 20, 1])]
    kw = dict(policy=policy, token_budget=64, chunk_size=16 if get_policy(policy).chunked else None)
    _, off = _run(False, batches, **kw)
    _, on = _run(True, batches, **kw)
    assert [o.token_ids for b in off for o in b] == [o.token_ids for b in on for o in b]
    assert [o.num_cached_tokens for o in on[1]] == [24, 16, 0]


def test_flag_is_checked() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        LLM("tiny", enable_prefix_caching="yes")

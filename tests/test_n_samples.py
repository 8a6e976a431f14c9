"""SamplingParams(n > 1): the prompt is prefilled once and its KV blocks shared by
refcount; sample i equals a single request seeded sample_seed(seed, i), whatever the
memory pressure (forked, deferred and recomputed, or preempted); abort frees every block."""
from __future__ import annotations

import asyncio
import random

import pytest

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import AsyncLLMEngine, RequestOutput
from sarathi_rt.engine.sequence import SampleKey
from sarathi_rt.sampling import MAX_N, sample_seed
from sarathi_rt.scheduler import SchedulerConfig, create_scheduler

BLOCK = 8
PROMPTS = [list(range(3, 22)), list(range(40, 56))]  # a partly filled last block (19), and exactly two (16)


def _llm(**options: object) -> LLM:
    return LLM("tiny", **{"num_kv_blocks": 64, "block_size": BLOCK, "enable_prefix_caching": False, **options})


def _params(n: int, seed: int = 5, **kw: object) -> SamplingParams:
    return SamplingParams(**{"n": n, "max_tokens": 7, "temperature": 1.0, "top_k": 50, "seed": seed,
                             "ignore_eos": True, **kw})


def _single(llm: LLM, prompt: list[int], seed: int, **kw: object) -> list[int]:
    return list(llm.generate([prompt], _params(1, seed, **kw), use_tqdm=False)[0].token_ids)


def _logprobs(out: RequestOutput) -> list[float]:
    assert out.logprobs is not None
    return [x.logprob for x in out.logprobs]


def _all_free(llm: LLM) -> bool:
    return llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks


@pytest.mark.parametrize("options, recomputed", [
    ({}, False), ({"chunk_size": 5, "token_budget": 16}, False), ({"enable_prefix_caching": True}, False),
    ({"max_num_seqs": 2}, True),  # two samples run; the others wait and re-prefill prompt + first token
    ({"max_num_seqs": 2, "enable_prefix_caching": True}, True),  # ... from the prompt's cached blocks
    ({"num_kv_blocks": 7}, True)],  # too few blocks for all: preemptions
    ids=["whole", "chunked", "prefix_cache", "few_seqs", "few_seqs_cached", "few_blocks"])
def test_sample_i_equals_a_single_request_with_the_derived_seed(options: dict, recomputed: bool) -> None:
    llm = _llm(**options)
    outs = llm.generate(PROMPTS, _params(4, logprobs=1), use_tqdm=False)
    prefilled = sum(m.num_prefill_tokens for m in llm.engine.step_metrics)
    assert (prefilled > sum(map(len, PROMPTS))) == recomputed
    if recomputed and options.get("enable_prefix_caching"):  # re-prefills start after the cached prompt blocks
        uncached = _llm(**{**options, "enable_prefix_caching": False})
        uncached.generate(PROMPTS, _params(4), use_tqdm=False)
        assert prefilled < sum(m.num_prefill_tokens for m in uncached.engine.step_metrics)
    ref = _llm()
    for prompt, out in zip(PROMPTS, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.outputs[0] is out
        singles = [ref.generate([prompt], _params(1, sample_seed(5, i), logprobs=1), use_tqdm=False)[0]
                   for i in range(4)]
        got = [list(c.token_ids) for c in out.outputs]
        assert got == [list(s.token_ids) for s in singles]
        assert len({tuple(g) for g in got}) == 4  # distinct streams
        # The raw logits' log probabilities read every KV entry: a wrong shared or copied block shows.
        for c, s in zip(out.outputs, singles):
            assert _logprobs(c) == pytest.approx(_logprobs(s), abs=1e-5)
        assert all(c.finish_reason == "length" and c.request_id == out.request_id for c in out.outputs)
    assert _all_free(llm) and not llm.engine.has_unfinished()


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "request_level", "decode_maximal"])
def test_every_policy_forks_the_same_samples(policy: str) -> None:
    ref = _llm()
    for options in ({}, {"num_kv_blocks": 8}):
        llm = _llm(policy=policy, token_budget=64, **options)
        outs = llm.generate(PROMPTS, _params(3, logprobs=1), use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            for i, c in enumerate(out.outputs):
                single = ref.generate([prompt], _params(1, sample_seed(5, i), logprobs=1), use_tqdm=False)[0]
                assert list(c.token_ids) == list(single.token_ids)
                assert _logprobs(c) == pytest.approx(_logprobs(single), abs=1e-5)
        assert _all_free(llm)


def test_sample_0_keeps_the_seed_and_the_derivation_is_spread() -> None:
    assert sample_seed(123, 0) == 123
    seeds = {sample_seed(s, i) for s in range(50) for i in range(1, MAX_N)}
    assert len(seeds) == 50 * (MAX_N - 1) and all(0 <= x < 2**64 for x in seeds)


def test_the_prompt_is_prefilled_once_and_its_blocks_shared() -> None:
    prompt = PROMPTS[0]  # 19 tokens: two full blocks and a partial third
    llm = _llm()
    engine, scheduler = llm.engine, llm.engine.scheduler
    engine.add_request("r", prompt, _params(4, max_tokens=20))
    first = engine.step()  # the whole prompt, and every sample's first token
    assert sorted(o.index for o in first) == [0, 1, 2, 3] and all(len(o.token_ids) == 1 for o in first)
    tables = [scheduler.block_table(k) for k in ["r", *(SampleKey("r", i) for i in range(1, 4))]]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert all(scheduler._blocks.refcount(b) == 4 for b in shared)
    assert len({t[2] for t in tables}) == 4  # the partial block: one copy per sample
    assert scheduler.num_free_blocks == 64 - 2 - 4
    engine.step()
    assert engine.steps_since(0)[-1].num_decode_tokens == 4
    while engine.has_unfinished():
        engine.step()
    forked = sum(m.num_prefill_tokens for m in engine.step_metrics)
    assert forked == len(prompt)
    # n separate requests prefill n times (and hold n copies of the prompt's blocks).
    separate = _llm()
    before = separate.engine.num_steps
    separate.generate([prompt] * 4, _params(1, max_tokens=20), use_tqdm=False)
    assert sum(m.num_prefill_tokens for m in separate.engine.steps_since(before)) == 4 * len(prompt)
    assert _all_free(llm)


def test_greedy_samples_are_identical_and_n_is_per_prompt() -> None:
    greedy = [SamplingParams(n=n, max_tokens=6, temperature=0.0, ignore_eos=True) for n in (1, 3)]
    single, out = _llm().generate(PROMPTS[::-1], greedy, use_tqdm=False)
    assert single.samples == () and single.outputs == (single,)  # n=1: as before
    assert len(out.outputs) == 3
    assert all(list(c.token_ids) == list(out.token_ids) for c in out.outputs)


@pytest.mark.parametrize("steps", [0, 1, 3])  # queued, in its prefill, after the fork
def test_abort_stops_every_sample_and_frees_every_block(steps: int) -> None:
    llm = _llm(chunk_size=8, token_budget=8)
    engine = llm.engine
    engine.add_request("r", PROMPTS[0], _params(5, max_tokens=30))
    engine.add_request("other", PROMPTS[1], _params(1, max_tokens=30))
    for _ in range(steps):
        engine.step()
    engine.abort("r")
    assert not engine.has_request("r") and engine.has_request("other")
    aborted = [o for o in engine.step() if o.request_id == "r"]
    assert sorted(o.index for o in aborted) == [0, 1, 2, 3, 4]
    assert all(o.finished and o.finish_reason == "abort" for o in aborted)
    with pytest.raises(ValueError, match="request_id"):
        engine.abort("r")
    while engine.has_unfinished():
        engine.step()
    assert _all_free(llm)
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0


def test_samples_finishing_with_their_first_token_free_everything() -> None:
    llm = _llm()
    out = llm.generate([PROMPTS[0]], _params(6, max_tokens=1), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [1] * 6
    assert _all_free(llm) and not llm.engine.has_unfinished()


def test_prompt_logprobs_and_logprobs_per_sample() -> None:
    llm = _llm(chunk_size=5, token_budget=16)
    out = llm.generate([PROMPTS[0]], _params(3, logprobs=2, prompt_logprobs=1), use_tqdm=False)[0]
    ref = _llm().generate([PROMPTS[0]], _params(1, seed=sample_seed(5, 2), logprobs=2), use_tqdm=False)[0]
    assert [c.prompt_logprobs for c in out.outputs[1:]] == [out.prompt_logprobs] * 2
    assert len(out.prompt_logprobs) == len(PROMPTS[0])
    sample = out.outputs[2]
    assert list(sample.token_ids) == list(ref.token_ids)
    assert [x.logprob for x in sample.logprobs] == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)


def test_stream_and_async_engine_tell_samples_apart() -> None:
    llm = _llm()
    whole = llm.generate([PROMPTS[0]], _params(3), use_tqdm=False)[0]
    want = {c.index: list(c.token_ids) for c in whole.outputs}
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for out in llm.stream([PROMPTS[0]], _params(3)):
        streamed[out.index] += out.new_token_ids
    assert streamed == want

    async def run() -> dict[int, list[int]]:
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        async for out in AsyncLLMEngine(llm.engine).generate(PROMPTS[0], _params(3)):
            got[out.index] += out.new_token_ids
        return got

    assert asyncio.run(run()) == want
    assert _all_free(llm)


def test_leaving_an_async_stream_early_aborts_every_sample() -> None:
    llm = _llm()

    async def run() -> None:
        aengine = AsyncLLMEngine(llm.engine)
        seen = 0
        async for _ in aengine.generate(PROMPTS[0], _params(4, max_tokens=50), request_id="r"):
            seen += 1
            if seen == 6:
                break
        while llm.engine.has_unfinished():
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert _all_free(llm) and not llm.engine.has_request("r")


@pytest.mark.parametrize("n, error", [(MAX_N + 1, ValueError), (0, ValueError), (2.0, TypeError),
                                      (True, TypeError)])
def test_bad_n_is_refused_naming_n(n: object, error: type) -> None:
    with pytest.raises(error, match="^n must"):
        SamplingParams(n=n)  # type: ignore[arg-type]
    assert SamplingParams(n=MAX_N).n == MAX_N


def test_scheduler_forks_without_torch_and_checks_sample_ids() -> None:
    """The scheduler alone: the update that completes the prompt creates the samples,
    sharing its full blocks and copying the partial one in the next plan."""
    scheduler = create_scheduler(SchedulerConfig(token_budget=32, num_blocks=16, block_size=4, max_num_seqs=8))
    with pytest.raises(ValueError, match="sample_ids"):
        scheduler.add_request("a", 10, 4, sample_ids=["b", "b"])
    with pytest.raises(ValueError, match="sample_ids"):
        scheduler.add_request("a", 10, 4, sample_ids=["a"])
    scheduler.add_request("a", 10, 4, sample_ids=["b", "c"])
    plan = scheduler.schedule(0.0)
    assert plan.num_prefill_tokens == 10 and not plan.block_copies
    scheduler.update(plan, stopped=["c"], token_ids={"a": 1, "b": 2, "c": 3})  # c stops at its first token
    assert scheduler.request_info("c").status.value == "finished"
    plan = scheduler.schedule(0.0)
    assert [e.request_id for e in plan.entries] == ["a", "b"] and plan.num_decode_tokens == 2
    a, b = scheduler.block_table("a"), scheduler.block_table("b")
    assert a[:2] == b[:2] and plan.block_copies == [(a[2], b[2])]
    scheduler.update(plan)
    assert scheduler.schedule(0.0).block_copies == []


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "request_level", "decode_maximal"])
def test_forks_keep_every_refcount_exact_under_random_load(policy: str) -> None:
    """Random prompts (a small vocabulary, so prefix-cache hits), n, stops, aborts and a
    small cache: after every step each block's refcount is the number of live requests
    holding it, and at the end every block is free."""
    rng = random.Random(policy)
    for trial in range(12):
        config = SchedulerConfig(policy=policy, token_budget=64, num_blocks=rng.randint(8, 30), block_size=4,
                                 max_num_seqs=rng.randint(2, 8), enable_prefix_caching=trial % 2 == 0)
        scheduler = create_scheduler(config)
        forks: dict[str, list[str]] = {}
        groups: dict[str, list[str]] = {}
        for step in range(150):
            if step < 100 and rng.random() < 0.3:
                rid = f"r{step}"
                prompt = [rng.randrange(3) for _ in range(rng.randint(1, 18))]
                samples = [f"{rid}.{i}" for i in range(1, rng.randint(1, 4))]
                scheduler.add_request(rid, len(prompt), rng.randint(1, 6), prompt_token_ids=prompt,
                                      sample_ids=samples)
                forks[rid], groups[rid] = samples, [rid, *samples]
            plan = scheduler.schedule(0.0)
            sampled = [e.request_id for e in plan.entries if e.emits_token]
            sampled += [s for rid in sampled for s in forks.pop(rid, [])]
            scheduler.update(plan, [r for r in sampled if rng.random() < 0.1], {r: rng.randrange(3) for r in sampled})
            if rng.random() < 0.05 and groups:
                for rid in groups.pop(rng.choice(sorted(groups))):
                    scheduler.abort(rid)
            held: dict[int, int] = {}
            for req in scheduler._live.values():
                for block in req.blocks:
                    held[block] = held.get(block, 0) + 1
            assert all(scheduler._blocks.refcount(b) == held.get(b, 0) for b in range(config.num_blocks))
        while scheduler.has_unfinished():
            plan = scheduler.schedule(0.0)
            sampled = [e.request_id for e in plan.entries if e.emits_token]
            sampled += [s for rid in sampled for s in forks.pop(rid, [])]
            scheduler.update(plan, (), {r: 0 for r in sampled})
        assert scheduler.num_free_blocks == config.num_blocks

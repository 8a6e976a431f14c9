"""LLMEngine and LLM: outputs, metrics, bad input (raised for that request only), aborts,
stop conditions, batch invariance of seeded sampling, KV cache sizing (NVTX ranges: test_nvtx.py)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import sarathi_rt.engine.memory
import sarathi_rt.engine.model_runner
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import LLMEngine
from sarathi_rt.engine.memory import auto_num_blocks
from sarathi_rt.ops.kv_cache import KVCacheShape

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [[5, 6, 7], list(range(10, 40)), [9], list(range(100, 117)), list(range(200, 260, 3))]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_kv_blocks=64, block_size=8, token_budget=32, chunk_size=16, max_num_seqs=8)


def _drain(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def _assert_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.scheduler.num_free_blocks == engine.scheduler_config.num_blocks
    assert not engine.scheduler.has_unfinished()


def test_generate_outputs_and_metrics(llm: LLM) -> None:
    before = llm.engine.num_steps
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    for o in outs:
        assert o.finished and o.finish_reason == "length" and len(o.token_ids) == 6
        m = o.metrics
        assert m.num_prompt_tokens == len(o.prompt_token_ids) and len(m.token_times) == 6
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time == m.token_times[0]
        assert m.token_times == sorted(m.token_times) and m.finish_time == m.token_times[-1]
        assert m.ttft > 0 and len(m.tbts) == 5
    steps = llm.engine.steps_since(before)
    # every prompt token and every generated token but the last goes through the model once
    assert sum(s.num_tokens for s in steps) == sum(map(len, PROMPTS)) + 5 * len(PROMPTS)
    assert all(s.num_tokens <= 32 and s.duration > 0 and s.batch_size >= 1 for s in steps)
    assert all(s.num_tokens == s.num_prefill_tokens + s.num_decode_tokens for s in steps)
    _assert_clean(llm.engine)
    # the same prompts again give the same tokens (the cache holds nothing stale)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == [o.token_ids for o in outs]


def test_step_observer_sees_every_step_and_its_time(llm: LLM) -> None:
    seen = []
    engine, before = llm.engine, llm.engine.num_steps
    engine.step_observer = lambda plan, seconds: seen.append((plan, seconds))
    try:
        llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    finally:
        engine.step_observer = None
    steps = engine.steps_since(before)
    assert len(seen) == len(steps) > 0
    for (plan, seconds), s in zip(seen, steps):
        assert (plan.num_tokens, plan.num_prefill_tokens, seconds) == (s.num_tokens, s.num_prefill_tokens, s.duration)


@pytest.mark.parametrize("prompt, params, error, match", [
    ([], GREEDY, ValueError, "empty"),
    ([1] * 1024, GREEDY, ValueError, "max_model_len"),
    ([1, 512], GREEDY, ValueError, "vocabulary"),
    ([1, -1], GREEDY, ValueError, "vocabulary"),
    ([1, 2.0], GREEDY, TypeError, "token ids must be an int, got float"),
    ([1, 2], SamplingParams(stop_token_ids=[512]), ValueError, "stop_token_ids holds 512, outside the vocabulary"),
    ("hello", GREEDY, TypeError, "prompt"),
    (7, GREEDY, TypeError, "prompt"),
    ([1, 2], {"max_tokens": 3}, TypeError, "params"),
    ([1] * 600, SamplingParams(max_tokens=400), ValueError, "KV blocks"),
])
def test_bad_request_raises_and_the_rest_still_run(llm: LLM, prompt, params, error, match) -> None:
    engine = llm.engine
    engine.add_request("good", [3, 4, 5], GREEDY)
    with pytest.raises(error, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_request("bad")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [1], GREEDY)
    with pytest.raises(TypeError, match="hashable"):
        engine.add_request(["unhashable"], [1], GREEDY)
    with pytest.raises(ValueError, match="not running"):
        engine.abort("never-added")
    done = _drain(engine)
    assert list(done) == ["good"] and done["good"].token_ids == llm.generate([[3, 4, 5]], GREEDY)[0].token_ids
    _assert_clean(engine)


@pytest.mark.parametrize("arrival_time", ["abc", math.nan, math.inf, True])
def test_bad_arrival_time_registers_nothing(llm: LLM, arrival_time: object) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match="arrival_time must be a finite number"):
        engine.add_request("bad", [3, 4, 5], GREEDY, arrival_time=arrival_time)
    assert not engine.has_request("bad") and not engine.scheduler.has_unfinished()
    engine.add_request("bad", [3, 4, 5], GREEDY)  # the id is free, and the engine still steps
    done = _drain(engine)
    assert list(done) == ["bad"] and len(done["bad"].token_ids) == GREEDY.max_tokens
    _assert_clean(engine)


def test_integer_scalar_token_ids_are_accepted(llm: LLM) -> None:
    np = pytest.importorskip("numpy")
    as_numpy = llm.generate([np.array([3, 4, 5], dtype=np.int32)], GREEDY, use_tqdm=False)[0]
    as_scalars = llm.generate([[np.int64(3), np.int16(4), torch.tensor(5)]], GREEDY, use_tqdm=False)[0]
    assert as_numpy.token_ids == as_scalars.token_ids == llm.generate([[3, 4, 5]], GREEDY)[0].token_ids
    assert as_numpy.prompt_token_ids == [3, 4, 5] and all(type(t) is int for t in as_scalars.prompt_token_ids)


def test_outputs_are_snapshots_not_copies(llm: LLM) -> None:
    """Each step's output sees the tokens generated so far, and only those, without the
    engine copying the whole output every step."""
    snapshots = [out.token_ids for out in llm.stream([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=8))]
    assert [len(s) for s in snapshots] == list(range(1, 9))
    final = list(snapshots[-1])
    for s in snapshots:
        assert list(s) == final[:len(s)] and s == final[:len(s)] and s[-1] == final[len(s) - 1]
    with pytest.raises(IndexError):
        snapshots[0][1]
    assert [0] + snapshots[1] == [0, *final[:2]] and snapshots[1] + [0] == [*final[:2], 0]


def test_step_metrics_window_is_bounded(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import deque
    engine = llm.engine
    monkeypatch.setattr(engine, "step_metrics", deque(maxlen=4))
    before = engine.num_steps
    llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert engine.num_steps - before >= 10 and len(engine.step_metrics) == 4
    assert engine.steps_since(engine.num_steps - 3) == list(engine.step_metrics)[1:]
    with pytest.raises(ValueError, match="window"):
        engine.steps_since(before)


def test_abort_mid_run_frees_blocks_and_reports(llm: LLM) -> None:
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(i, p, SamplingParams(temperature=0.0, max_tokens=20))
    for _ in range(3):
        engine.step()
    engine.abort(1)
    engine.abort(3)
    assert not engine.has_request(1)
    outs = engine.step()
    aborted = [o for o in outs if o.finish_reason == "abort"]
    assert sorted(o.request_id for o in aborted) == [1, 3] and all(o.finished for o in aborted)
    done = _drain(engine)
    assert sorted(done) == [0, 2, 4] and all(len(o.token_ids) == 20 for o in done.values())
    with pytest.raises(ValueError, match="not running"):
        engine.abort(0)
    _assert_clean(engine)


def test_stop_token_ids_and_ignore_eos(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    free = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    # make `stop` the model's eos: generation ends there unless ignore_eos
    engine = llm.engine
    monkeypatch.setattr(engine, "model_config", dataclasses.replace(engine.model_config, eos_token_ids=(stop,)))
    eos = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert eos.token_ids == free.token_ids[:first + 1] and eos.finish_reason == "stop"
    ignored = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_max_model_len_bounds_prompt_and_generation() -> None:
    llm = LLM("tiny", num_kv_blocks=16, max_model_len=20)
    out = llm.generate([list(range(3, 18))], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 23))], GREEDY)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM("tiny", num_kv_blocks=16, max_model_len=5000)


@pytest.mark.slow
def test_seeded_sampling_is_batch_and_preemption_invariant() -> None:
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=2024, max_tokens=12)
    target = list(range(50, 75))
    alone = LLM("tiny", num_kv_blocks=64, block_size=8).generate([target], params)[0].token_ids
    busy = LLM("tiny", num_kv_blocks=12, block_size=8, token_budget=24, chunk_size=7, max_num_seqs=6)
    others = [SamplingParams(temperature=t, max_tokens=10, seed=s) for t, s in [(1.0, 1), (0.0, None), (1.5, 3)]]
    outs = busy.generate(PROMPTS + [target], [others[i % 3] for i in range(len(PROMPTS))] + [params])
    assert outs[-1].token_ids == alone
    # 12 blocks cannot hold them all; the engine's count (/metrics' num_preemptions) is every request's.
    assert busy.engine.num_preemptions == sum(o.metrics.num_preemptions for o in outs) > 0
    assert len(set(alone)) > 3
    # unseeded requests draw seeds from the engine seed: reproducible per LLM seed
    again = LLM("tiny", num_kv_blocks=64, seed=5).generate([target], SamplingParams(max_tokens=12))[0]
    assert again.token_ids == LLM("tiny", num_kv_blocks=64, seed=5).generate(
        [target], SamplingParams(max_tokens=12))[0].token_ids


def test_tile_aligned_steps_give_the_same_tokens(llm: LLM) -> None:
    tiled = LLM("tiny", num_kv_blocks=64, block_size=8, token_budget=32, chunk_size=16, max_num_seqs=8,
                tile_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    assert [o.token_ids for o in tiled.generate(PROMPTS, params)] == \
        [o.token_ids for o in llm.generate(PROMPTS, params)]
    steps = tiled.engine.step_metrics
    assert all((s.num_tokens + s.tile_padding) % 8 == 0 for s in steps)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)  # hybrid steps happened
    # CPU GEMMs have no tile staircase: "auto" leaves steps unaligned there
    assert LLM("tiny", num_kv_blocks=8, tile_size="auto").engine.scheduler_config.tile_size is None


def test_attention_plan_grows_with_the_step(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # One plan per step drives every layer's attention (the CPU kernel runs it too);
    # starting from a (1, 1) plan covers rebuilding it when a step outgrows it.
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    runner = llm.engine.executor.worker.runner
    monkeypatch.setattr(runner, "_plans", {})  # one per window; "tiny" has full attention only
    monkeypatch.setattr(runner, "_plan_size", (1, 1))
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    plan = runner._plans[0]
    assert list(runner._plans) == [0] and plan.max_tokens > 1 and plan.max_batch > 1


def test_kv_cache_sized_from_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("tiny", max_num_seqs=4, max_model_len=64, block_size=16)
    assert llm.engine.scheduler_config.num_blocks == 4 * 64 // 16  # capped at what 4 requests can use
    shape = KVCacheShape(2, 16, 2, 16)
    monkeypatch.setattr(sarathi_rt.engine.memory, "available_bytes", lambda device: 3 * shape.bytes_per_block)
    assert auto_num_blocks(shape, llm.engine.config.device, 100, 1024, fraction=0.5) == 1
    with pytest.raises(ValueError, match="num_kv_blocks"):
        auto_num_blocks(shape, llm.engine.config.device, 100, 1024, fraction=0.2)


def test_cpu_kv_cache_default_is_capped_not_half_of_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = KVCacheShape(30, 16, 3, 64)  # a 135M-parameter model's cache: 46 KiB per token
    monkeypatch.setattr(sarathi_rt.engine.memory, "available_bytes", lambda device: 64 << 30)
    cpu = torch.device("cpu")
    blocks = auto_num_blocks(shape, cpu, 128, 8192)
    assert blocks == sarathi_rt.engine.memory.CPU_KV_CACHE_BYTES // shape.bytes_per_block
    assert auto_num_blocks(shape, cpu, 2, 1024) == 2 * 1024 // 16  # what the engine can use
    assert auto_num_blocks(shape, cpu, 128, 8192, fraction=0.9) == 128 * 8192 // 16  # asked for explicitly


def test_max_num_seqs_defaults_to_at_most_the_budget() -> None:
    assert LLM("tiny", token_budget=32, num_kv_blocks=8).engine.config.max_num_seqs == 32
    assert LLM("tiny", token_budget=4096, num_kv_blocks=8).engine.config.max_num_seqs == 128


def test_unwritten_cache_slots_are_never_read() -> None:
    """The cache is allocated without zero-filling: poison every slot with NaN and the
    outputs stay those of a fresh engine (no kernel reads a slot before writing it)."""
    kwargs = dict(num_kv_blocks=64, block_size=8, token_budget=32, chunk_size=16, max_num_seqs=8)
    expected = [o.token_ids for o in LLM("tiny", **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)]
    poisoned = LLM("tiny", **kwargs)
    cache = poisoned.engine.executor.worker.kv_cache
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    assert [o.token_ids for o in poisoned.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="tpu"), "device"), (dict(dtype="int8"), "dtype"), (dict(token_budget=0), "token_budget"),
    (dict(tile_size="big"), "tile_size"), (dict(seed=-1), "seed"), (dict(policy="fastest"), "policy"),
    (dict(chunk_size=64, token_budget=32), "chunk_size"), (dict(model="no-such-preset"), "model"),
    (dict(kv_memory_fraction=1.5), "kv_memory_fraction"), (dict(num_kv_blocks=0), "num_kv_blocks"),
])
def test_invalid_engine_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(**{"model": "tiny", "num_kv_blocks": 8, **kwargs})


def test_llm_prompt_list_errors_roll_back(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate([[1, 2], [], [3]], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["some text"], GREEDY)
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([], GREEDY)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[1], [2]], [GREEDY])
    llm.engine.step()  # reports the rolled-back request as aborted
    _assert_clean(llm.engine)

"""Bounds on json_schema compiles (issue 43): the complexity measure, the compiled-grammar
cache, and AsyncLLMEngine's GrammarPool: daemon threads, a cap on concurrent compiles, a
time limit, and callers that leave without leaking the request or the slot."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("xgrammar")

from text_models import tiny_tokenizer  # noqa: E402
from sarathi_rt import LLM, SamplingParams  # noqa: E402
from sarathi_rt.engine import AsyncLLMEngine  # noqa: E402
from sarathi_rt.engine.grammar_pool import CompilesBusy  # noqa: E402
from sarathi_rt.engine.structured import DEFAULT_MAX_SCHEMA_COMPLEXITY, schema_complexity  # noqa: E402

BOOL = json.dumps({"type": "boolean"})
INT = json.dumps({"type": "integer", "minimum": 0, "maximum": 9})


def issue_schema(properties: int) -> dict:
    """The issue's schema: objects of an 8-value enum and a bounded integer, all optional."""
    item = {"type": "object", "properties": {"kind": {"enum": [f"v{i}" for i in range(8)]},
                                             "count": {"type": "integer", "minimum": 0, "maximum": 1000}}}
    return {"type": "object", "properties": {f"p{i}": item for i in range(properties)}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", tokenizer=tiny_tokenizer(), num_kv_blocks=64, block_size=8, token_budget=32)


def _counting(llm: LLM, monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> list[str]:
    """Count (and slow down by `delay` seconds) the compiles xgrammar really runs."""
    xgr = llm.engine._compiler()._compiler
    compile_json_schema = xgr.compile_json_schema
    compiled: list[str] = []

    def counted(schema: str, **kwargs: object) -> object:
        compiled.append(schema)
        time.sleep(delay)
        return compile_json_schema(schema, **kwargs)

    monkeypatch.setattr(xgr, "compile_json_schema", counted)
    return compiled


def _slow_engine_compile(llm: LLM, monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[threading.Thread]:
    """engine.compile_grammar taking `seconds`; returns the threads it ran on."""
    compile_grammar, threads = llm.engine.compile_grammar, []

    def slow(schema: str) -> None:
        threads.append(threading.current_thread())
        time.sleep(seconds)
        compile_grammar(schema)

    monkeypatch.setattr(llm.engine, "compile_grammar", slow)
    return threads


def test_complexity_counts_values_and_the_superlinear_parts() -> None:
    assert schema_complexity({"type": "boolean"}) == 2
    assert schema_complexity({"enum": ["a", "b"]}) == 4  # the dict, the list, two strings
    assert schema_complexity({"enum": list(range(1000))}) == 1002 + 100  # 1000 * 1000 // 10_000
    optional = {"type": "object", "properties": {f"p{i}": {} for i in range(80)}}
    assert schema_complexity(optional) == 83 + 100  # 80 * 80 // 64
    assert schema_complexity(optional | {"required": list(optional["properties"])}) == 83 + 81  # required: linear
    deep: dict = {}
    for _ in range(5000):  # no recursion limit in the way
        deep = {"items": deep}
    assert schema_complexity(deep) == 5001
    assert schema_complexity(issue_schema(4000)) > 10 * DEFAULT_MAX_SCHEMA_COMPLEXITY


def test_a_schema_compiles_once(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = _counting(llm, monkeypatch)
    schema = json.dumps({"type": "object", "properties": {"once": {"type": "boolean"}}, "required": ["once"]})
    params = SamplingParams(max_tokens=16, json_schema=schema)
    outs = llm.generate([[3, 4], [5, 6]], params, use_tqdm=False)
    outs += llm.generate([[7, 8]], SamplingParams(max_tokens=16, n=3, json_schema=schema), use_tqdm=False)

    async def run() -> None:
        await AsyncLLMEngine(llm.engine).compile_grammar(schema)

    asyncio.run(run())
    assert len(compiled) == 1 and all(json.loads(o.text) in ({"once": True}, {"once": False}) for o in outs)


def test_a_schema_over_the_complexity_limit_is_refused_before_compiling(llm: LLM,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = _counting(llm, monkeypatch)
    engine = AsyncLLMEngine(llm.engine, max_schema_complexity=DEFAULT_MAX_SCHEMA_COMPLEXITY)
    params = SamplingParams(json_schema=issue_schema(4000))
    with pytest.raises(ValueError, match=r"json_schema is too complex to compile: complexity \d+, over the limit "
                                         "of 20000"):
        asyncio.run(engine.add_request("big", [1, 2], params))
    assert not compiled and not llm.engine.has_request("big")
    with pytest.raises(ValueError, match="max_schema_complexity must be an int >= 1"):
        AsyncLLMEngine(llm.engine, max_schema_complexity=0)


def test_a_compile_over_the_time_limit_is_refused_and_runs_on_a_daemon_thread(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _slow_engine_compile(llm, monkeypatch, 1.0)
    engine = AsyncLLMEngine(llm.engine, compile_timeout=0.2)

    async def run() -> None:
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"json_schema took longer than 0.2 s to compile"):
            await engine.add_request("slow", [1, 2], SamplingParams(json_schema=BOOL))
        assert time.monotonic() - start < 0.8
        assert not llm.engine.has_request("slow") and engine.grammars.running == 1
        assert threads[0].daemon  # the interpreter's exit does not wait for it
        threads[0].join(timeout=10)
        await asyncio.sleep(0.05)  # its end reaches the loop
        assert engine.grammars.running == 0

    asyncio.run(run())
    monkeypatch.undo()
    compiled = _counting(llm, monkeypatch)
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=8, json_schema=BOOL), use_tqdm=False)[0].text in \
        ("true", "false")
    assert not compiled  # the late compile was cached


def test_compile_slots_bound_the_threads_and_a_schema_compiling_is_joined(llm: LLM,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _slow_engine_compile(llm, monkeypatch, 0.6)
    engine = AsyncLLMEngine(llm.engine, max_compiles=1, compile_timeout=2.0)
    quick = AsyncLLMEngine(llm.engine, max_compiles=1, compile_timeout=0.2)
    one, two, three, four = (json.dumps({"type": "integer", "minimum": 0, "maximum": m}) for m in (11, 12, 13, 14))

    async def run() -> None:
        first = asyncio.create_task(engine.compile_grammar(one))
        await asyncio.sleep(0.1)
        same = asyncio.create_task(engine.compile_grammar(one))  # waits for the running compile
        other = asyncio.create_task(engine.compile_grammar(two))  # waits for the slot
        await asyncio.gather(first, same, other)
        assert len(threads) == 2 and not any(t.is_alive() for t in threads)
        await engine.compile_grammar(one)
        assert len(threads) == 2  # cached: no thread
        blocker = asyncio.create_task(quick.compile_grammar(three))
        await asyncio.sleep(0.05)
        with pytest.raises(CompilesBusy, match="all 1 grammar compile slots stayed busy for 0.2 s"):
            await quick.compile_grammar(four)
        with pytest.raises(ValueError, match="took longer than"):
            await blocker

    asyncio.run(run())
    assert len(threads) == 3  # the refused schema never started a thread
    with pytest.raises(ValueError, match="max_compiles must be an int >= 1"):
        AsyncLLMEngine(llm.engine, max_compiles=0)
    with pytest.raises(ValueError, match="compile_timeout must be a positive number"):
        AsyncLLMEngine(llm.engine, compile_timeout=0)


def test_a_caller_that_leaves_while_compiling_adds_nothing_and_frees_the_slot(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _slow_engine_compile(llm, monkeypatch, 0.5)
    engine = AsyncLLMEngine(llm.engine, max_compiles=1)
    schema = json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 2})

    async def run() -> None:
        task = asyncio.create_task(engine.add_request("left", [1, 2], SamplingParams(json_schema=schema)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        threads[0].join(timeout=10)
        await asyncio.sleep(0.05)
        assert engine.grammars.running == 0
        await asyncio.wait_for(engine.compile_grammar(INT), 5)  # the slot is free again

    free = llm.engine.scheduler.num_free_blocks
    asyncio.run(run())
    assert not llm.engine.has_request("left") and not llm.engine.has_unfinished()
    assert llm.engine.scheduler.num_free_blocks == free

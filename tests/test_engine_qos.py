"""QoS classes in the engine, LLM and AsyncLLMEngine: outputs identical with and without
classes (only order and timing move), per-class metrics, relegation reported, bad classes
refused while everyone else is served."""
import asyncio
import time

import pytest

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import AsyncLLMEngine
from sarathi_rt.measure.metrics import summarize
from sarathi_rt.scheduler import QoSClass

CLASSES = {"chat": QoSClass(ttft=5.0, tbt=1.0, priority=1), "batch": QoSClass(ttft=60.0, tbt=5.0)}
# float32: the tests compare greedy tokens across batch orders, which bf16 need not keep
# (tests/test_host_kinds.py holds bf16 to what it guarantees).
OPTS = dict(num_kv_blocks=64, block_size=8, token_budget=32, chunk_size=16, max_num_seqs=8, dtype="float32")
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return [list(o.token_ids) for o in LLM("tiny", **OPTS).generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("policy", ["deadline", "fcfs"])
def test_greedy_outputs_identical_with_and_without_classes(plain, policy) -> None:
    llm = LLM("tiny", qos_classes=CLASSES, qos_policy=policy, **OPTS)
    qos = ["chat" if i % 2 else "batch" for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, qos=qos)
    assert [list(o.token_ids) for o in outs] == plain
    assert [o.metrics.qos for o in outs] == qos
    assert all(o.relegated is False for o in outs)  # generous deadlines
    summary = summarize([o.metrics for o in outs], list(llm.engine.step_metrics), qos_classes=CLASSES)
    assert summary.qos["chat"].num_requests == 3 and summary.qos["chat"].attainment == 1.0


def test_hopeless_request_is_relegated_and_still_served() -> None:
    llm = LLM("tiny", qos_classes={"rush": QoSClass(ttft=1e-6, tbt=1e-6)}, default_qos="rush", **OPTS)
    out = llm.generate([PROMPTS[5]], GREEDY, use_tqdm=False)[0]
    assert out.relegated and len(out.token_ids) == 8 and out.finish_reason == "length"


def test_every_sample_of_a_relegated_request_reports_it() -> None:
    # Relegation happens before the first token, so before the scheduler forks samples 1..n-1.
    llm = LLM("tiny", qos_classes={"rush": QoSClass(ttft=1e-6, tbt=1e-6)}, default_qos="rush", **OPTS)
    params = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
    out = llm.generate([PROMPTS[5]], params, use_tqdm=False)[0]
    assert [s.relegated for s in out.outputs] == [True, True, True]
    assert [len(s.token_ids) for s in out.outputs] == [8, 8, 8]
    assert llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks


def test_bad_class_is_refused_and_the_rest_run() -> None:
    llm = LLM("tiny", qos_classes=CLASSES, **OPTS)
    with pytest.raises(ValueError, match=r"prompts\[1\]: qos must be one of"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, qos=["chat", "gold"])
    with pytest.raises(ValueError, match="qos is required"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="one class name or one per prompt"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, qos=["chat"])
    aborted = llm.engine.step()  # the rolled-back requests report their abort
    assert all(o.finish_reason == "abort" for o in aborted) and not llm.engine.has_unfinished()
    assert len(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, qos="chat")) == 2
    with pytest.raises(ValueError, match="no qos_classes"):
        LLM("tiny", **OPTS).generate(PROMPTS[:1], GREEDY, use_tqdm=False, qos="chat")
    with pytest.raises(ValueError, match="default_qos must be one of"):
        LLM("tiny", qos_classes=CLASSES, default_qos="gold", **OPTS)


def test_async_engine_takes_a_class(plain) -> None:
    llm = LLM("tiny", qos_classes=CLASSES, **OPTS)

    async def main() -> list[list[int]]:
        aengine = AsyncLLMEngine(llm.engine)

        async def one(i: int) -> list[int]:
            last = None
            async for out in aengine.generate(PROMPTS[i], GREEDY, request_id=i, qos="chat" if i % 2 else "batch"):
                last = out
            assert last is not None and last.metrics.qos == ("chat" if i % 2 else "batch")
            return list(last.token_ids)

        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    assert asyncio.run(main()) == plain


def test_decodes_that_step_aside_give_the_same_tokens(plain) -> None:
    """Batch requests are decoding when a chat prompt arrives that, priced by a
    step-time model of 1 s a token, misses its first-token deadline unless they step
    aside (their deadlines are far): they do, and every request's greedy tokens are the
    same as without classes."""
    from sarathi_rt.engine import EngineConfig, LLMEngine
    from sarathi_rt.sim.cost import LinearCostModel

    classes = {"chat": QoSClass(ttft=40.0, tbt=50.0, priority=1), "batch": QoSClass(ttft=5000.0, tbt=1000.0)}
    engine = LLMEngine(EngineConfig(model="tiny", qos_classes=classes, **{**OPTS, "chunk_size": 32}))
    engine.scheduler.step_time_model = LinearCostModel(fixed_s=0.0, per_token_s=1.0)
    left_out = []
    planner = engine.scheduler._deadline
    leave_out = planner._leave_out
    planner._leave_out = lambda b, ids: (left_out.append(set(ids)), leave_out(b, ids))
    outs: dict[int, list[int]] = {}

    def run_until(done) -> None:
        while not done():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = list(o.token_ids)

    batch = [0, 1, 2, 4, 5]
    for i in batch:
        engine.add_request(i, PROMPTS[i], GREEDY, qos="batch")
    run_until(lambda: all(engine.scheduler.request_info(i).num_generated for i in batch))
    # 32 tokens: 2 steps of 32 s beside the 5 decodes (27 prefill tokens each), 1 without
    engine.add_request(3, PROMPTS[3], GREEDY, qos="chat")
    run_until(lambda: not engine.has_unfinished())
    assert left_out and all(ids <= set(batch) for ids in left_out)
    assert [outs[i] for i in range(6)] == plain


@pytest.mark.slow
def test_slow_steps_under_the_servers_default_tiers_still_admit() -> None:
    """Steps of 1 s (over the default tier's 0.25 s TBT, as a large model on a CPU takes),
    the server's tiers under the deadline policy, the engine's own learned step times: a
    request added once the first one's decodes are behind their deadlines (from its 6th
    token) is admitted within two steps, as FCFS would, not after the first's last token."""
    from sarathi_rt.commands.serve import DEFAULT_SERVICE_TIERS

    llm = LLM("tiny", qos_classes=DEFAULT_SERVICE_TIERS, default_qos="default", **OPTS)
    engine = llm.engine
    model = engine.executor.worker.model
    forward = model.forward

    def slow_forward(*args, **kwargs):  # inside the step the engine times and learns from
        time.sleep(1.0)
        return forward(*args, **kwargs)

    model.forward = slow_forward  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.add_request("first", PROMPTS[1], params)
    for _ in range(8):
        engine.step()
    engine.add_request("second", PROMPTS[2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    for _ in range(2):
        if any(o.request_id == "second" and o.token_ids for o in engine.step()):
            break
    else:
        pytest.fail("the second request got no token within two steps")
    assert engine.has_request("first")  # the first was still decoding: admission did not wait for it

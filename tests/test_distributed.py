"""Tensor and pipeline parallelism on CPU (gloo): TP=2, PP=2, TP=2 x PP=2 and TP=4 over
2 KV heads (replicated) worker processes give the single process's greedy tokens; a
killed or hung worker fails the engine fast and leaves no process behind; bad sizes
raise naming the argument."""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import EngineConfig, LLMEngine
from sarathi_rt.engine.distributed import WorkerError

transformers = pytest.importorskip("transformers")

PARAMS = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
# The sarathi policy with 16-token chunks and a 24-token budget: long prompts run as
# several chunks, piggybacked on the decodes of the others.
# float32: sharded GEMMs sum in another order than one process's, which bf16 rounding can
# turn into another greedy token (tests/test_host_kinds.py holds bf16 to what it guarantees).
ENGINE = dict(policy="sarathi", chunk_size=16, token_budget=24, max_num_seqs=8, block_size=8, num_kv_blocks=96,
              dtype="float32")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with GQA (4 query, 2 KV heads), 2 layers, tied embeddings and an odd vocab
    (301: the two vocabulary shards differ in size)."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=301,
                                      tie_word_embeddings=True, max_position_embeddings=256,
                                      initializer_range=0.2, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("dist") / "llama"
    transformers.LlamaForCausalLM(config).float().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(4, 301) for _ in range(n)] for n in (3, 40, 17, 9, 29, 1)]


@pytest.fixture(scope="module")
def reference(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(checkpoint, **ENGINE) as llm:
        return [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return not multiprocessing.active_children()


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), pytest.param(4, 1, id="4-1-kv-replicated")])
def test_parallel_greedy_matches_one_process(checkpoint, prompts, reference, tp: int, pp: int) -> None:
    with LLM(checkpoint, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE) as llm:
        engine = llm.engine
        pids = engine.executor.pids
        assert len(pids) == tp * pp
        in_flight: list[set] = []
        depths: list[int] = []
        submit, collect = engine.executor.submit, engine.executor.collect

        def spy_submit(step):  # a request is in at most one micro-batch in flight
            ids = {c.request_id for c in step.chunks}
            assert not any(ids & other for other in in_flight)
            in_flight.append(ids)
            submit(step)

        def spy_collect():
            depths.append(len(in_flight))
            in_flight.pop(0)
            return collect()

        engine.executor.submit, engine.executor.collect = spy_submit, spy_collect
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert max(depths) == pp
        assert [o.token_ids for o in outputs] == reference
        steps, stages = engine.step_metrics, engine.stage_metrics
        assert len(stages) == pp * len(steps)
        assert sorted({s.stage for s in stages}) == list(range(pp))
        assert all(s.busy > 0 and s.idle >= 0 for s in stages)
        for o in outputs:  # a request's waits for a busy stage fit in its time in the system
            assert o.metrics.bubble_time <= o.metrics.finish_time - o.metrics.arrival_time
            assert pp > 1 or o.metrics.bubble_time == 0.0
        if pp > 1:  # a micro-batch reaches stage 1 after stage 0 has begun it (one clock)
            starts: dict[tuple[int, int], float] = {(s.step, s.stage): s.start_time for s in stages}
            assert all(starts[(s.step, 1)] > s.start_time for s in stages if s.stage == 0)
    assert _gone(pids)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,temperature", [(1, 2, 1.0), (2, 2, 0.0)])
def test_n_samples_fork_on_every_worker(checkpoint, prompts, tp: int, pp: int, temperature: float) -> None:
    """n > 1: every worker copies the forked samples' partial prompt blocks in its own
    layers (with plans in flight under pipelining); the samples equal one process's."""
    params = SamplingParams(n=3, temperature=temperature, seed=4, max_tokens=7, ignore_eos=True)
    with LLM(checkpoint, **ENGINE) as llm:
        want = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(checkpoint, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE) as llm:
        got = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.num_free_blocks == ENGINE["num_kv_blocks"]
    assert got == want
    assert temperature or all(s == samples[0] for samples in got for s in samples)


@pytest.mark.slow
def test_killed_worker_fails_fast_and_cleans_up(checkpoint, prompts) -> None:
    llm = LLM(checkpoint, tensor_parallel_size=2, **ENGINE)
    pids = llm.engine.executor.pids
    for i, p in enumerate(prompts):
        llm.engine.add_request(i, p, PARAMS)
    llm.engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 .*killed by signal SIGKILL"):
        while llm.engine.has_unfinished():
            llm.engine.step()
    assert time.monotonic() - start < 10
    assert _gone(pids)
    with pytest.raises(RuntimeError, match="engine stopped after its executor failed: worker rank 1"):
        llm.engine.step()
    # Every request ended with the failure and gave its KV blocks back; nothing new is taken.
    assert not llm.engine.has_unfinished() and llm.engine.num_unfinished == 0
    assert llm.engine.scheduler.num_free_blocks == ENGINE["num_kv_blocks"]
    with pytest.raises(RuntimeError, match="engine stopped after its executor failed"):
        llm.engine.add_request("late", prompts[0], PARAMS)
    llm.shutdown()  # idempotent after a failure


@pytest.mark.slow
def test_killed_stage_with_two_micro_batches_in_flight_frees_every_block(checkpoint, prompts) -> None:
    with LLM(checkpoint, pipeline_parallel_size=2, **ENGINE) as llm:
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(i, p, PARAMS)
        engine.step()
        assert engine.scheduler.num_plans_in_flight >= 1
        os.kill(engine.executor.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match="rank 1"):
            while engine.has_unfinished():
                engine.step()
        assert engine.scheduler.num_plans_in_flight == 0 and engine.num_unfinished == 0
        assert engine.scheduler.num_free_blocks == ENGINE["num_kv_blocks"]


@pytest.mark.slow
def test_hung_worker_times_out(checkpoint, prompts) -> None:
    engine = LLMEngine(EngineConfig(model=checkpoint, pipeline_parallel_size=2, worker_timeout=3, **ENGINE))
    pids = engine.executor.pids
    try:
        engine.add_request(0, prompts[1], PARAMS)
        engine.step()
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        # Under load the stage before the hung one may be reported as waiting too.
        with pytest.raises(WorkerError, match=r"no answer from worker .*rank 1 \(pipeline stage 1.*worker_timeout=3s"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        engine.shutdown()
    assert _gone(pids)


@pytest.mark.slow
def test_hung_tensor_rank_is_named(checkpoint, prompts) -> None:
    """Tensor rank 0 waits on rank 1 inside the all-reduce: the hung rank is the one that
    never began the step, and the LLM API takes worker_timeout."""
    llm = LLM(checkpoint, tensor_parallel_size=2, worker_timeout=3, **ENGINE)
    pids = llm.engine.executor.pids
    try:
        llm.engine.add_request(0, prompts[1], PARAMS)
        llm.engine.step()  # with one stage, step() returns once every rank is idle again
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError) as failure:
            while llm.engine.has_unfinished():
                llm.engine.step()
        assert time.monotonic() - start < 10
        message = str(failure.value)
        assert "no answer from worker rank 1 (pipeline stage 0, tensor rank 1)" in message
        assert "worker_timeout=3s" in message and "rank 0" not in message
    finally:
        llm.shutdown()
    assert _gone(pids)


@pytest.mark.slow
def test_abort_in_flight_and_reuse_the_id(checkpoint, prompts, reference) -> None:
    """With two micro-batches in flight, a request aborted and re-added under the same id
    gets none of the old request's tokens."""
    with LLM(checkpoint, pipeline_parallel_size=2, **ENGINE) as llm:
        engine = llm.engine
        others = {f"o{i}": p for i, p in enumerate(prompts[1:4])}
        engine.add_request("x", prompts[0], PARAMS)
        for request_id, prompt in others.items():
            engine.add_request(request_id, prompt, PARAMS)
        for _ in range(20):  # until x is in the micro-batch left in flight by step()
            engine.step()
            if any(e.request_id == "x" for plan, *_ in engine._in_flight for e in plan.entries):
                break
        else:
            pytest.fail("x never stayed in flight across a step")
        engine.abort("x")
        engine.add_request("x", prompts[0], PARAMS)
        outs: dict[str, list] = {request_id: [] for request_id in ["x", *others]}
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id].append(out)
        finals = [o for o in outs["x"] if o.finished]
        assert [o.finish_reason for o in finals] == ["abort", "length"]
        assert finals[-1].token_ids == reference[0] and len(finals[-1].token_ids) == PARAMS.max_tokens
        for i, request_id in enumerate(others, start=1):
            assert [o for o in outs[request_id] if o.finished][0].token_ids == reference[i]
        assert engine.scheduler.num_free_blocks == ENGINE["num_kv_blocks"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=3), r"tensor_parallel_size \(3\) must divide num_attention_heads \(4\)"),
    (dict(tensor_parallel_size=8), r"tensor_parallel_size \(8\) must divide num_attention_heads \(4\)"),
    (dict(pipeline_parallel_size=3), r"pipeline_parallel_size \(3\) must divide num_hidden_layers \(2\)"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive int"),
    (dict(pipeline_parallel_size=-1), "pipeline_parallel_size must be a positive int"),
    (dict(tensor_parallel_size=2.0), "tensor_parallel_size must be a positive int"),
])
def test_bad_parallel_sizes_raise_before_spawning(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM("tiny", **kwargs)  # 4 attention heads, 2 layers
    assert not multiprocessing.active_children()


def test_bad_worker_timeout() -> None:
    with pytest.raises(ValueError, match="worker_timeout must be a positive finite number of seconds"):
        EngineConfig(model="tiny", worker_timeout=0)


@pytest.mark.slow
def test_prefix_caching_under_tensor_and_pipeline_parallelism(checkpoint, prompts) -> None:
    """One scheduler hands the same shared block ids to every worker: cached prefixes give
    the tokens of a one-process run without the cache."""
    shared = prompts[1][:32]
    batches = [[shared + p for p in prompts[:3]], [shared + p for p in prompts[3:]] + [shared[:20] + [7]]]
    with LLM(checkpoint, enable_prefix_caching=False, **ENGINE) as llm:
        want = [[o.token_ids for o in llm.generate(b, PARAMS, use_tqdm=False)] for b in batches]
    with LLM(checkpoint, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE) as llm:
        got = [llm.generate(b, PARAMS, use_tqdm=False) for b in batches]
        assert [[o.token_ids for o in b] for b in got] == want
        assert [o.num_cached_tokens for o in got[1]] == [32, 32, 32, 16]

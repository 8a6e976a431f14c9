"""The forward under torch.compile (engine/compiled_forward.py): the same logits (float32)
and greedy tokens as eager on a mixed batch whose steps cross bucket boundaries, a
bounded number of compilations, and a compile failure that falls back to eager with one
warning."""
from __future__ import annotations

import logging

import pytest
import torch

from sarathi_rt import LLM, SamplingParams, ops
from sarathi_rt.engine.compiled_forward import CompiledForward, buckets_for
from sarathi_rt.ops.attention import run_attention

from attention_batches import make_batch
from recorded_steps import run_recording

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# Prefills of 3-45 tokens, chunked under a 48-token budget, then decodes of 7 down to 1
# requests: token counts on both sides of the 16, 32 and 64 buckets' edges.
PROMPTS = [list(range(5, 8)), list(range(10, 55)), [9], list(range(100, 117)), list(range(200, 260, 3)),
           list(range(300, 333)), list(range(40, 52))]


def _engine(compile_mode: str) -> LLM:
    return LLM("tiny", num_kv_blocks=128, block_size=8, token_budget=48, chunk_size=32, max_num_seqs=8,
               dtype="float32", compile=compile_mode)


def _run(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor], list[int]]:
    """Greedy tokens per prompt, each step's logits and each step's token count."""
    tokens, logits, steps = run_recording(llm, PROMPTS, GREEDY)
    return tokens, logits, [n for n, _ in steps]


def test_buckets_are_powers_of_two_from_16() -> None:
    assert buckets_for(1) == (16,)
    assert buckets_for(64) == (16, 32, 64)
    assert buckets_for(65) == (16, 32, 64, 128)
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        buckets_for(0)


def test_planned_attention_leaves_padding_rows_alone() -> None:
    """A bucketed step's q has rows past the batch's last token: the planned CPU kernel
    computes the batch's rows as without them and neither reads nor writes the others."""
    batch = make_batch([(1, 20), (5, 5), (3, 9)], block_size=4, num_kv_heads=2, group=2, head_dim=16)
    tokens = batch.q.shape[0]
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                              batch.q.shape[1])
    want = torch.empty_like(batch.q)
    run_attention(plan, batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seqlens_k,
                  batch.block_tables, 0.25, want)
    padded_q = torch.cat([batch.q, torch.full((16 - tokens, *batch.q.shape[1:]), float("nan"))])
    out = torch.full_like(padded_q, 7.0)
    run_attention(plan, padded_q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seqlens_k,
                  batch.block_tables, 0.25, out)
    assert torch.equal(out[:tokens], want)
    assert torch.equal(out[tokens:], torch.full_like(out[tokens:], 7.0))


def test_compile_option_is_checked() -> None:
    with pytest.raises(ValueError, match=r"compile must be one of \['auto', 'on', 'off'\], got 'yes'"):
        LLM("tiny", num_kv_blocks=16, compile="yes")


@pytest.mark.slow
def test_compiled_equals_eager_across_buckets() -> None:
    eager_tokens, eager_logits, eager_steps = _run(_engine("off"))
    compiled = _engine("on")
    compiled_tokens, compiled_logits, compiled_steps = _run(compiled)
    assert compiled_steps == eager_steps
    # Steps of 1 to 48 tokens ran through every bucket: a graph per bucket, not per size.
    forward = compiled.engine.executor.worker.run_stage
    assert isinstance(forward, CompiledForward) and forward.buckets == (16, 32, 64)
    assert {forward.bucket(n) for n in eager_steps} == {16, 32, 64}
    assert len(set(eager_steps)) > 6
    assert forward.compilations == 3 and forward.failure is None
    assert sorted(forward.compile_seconds) == [16, 32, 64] and min(forward.compile_seconds.values()) > 0
    assert compiled_tokens == eager_tokens
    for step, (want, got) in enumerate(zip(eager_logits, compiled_logits)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step}: {m}")


@pytest.mark.slow
def test_a_compile_failure_falls_back_to_eager_once(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    import torch._inductor.compile_fx

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("inductor is broken on purpose")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken)
    eager_tokens, eager_logits, _ = _run(_engine("off"))
    with caplog.at_level(logging.WARNING, logger="sarathi_rt"):
        compiled = _engine("on")
        tokens, logits, _ = _run(compiled)
    forward = compiled.engine.executor.worker.run_stage
    assert forward.failure is not None and "inductor is broken on purpose" in forward.failure
    assert forward.bucket(16) is None and forward.compilations == 1
    warnings = [r.getMessage() for r in caplog.records if "compiled forward failed" in r.getMessage()]
    assert len(warnings) == 1 and "16 tokens" in warnings[0]
    assert tokens == eager_tokens
    for want, got in zip(eager_logits, logits):
        assert torch.equal(got, want)

"""The CPU layer loop (models/layer_loop.py) against the eager layers it stands in for:
the same logits, bit for bit, on prefill-only, mixed and decode-only steps, in float32
and bfloat16, for the tiny preset, a GQA-4 preset with q/k/v biases and SmolLM2's
shapes; the models it does not take run eagerly; a failure inside it falls back to the
eager layers with one warning and the same tokens."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine.compiled_forward import stage_forward
from sarathi_rt.engine.step_io import RowSampling, SequenceChunk, StepInput
from sarathi_rt.models import PRESETS, LlamaForCausalLM, ModelConfig
from sarathi_rt.models import layer_loop
from sarathi_rt.models.layer_loop import LayerLoop

from recorded_steps import run_recording

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
# Prompts of 1-45 tokens under a 48-token budget in 32-token chunks: a prefill-only first
# step, steps mixing chunks with decodes, then decodes alone; token counts on both sides
# of the GEMMs' 16-row padding.
PROMPTS = [list(range(5, 8)), list(range(10, 55)), [9], list(range(100, 117)), list(range(200, 260, 3))]
SHAPES = {
    "gqa4-bias": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2, qkv_bias=True, model_type="qwen2",
                             max_position_embeddings=512),
    # SmolLM2-135M's layer (hidden 576, 9 query / 3 KV heads of 64, intermediate 1536), two of them.
    "smollm2-shaped": ModelConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512,
                                  tie_word_embeddings=True),
}


def _engine(model: str, dtype: str, compile_mode: str) -> LLM:
    return LLM(model, num_kv_blocks=64, block_size=8, token_budget=48, chunk_size=32, max_num_seqs=8, dtype=dtype,
               compile=compile_mode)


def _run(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor], list[tuple[int, int]]]:
    return run_recording(llm, PROMPTS, GREEDY)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny", "gqa4-bias", "smollm2-shaped"])
def test_layer_loop_equals_eager_bit_for_bit(model: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, config in SHAPES.items():
        monkeypatch.setitem(PRESETS, name, config)
    want_tokens, want_logits, want_steps = _run(_engine(model, dtype, "off"))
    fast = _engine(model, dtype, "auto")
    loop = fast.engine.executor.worker.run_stage
    assert isinstance(loop, LayerLoop)
    tokens, logits, steps = _run(fast)
    assert loop.failure is None
    assert steps == want_steps
    # The run had every kind of step: prefill only, prefill chunks beside decodes, decodes only.
    assert steps[0][0] > steps[0][1] and steps[-1][0] == steps[-1][1]
    assert any(n > b and b > 1 for n, b in steps[1:-1])
    assert {n % 16 for n, _ in steps} != {0}
    assert tokens == want_tokens
    # One set of buffers for the largest step; a shorter step's GEMM inputs are zero past its rows.
    rows = steps[-1][0]
    assert loop._buffers["normed"].shape[0] == -(-max(n for n, _ in steps) // 16) * 16
    assert all(not t[rows:].any() for t in loop._spaces[-(-rows // 16) * 16].gemm_inputs)
    for step, (want, got) in enumerate(zip(want_logits, logits)):
        assert torch.equal(got, want), f"step {step} ({steps[step]}): logits differ"


def test_streamed_weights_run_the_streamed_kernel_in_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every weight past the streaming threshold, the loop calls our streamed kernel
    on the step's rows where the eager layers do, and still matches them."""
    monkeypatch.setattr(sys.modules["sarathi_rt.ops.linear"], "_STREAMED_WEIGHT_BYTES", 0)
    want_tokens, want_logits, _ = _run(_engine("tiny", "bfloat16", "off"))
    fast = _engine("tiny", "bfloat16", "auto")
    loop = fast.engine.executor.worker.run_stage
    tokens, logits, _ = _run(fast)
    assert all(g.streamed for space in loop._spaces.values() for gemms in space.gemms for g in gemms)
    assert tokens == want_tokens
    assert all(torch.equal(got, want) for want, got in zip(want_logits, logits))


def test_a_failure_falls_back_to_the_eager_layers_once(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The first layer's o_proj fails after its KV write: that step reruns eagerly (which
    rewrites the same slots), every later step is eager, and one warning says why."""
    want_tokens, want_logits, _ = _run(_engine("tiny", "float32", "off"))
    fast = _engine("tiny", "float32", "auto")
    loop = fast.engine.executor.worker.run_stage
    o_proj = loop.model.layers["0"].self_attn.o_proj.weight
    run_gemm = layer_loop._Gemm.__call__
    calls = []

    def failing(gemm: layer_loop._Gemm, rows: int) -> None:
        calls.append(rows)
        if gemm.weight is o_proj:
            raise RuntimeError("the layer loop is broken on purpose")
        run_gemm(gemm, rows)

    monkeypatch.setattr(layer_loop._Gemm, "__call__", failing)
    with caplog.at_level(logging.WARNING, logger="sarathi_rt"):
        tokens, logits, _ = _run(fast)
    assert loop.failure is not None and "broken on purpose" in loop.failure
    assert len(calls) == 2  # qkv, then the o_proj that failed; nothing after
    warnings = [r.getMessage() for r in caplog.records if "layer loop failed" in r.getMessage()]
    assert len(warnings) == 1
    assert tokens == want_tokens
    assert all(torch.equal(got, want) for want, got in zip(want_logits, logits))


def test_models_it_does_not_take_run_eagerly() -> None:
    qwen3 = LlamaForCausalLM(ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, model_type="qwen3"))
    assert LayerLoop.unsupported(qwen3) == "per-head q/k norms run eagerly"
    assert stage_forward(qwen3, "auto", 64) is qwen3
    with pytest.raises(ValueError, match="model cannot run in the layer loop: per-head q/k norms run eagerly"):
        LayerLoop(qwen3)
    assert "not the LLaMA layout" in LayerLoop.unsupported(torch.nn.Linear(2, 2))


def test_compile_modes_pick_the_forward() -> None:
    for mode, kind in (("auto", LayerLoop), ("off", LlamaForCausalLM)):
        worker = LLM("tiny", num_kv_blocks=16, compile=mode).engine.executor.worker
        assert type(worker.run_stage) is kind, mode



def test_a_rebound_cache_is_read_again() -> None:
    """The loop reads the KV caches' addresses once; a model bound to another cache makes
    it read them again, so no step writes into a cache the model has let go."""
    llm = LLM("tiny", num_kv_blocks=32, block_size=8, dtype="float32")
    worker = llm.engine.executor.worker
    loop = worker.run_stage
    worker.allocate_kv_cache(16)  # a new cache, bound to the same model
    step = StepInput(0, [SequenceChunk("r", [5, 6, 7], 0, [0], RowSampling(0.0, None, 1.0, 0, 0))])
    ids, ctx = worker.runner.prepare(step)
    hidden, residual = loop(ctx, input_ids=ids)
    assert loop.failure is None and loop._args[0].k == worker.kv_cache.layer(0)[0].data_ptr()
    want_hidden, want_residual = worker.model(ctx, input_ids=ids)
    assert torch.equal(hidden, want_hidden) and torch.equal(residual, want_residual)

"""A bfloat16 model's CPU forward stays in bfloat16: every torch function its layers call
(GEMMs, embedding, buffers, views) returns bf16 or integer tensors, none a float32 copy
of an activation. The fused kernels (RMSNorm, rotary, SiLU, KV write, attention) read and
write bf16 directly and convert in registers; this catches a `.float()` or `.to()`
reintroduced around them in the model or ops layer."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from sarathi_rt import LLM
from sarathi_rt.engine.step_io import RowSampling, SequenceChunk, StepInput

GREEDY = RowSampling(0.0, None, 1.0, 0, 0)


class DtypeRecorder(TorchFunctionMode):
    """Counts (function, floating dtype of a result) for every torch function called under
    it (Python level: where a copy would be written; TorchDispatchMode would also see
    inside torch's composite ops, at seconds of lazy import on first use)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[tuple[str, torch.dtype | None]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        floats = [t.dtype for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point()]
        for dtype in floats or [None]:
            self.seen[(getattr(func, "__name__", str(func)), dtype)] += 1
        return out


def test_the_layers_make_no_float32_copies(emulated_bf16: None) -> None:
    llm = LLM("tiny", dtype="bfloat16", num_kv_blocks=8, block_size=16)
    worker = llm.engine.executor.worker
    prompt = list(range(3, 23))
    steps = [StepInput(1, [SequenceChunk("a", prompt, 0, [0, 1], GREEDY)]),  # a 20-token prefill chunk
             StepInput(2, [SequenceChunk("a", [7], len(prompt), [0, 1], GREEDY),  # a decode beside a prefill
                           SequenceChunk("b", prompt[:9], 0, [2], GREEDY)])]
    for step in steps:
        input_ids, ctx = worker.runner.prepare(step)
        recorder = DtypeRecorder()
        with recorder:
            hidden, residual = worker.model(ctx, input_ids=input_ids)
        assert hidden.dtype is residual.dtype is torch.bfloat16
        ops = {op for op, _ in recorder.seen}
        # A GEMM shows as torch's `linear` or as the `empty` output our kernel writes
        # (which one runs is ops/linear.py's rule for this CPU).
        assert {"embedding", "empty_like"} <= ops and ops & {"linear", "empty"}, \
            f"the layers' calls were not seen: {sorted(ops)}"
        upcasts = {key: n for key, n in recorder.seen.items() if key[1] not in (None, torch.bfloat16)}
        assert not upcasts, f"ops in the bf16 forward made non-bf16 float tensors: {upcasts}"


def test_the_recorder_sees_an_upcast(emulated_bf16: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a norm that upcasts its input is caught."""
    from sarathi_rt.models import llama

    llm = LLM("tiny", dtype="bfloat16", num_kv_blocks=4, block_size=16)
    worker = llm.engine.executor.worker
    real = llama.RMSNorm.forward
    monkeypatch.setattr(llama.RMSNorm, "forward", lambda self, x, residual=None: real(self, x.float().to(x.dtype),
                                                                                     residual))
    input_ids, ctx = worker.runner.prepare(StepInput(1, [SequenceChunk("a", [3, 4, 5], 0, [0], GREEDY)]))
    recorder = DtypeRecorder()
    with recorder:
        worker.model(ctx, input_ids=input_ids)
    assert any(dtype is torch.float32 for _, dtype in recorder.seen)

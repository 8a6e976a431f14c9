"""A model stage's forward under torch.compile (inductor), at a bounded set of token counts.

Eager, every op of every layer is a Python call: the step split's "other" (the torch
glue between our kernels: views, empty_like, the linears' padding, module calls) is
~0.15 ms of a tiny step on the CPU. Compiled, the layers run as one graph whose glue
inductor generates; our kernels stay opaque ops in it (they are registered with the
dispatcher, with fake implementations: ops/_registry.py). Measured, that was slower than
eager, so it runs only when asked for (`stage_forward`).

The graph is specialised to its shapes, so a step's token count is padded up to a
bucket: the powers of two from 16 (the CPU linears pad rows to 16 anyway, see
ops/linear.py) up to the largest step the engine plans, so at most log2(budget / 8)
graphs are ever compiled. Padding rows have token 0 at position 0 and slot -1, which
write_kv skips, so they never touch the KV cache; attention reads and writes only the
rows the step's plan lists, and every other op of a layer treats rows independently, so
the real rows are what eager computes. The batch-sized index tensors (cu_seqlens_q,
seqlens_k, block_tables) only reach our opaque ops and are marked unbacked: their sizes
never cause a recompilation.

Nothing here knows a family's layers: it wraps whatever `CausalLM` the worker holds.
A failure to compile (or to run) a step's graph makes every step run eagerly from then
on, with one warning (a compiler that failed once would most likely fail, seconds later,
at the next bucket too); that step is rerun eagerly, which rewrites the same KV slots
with the same values, so a failure costs time, never a wrong token."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from sarathi_rt.models import CausalLM, StepContext
from sarathi_rt.models.layer_loop import LayerLoop
from sarathi_rt.ops._registry import KERNELS
from sarathi_rt.utils import nvtx

log = logging.getLogger("sarathi_rt")

SMALLEST_BUCKET = 16

Activations = tuple[torch.Tensor, torch.Tensor | None]

_substituted = False


def _trace_kernels_as_ops() -> None:
    """The layers call KERNELS.<name>, the Python kernel behind torch.ops.sarathi_rt.<name>
    (skipping the dispatcher, eagerly). Tracing into it would meet raw pointers and break
    the graph, so dynamo is told to see the registered op there instead. Done once per
    process, and only when something compiles: importing torch._dynamo costs start-up."""
    global _substituted
    if _substituted:
        return
    import torch._dynamo

    for name, kernel in vars(KERNELS).items():
        torch._dynamo.substitute_in_graph(kernel)(_op_caller(getattr(torch.ops.sarathi_rt, name)))
    _substituted = True


def _op_caller(op: Any) -> Callable[..., Any]:
    def call_op(*args: Any, **kwargs: Any) -> Any:
        return op(*args, **kwargs)
    return call_op


def stage_forward(model: CausalLM, mode: str, max_tokens: int) -> Callable[..., Activations]:
    """What a worker runs its stage's forward with, for the config's `compile` mode: the
    model itself ("off"), the model under a CompiledForward for steps of up to max_tokens
    ("on"), or ("auto") the layer loop where it takes the model (models/layer_loop.py:
    the plain LLaMA layer on the CPU) and the model elsewhere.

    "auto" never compiles. What compiling can save is the Python between our kernels
    (the split's "other", 0.13-0.16 ms of a tiny step); what it adds is paid per step
    whatever the ISA: dynamo's guards over the graph's ~30 inputs, a dispatcher round
    trip per kernel call (eagerly the layers skip it, see ops/_registry.py) and the
    padding. Measured in interleaved pairs the compiled step was slower (bench/RESULTS.md,
    "The forward under torch.compile"), and it costs seconds of start-up. The layer loop
    saves the same Python without any of that, at no start-up cost."""
    if mode == "on":
        return CompiledForward(model, max_tokens)
    # Per-layer profiling ranges (SARATHI_RT_NVTX=detail) are the eager layers'.
    if mode == "auto" and not nvtx.DETAIL and LayerLoop.unsupported(model) is None:
        return LayerLoop(model)
    return model


def buckets_for(max_tokens: int) -> tuple[int, ...]:
    """Powers of two from SMALLEST_BUCKET up to the first one that holds max_tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    sizes = [SMALLEST_BUCKET]
    while sizes[-1] < max_tokens:
        sizes.append(2 * sizes[-1])
    return tuple(sizes)


class CompiledForward:
    """Call it like the model (`forward(ctx, input_ids=..., intermediate=...)`); a step
    runs compiled at the bucket that holds its tokens, eagerly above the largest one or
    after a failure (`failure` says what failed). A bucket compiles on its first step:
    the worker's warm-up compiles the smallest at start-up, the others compile when a
    step first needs them. `compilations` counts the graphs compiled so far (a bucket
    compiles once; a larger attention plan, made when a step outgrows the one the runner
    holds, compiles its bucket again); `compile_seconds[bucket]` is the wall time of the
    steps that compiled it (tracing, inductor and the step itself)."""

    def __init__(self, model: CausalLM, max_tokens: int) -> None:
        self.model = model
        self.buckets = buckets_for(max_tokens)
        self.compilations = 0
        self.failure: str | None = None
        self.compile_seconds: dict[int, float] = {}
        self._pads: dict[int, torch.Tensor] = {}
        _trace_kernels_as_ops()
        # fullgraph: a graph break or more graphs than the limit raise (and fall back
        # here) instead of running part of the forward eagerly unnoticed. The limit has
        # room for every bucket twice (a plan may grow once); isolated, so other engines'
        # graphs of the same model class (same code object) do not count against it.
        self._compiled = torch.compile(model.forward, backend=self._count_and_compile, dynamic=False, fullgraph=True,
                                       recompile_limit=2 * len(self.buckets), isolate_recompiles=True)

    def _count_and_compile(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        self.compilations += 1
        return compile_fx(graph, example_inputs)

    def bucket(self, tokens: int) -> int | None:
        """The bucket a step of `tokens` tokens runs at; None: eagerly."""
        if self.failure is not None:
            return None
        return next((size for size in self.buckets if tokens <= size), None)

    def __call__(self, ctx: StepContext, input_ids: torch.Tensor | None = None,
                 intermediate: Activations | None = None) -> Activations:
        tokens = ctx.num_tokens
        size = self.bucket(tokens)
        if size is None:
            return self.model(ctx, input_ids=input_ids, intermediate=intermediate)
        padded_ctx, padded_ids, padded_inter = self._pad(size, ctx, input_ids, intermediate)
        compiled_before, start = self.compilations, time.perf_counter()
        try:
            hidden, residual = self._compiled(padded_ctx, input_ids=padded_ids, intermediate=padded_inter)
        except Exception as exc:  # noqa: BLE001 - any compiler fault: run eagerly from now on
            self.failure = f"{size} tokens: {type(exc).__name__}: {exc}"
            log.warning("compiled forward failed at %s; every step runs eagerly from now on", self.failure)
            return self.model(ctx, input_ids=input_ids, intermediate=intermediate)
        if self.compilations != compiled_before:
            self.compile_seconds[size] = self.compile_seconds.get(size, 0.0) + time.perf_counter() - start
        return hidden[:tokens], None if residual is None else residual[:tokens]

    def _pad(self, size: int, ctx: StepContext, input_ids: torch.Tensor | None,
             intermediate: Activations | None) -> tuple[StepContext, torch.Tensor | None, Activations | None]:
        """The step at `size` rows: positions, slots and ids padded in a per-bucket
        buffer. Past the step's tokens the slots are reset to -1 (an earlier, longer step
        left its own there, which would overwrite that step's KV); stale positions and
        ids there are harmless."""
        tokens = ctx.num_tokens
        pad = self._pads.get(size)
        if pad is None:
            pad = torch.zeros(3, size, dtype=torch.int64, device=ctx.positions.device)
            self._pads[size] = pad
        pad[0, :tokens].copy_(ctx.positions)
        pad[1, :tokens].copy_(ctx.slot_mapping)
        pad[1, tokens:].fill_(-1)
        if input_ids is not None:
            pad[2, :tokens].copy_(input_ids)
        for t in (ctx.cu_seqlens_q, ctx.seqlens_k, ctx.block_tables):
            for dim in range(t.dim()):
                torch._dynamo.decorators.mark_unbacked(t, dim)
        padded_ctx = dataclasses.replace(ctx, positions=pad[0], slot_mapping=pad[1])
        padded_inter = None
        if intermediate is not None:
            padded_inter = tuple(None if t is None else torch.nn.functional.pad(t, (0, 0, 0, size - tokens))
                                 for t in intermediate)
        return padded_ctx, None if input_ids is None else pad[2], padded_inter  # type: ignore[return-value]

"""Where a step's time goes: timers a bench installs on an in-process engine's worker (and
optionally the engine around it) for the steps it runs, and takes off again. Nothing of
them stays on the step's path when no bench is timing it.

The model names the modules it times by category (`CausalLM.timed_regions`: its GEMMs
as "linear", its attention blocks as "attention"), so the timers know no family's layers.
Each category counts its own time only: a timer nested in another (the linear layers
inside the attention module, the scheduler's update inside the engine's output
processing) is taken out of the outer one's, so the categories add up to the time
spent inside any timer; the rest of the step is `python` (the engine's glue between the
phases). On the CPU every op finishes before it returns, so the wall time around a module
is its compute; the timers cost ~1 us each, which a reader compares against the bare step.

The timers sit on the eager layers' modules, so while a split times a worker whose stage
runs otherwise (the layer loop, models/layer_loop.py, or a compiled forward) that worker
runs its eager layers: the same kernels and, for the layer loop, the same bits, with the
per-op Python the others save.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from sarathi_rt.engine import LLMEngine
    from sarathi_rt.engine.worker import Worker

# The engine's phases, in the order a step runs them; `python` is the step less all of them.
ENGINE_PHASES = ("schedule", "step_input", "prepare", "linear", "attention", "other", "logits", "sampling",
                 "process", "update")
MODEL_PHASES = ("prepare", "linear", "attention", "other", "logits", "sampling")


class StepSplit:
    """`with StepSplit(worker, engine) as split:` times every step run inside it; `ms(wall)`
    reads the split of `wall` seconds (the steps' total) by category. Without `engine`
    only the worker's phases are timed (a bench that runs the executor directly)."""

    def __init__(self, worker: Worker, engine: LLMEngine | None = None) -> None:
        self.worker, self.engine = worker, engine
        self.phases = ENGINE_PHASES if engine is not None else MODEL_PHASES
        self.seconds = dict.fromkeys(self.phases, 0.0)
        # Open timers: [category, start, seconds of the timers nested in it so far].
        self._stack: list[list[Any]] = []
        self._patched: list[tuple[object, str, object]] = []  # (owner, name, its own attribute or None)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.phases, 0.0)

    def _open(self, category: str) -> None:
        self._stack.append([category, time.perf_counter(), 0.0])

    def _close(self) -> None:
        category, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[category] += elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed

    def _timed(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._open(category)
            try:
                return fn(*args, **kwargs)
            finally:
                self._close()
        return wrapper

    def _patch(self, owner: object, name: str, category: str) -> None:
        """Time `owner.name` through an instance attribute; exit puts back what was there."""
        self._patched.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, self._timed(getattr(owner, name), category))

    def __enter__(self) -> StepSplit:
        model = self.worker.model
        self._patched.append((self.worker, "run_stage", self.worker.run_stage))
        self.worker.run_stage = model
        self._patch(model, "forward", "other")  # what its layers do outside their timed regions
        for category, module in model.timed_regions():
            self._patch(module, "forward", category)
        self._patch(model, "compute_logits", "logits")
        self._patch(self.worker, "sampler", "sampling")
        self._patch(self.worker.runner, "prepare", "prepare")
        if self.engine is not None:
            self._patch(self.engine.scheduler, "schedule", "schedule")
            self._patch(self.engine, "_step_input", "step_input")
            self._patch(self.engine, "_process", "process")
            self._patch(self.engine.scheduler, "update", "update")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, own in reversed(self._patched):
            if own is None:  # a method of the class: drop the instance attribute
                delattr(owner, name)
            else:  # an attribute of the instance (the worker's sampler)
                setattr(owner, name, own)
        self._patched.clear()

    def ms(self, wall: float) -> dict[str, float]:
        """The `wall` seconds of the steps timed since the last reset, by category in ms;
        `python` is what no timer saw."""
        out = {k: 1e3 * v for k, v in self.seconds.items()}
        out["python"] = 1e3 * wall - sum(out.values())
        return out

"""An injected model failure: the forward of a running engine raises."""
from __future__ import annotations

from sarathi_rt.engine import LLMEngine


class Boom(RuntimeError):
    pass


def break_after(engine: LLMEngine, calls: int) -> None:
    """The stage's forward (what the worker runs: the layer loop or the model) raises
    Boom from its `calls`-th call on."""
    worker = engine.executor.worker
    forward, seen = worker.run_stage, [0]

    def failing(*args: object, **kwargs: object) -> object:
        seen[0] += 1
        if seen[0] >= calls:
            raise Boom("the forward raised (injected)")
        return forward(*args, **kwargs)

    worker.run_stage = failing

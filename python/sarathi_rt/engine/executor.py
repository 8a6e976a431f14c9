"""Executors run StepInputs on workers. The driver only sees this interface, so the
in-process executor can give way to one that drives tensor/pipeline-parallel worker
processes without touching the engine."""
from __future__ import annotations

from collections import deque
from typing import Protocol

from sarathi_rt.config import EngineConfig
from sarathi_rt.models import ResolvedModel

from .step_io import StepInput, StepOutput
from .worker import Worker


class Executor(Protocol):
    num_kv_blocks: int  # blocks every worker holds (the scheduler's cache size)
    pipeline_depth: int  # micro-batches the driver keeps in flight (pipeline stages)

    def submit(self, step: StepInput) -> None:
        """Start a step; it runs after every step submitted before it."""

    def collect(self) -> StepOutput:
        """The output of the oldest submitted step not yet collected (waits for it)."""

    def shutdown(self) -> None:
        """Release the workers; idempotent."""


class InProcessExecutor:
    """One worker holding the whole model (config.model, resolved as `model`), in this
    process: a step runs as it is submitted."""

    pipeline_depth = 1

    def __init__(self, config: EngineConfig, model: ResolvedModel) -> None:
        self.worker = Worker(config, model)
        self.num_kv_blocks = self.worker.num_kv_blocks
        self._done: deque[StepOutput] = deque()

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

    def submit(self, step: StepInput) -> None:
        self._done.append(self.worker.execute(step))

    def collect(self) -> StepOutput:
        if not self._done:
            raise RuntimeError("collect() without a submitted step")
        return self._done.popleft()

    def shutdown(self) -> None:
        self._done.clear()

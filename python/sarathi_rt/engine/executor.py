"""Executors run StepInputs on workers. The driver only sees this interface, so the
in-process executor can give way to one that drives tensor/pipeline-parallel worker
processes without touching the engine."""
from __future__ import annotations

from typing import Protocol

from .config import EngineConfig
from .step_io import StepInput, StepOutput
from .worker import Worker


class Executor(Protocol):
    num_kv_blocks: int  # blocks every worker holds (the scheduler's cache size)

    def execute(self, step: StepInput) -> StepOutput: ...


class InProcessExecutor:
    """One worker holding the whole model, in this process."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.num_kv_blocks = self.worker.num_kv_blocks

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

"""What the driver sends a worker for one step and what comes back: plain, picklable
data (no tensors), so an executor may ship it to other processes unchanged.

The per-request records are slotted but not frozen: nothing changes them after they are
built, and a frozen dataclass's __init__ (object.__setattr__ per field) costs ~6x as
much, which the engine pays for every running request on every step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from sarathi_rt.measure.metrics import StageMetrics
from sarathi_rt.sampling import GREEDY_TEMPERATURE


@dataclass(slots=True)
class RowSampling:
    """How to sample one row. `num_generated` (tokens the request produced before this
    one) keys the row's random stream together with `seed`, so a request draws the same
    tokens whatever else is in its batch, and again after a preemption."""

    temperature: float
    top_k: int | None
    top_p: float
    seed: int
    num_generated: int
    logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(slots=True)
class SequenceChunk:
    """`token_ids` of one request at positions start_pos.. of its sequence. `block_table`
    maps every position up to start_pos + len(token_ids) to a KV block. `sampling` is
    set when this chunk ends on a token to sample from (a finished prefill, a decode)."""

    request_id: Hashable
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling: RowSampling | None = None


@dataclass(slots=True)
class StepInput:
    step: int
    chunks: list[SequenceChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(slots=True)
class StepOutput:
    """One sampled token per chunk with `sampling`, in chunk order; `logprobs` holds the
    sampled token's log probability for rows that asked for it (None elsewhere).
    `stages`: per pipeline stage timings, when the executor runs stages in processes."""

    step: int
    token_ids: list[int]
    logprobs: list[float | None]
    stages: list[StageMetrics] = field(default_factory=list)

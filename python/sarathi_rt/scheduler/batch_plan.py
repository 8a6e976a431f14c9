"""What one step runs (BatchPlan, the scheduler's only output to an engine or simulator),
and StepBuilder, a plan under construction with the scheduler's private facts about it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from .request import Request


@dataclass(slots=True)
class PlanEntry:
    """`num_tokens` tokens of one request starting at `start_pos` of its full sequence
    (prompt followed by the tokens generated so far; a request preempted by recompute
    re-prefills from 0). `emits_token`: the step samples a token for this request
    (every decode, and the chunk that completes a prefill). `num_draft`: a decode that
    verifies proposed tokens (speculative decoding) runs its last token and `num_draft`
    proposals after it, num_tokens == 1 + num_draft."""

    request_id: Hashable
    start_pos: int
    num_tokens: int
    is_prefill: bool
    emits_token: bool
    num_draft: int = 0


@dataclass(slots=True)
class BatchPlan:
    """One step. `preempted` lists requests whose KV blocks were freed while this plan
    was built: the engine must drop their cached state; they re-prefill later.
    `relegated` lists requests found, while this plan was built, unable to make their
    first-token deadline (QoS): from now on they rank by a fresh deadline of their class.
    `block_copies` lists (source, destination) KV blocks to copy before the step runs:
    the partly filled last prompt block of a request whose samples (n > 1) were just
    forked, one copy per sample that writes its own tokens after the prompt."""

    step: int
    entries: list[PlanEntry] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    tile_padding: int = 0
    preempted: list[Hashable] = field(default_factory=list)
    relegated: list[Hashable] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.entries


class StepBuilder:
    """A plan under construction plus the scheduler-private facts about it."""

    __slots__ = ("plan", "reqs", "budget", "made_room")

    def __init__(self, step: int, budget: int) -> None:
        self.plan = BatchPlan(step)
        self.reqs: list[Request] = []  # parallel to plan.entries
        self.budget = budget
        self.made_room = False  # preempted on purpose to admit a tighter request (QoS)

    @property
    def budget_left(self) -> int:
        return self.budget - self.plan.num_prefill_tokens - self.plan.num_decode_tokens

    @property
    def admission_open(self) -> bool:
        # Admitting right after preempting would hand the blocks just freed to a
        # newcomer and thrash; vLLM skips admission in such a step too. Unless the
        # blocks were freed for that newcomer (the deadline policy making room).
        return not self.plan.preempted or self.made_room

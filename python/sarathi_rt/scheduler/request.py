"""Per-request scheduling state (private) and its read-only snapshot (public)."""
from __future__ import annotations

import enum
from collections import abc
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from .qos import QoSClass
from .speculation import AcceptanceEstimate


def generated_tokens(entry: object) -> Sequence[object]:
    """The tokens of one `token_ids` entry of Scheduler.update: an int for a plain
    decode, a sequence for a verifying one (anything else is one odd token, for the
    caller's check to name). collections.abc, not typing: update calls this for every
    decode of every step, and typing's isinstance is ~10x slower."""
    return (entry,) if isinstance(entry, int) or not isinstance(entry, abc.Sequence) else entry


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True)
class Request:
    request_id: Hashable
    num_prompt_tokens: int
    max_new_tokens: int
    arrival: int
    # Tokens to prefill before decoding: the prompt, or after a preemption by
    # recompute the prompt plus every token generated so far.
    prefill_target: int = 0
    num_computed: int = 0  # leading tokens whose KV is (or, in flight, will be) cached
    num_generated: int = 0
    blocks: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    in_flight: bool = False  # part of a plan not yet passed to update()
    first_scheduled_step: int | None = None
    num_preemptions: int = 0
    # Prefix caching: keys of the full blocks of the prompt and then of the generated
    # tokens; the tokens after the last full block (None: its token ids are not known,
    # so nothing is keyed); the cached blocks the head of the queue matched (taken only
    # on admission); blocks registered or reused so far; prompt tokens skipped at the
    # first admission.
    block_keys: list[bytes] = field(default_factory=list)
    key_tail: list[int] | None = None
    matched: list[int] = field(default_factory=list)
    matched_tokens: int = 0
    matched_idle: int = 0  # of `matched`, blocks nobody references (they count as free)
    num_keyed: int = 0
    num_cached_tokens: int = 0
    arrival_step: int = 0  # the last step scheduled before the request was added (0: none)
    # QoS: the class's name and deadlines, the arrival in seconds they count from,
    # whether the request can no longer make its first-token deadline, and when it was
    # found so (its first token is then ranked by a fresh deadline from there).
    qos: str | None = None
    qos_class: QoSClass | None = None
    arrival_time: float = 0.0
    relegated: bool = False
    relegated_at: float = 0.0
    # n > 1: the ids of the request's other samples, created (Scheduler._fork) when its
    # first prefill completes; empty afterwards.
    samples: tuple[Hashable, ...] = ()
    # Speculative decoding: tokens proposed for the next decode (Scheduler.set_proposals;
    # used by the next plan that decodes it, then 0) and how its proposals fared so far.
    proposals: int = 0
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)

    def next_deadline(self) -> float:
        """When the request's next token is due (inf without a class)."""
        if self.qos_class is None:
            return float("inf")
        return self.qos_class.deadline(self.arrival_time, self.num_generated)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def prefill_left(self) -> int:
        """Prefill tokens still to compute (for the waiting head: after its match)."""
        return self.prefill_target - self.num_computed - self.matched_tokens

    def info(self) -> RequestInfo:
        return RequestInfo(self.request_id, self.num_prompt_tokens, self.max_new_tokens,
                           self.arrival, self.status, self.num_computed, self.num_generated,
                           len(self.blocks), self.first_scheduled_step, self.num_preemptions,
                           self.num_cached_tokens, self.qos, self.relegated)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """Scheduling facts a simulator or metrics layer reads; a snapshot, never live."""

    request_id: Hashable
    num_prompt_tokens: int
    max_new_tokens: int
    arrival: int  # admission order: 0 for the first add_request, then 1, 2, ...
    status: RequestStatus
    num_computed: int
    num_generated: int
    num_blocks: int
    first_scheduled_step: int | None
    num_preemptions: int
    num_cached_tokens: int = 0  # prompt tokens the first admission took from the prefix cache
    qos: str | None = None  # the request's QoS class
    relegated: bool = False  # it could no longer make its first-token deadline

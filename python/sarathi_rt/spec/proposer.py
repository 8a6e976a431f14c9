"""The interface every proposer implements."""
from __future__ import annotations

from typing import Hashable, Protocol, Sequence


class ProposalSource(Protocol):
    """What a proposer reads of a request (engine.sequence.SequenceState is one)."""

    key: Hashable  # one sample of one request
    prompt: Sequence[int]
    output: Sequence[int]


class Proposer(Protocol):
    """Guesses at most `k` tokens that follow a request's tokens so far, without touching
    the device. `release` forgets a request that finished or was aborted."""

    k: int

    def propose(self, seq: ProposalSource) -> list[int]: ...

    def release(self, key: Hashable) -> None: ...

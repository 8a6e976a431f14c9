"""The interface every proposer implements."""
from __future__ import annotations

from typing import Hashable, Protocol, Sequence


class ProposalSource(Protocol):
    """What a proposer reads of a request (engine.sequence.SequenceState is one)."""

    key: Hashable  # one sample of one request
    prompt: Sequence[int]
    output: Sequence[int]


class Proposer(Protocol):
    """Guesses at most `k` tokens that follow a request's tokens so far. `propose_batch`
    answers for every decoding sample of a step at once, at most rooms[i] tokens for
    seqs[i] (so that a proposer running a model batches them into one forward per draft
    position); `release` forgets a request that finished, was aborted or was preempted."""

    k: int

    def propose_batch(self, seqs: Sequence[ProposalSource], rooms: Sequence[int]) -> list[list[int]]: ...

    def release(self, key: Hashable) -> None: ...

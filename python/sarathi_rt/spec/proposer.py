"""The interface every proposer implements, and the one built from the config."""
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


def create_proposer(method: str, k: int, ngram_min: int, ngram_max: int) -> Proposer | None:
    """The proposer of config.speculative_method (None for "none")."""
    if method == "none":
        return None
    if method == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(k, ngram_min, ngram_max)
    raise ValueError(f"speculative_method must be 'none' or 'ngram', got {method!r}")

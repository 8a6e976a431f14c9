"""Prompt lookup: the request's last n tokens, found earlier in its prompt or output,
predict that what followed them then follows now."""
from __future__ import annotations

from typing import Hashable, Sequence

from sarathi_rt.utils.checks import positive_int

from .proposer import ProposalSource


class _NgramIndex:
    """For each n, every n-gram of one request's tokens mapped to the position right
    after its latest occurrence that has a follower. Appending a token adds n_max
    entries, so a step's lookup never scans the history."""

    __slots__ = ("grams", "length")

    def __init__(self, ns: range) -> None:
        self.grams: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ns}
        self.length = 0  # tokens indexed

    def extend(self, tokens: Sequence[int], start: int) -> None:
        """Index tokens[start:], `tokens` being the whole sequence seen so far (start == self.length)."""
        for i in range(max(start, 1), len(tokens)):
            for n, grams in self.grams.items():
                if i >= n:
                    # The n-gram ending just before position i is followed by token i; a
                    # later occurrence replaces an earlier one (recent text predicts best).
                    grams[tuple(tokens[i - n:i])] = i
        self.length = len(tokens)


class NgramProposer:
    """Matches the last n tokens of prompt + output, n from `n_max` down to `n_min`, and
    proposes up to `k` tokens that followed the latest earlier match."""

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        positive_int("k", k)
        positive_int("n_min", n_min)
        positive_int("n_max", n_max)
        if n_min > n_max:
            raise ValueError(f"n_min ({n_min}) must not exceed n_max ({n_max})")
        self.k = k
        self._ns = range(n_max, n_min - 1, -1)
        self._indexes: dict[Hashable, tuple[_NgramIndex, list[int]]] = {}

    def propose(self, seq: ProposalSource) -> list[int]:
        entry = self._indexes.get(seq.key)
        if entry is None:
            entry = self._indexes[seq.key] = (_NgramIndex(self._ns), list(seq.prompt))
        index, tokens = entry
        # `tokens` mirrors prompt + output, grown by the new tokens only.
        tokens += seq.output[len(tokens) - len(seq.prompt):]
        index.extend(tokens, index.length)
        end = len(tokens)
        for n, grams in index.grams.items():
            if end < n:
                continue
            follower = grams.get(tuple(tokens[end - n:]))
            if follower is not None:
                return tokens[follower:follower + self.k]
        return []

    def propose_batch(self, seqs: Sequence[ProposalSource], rooms: Sequence[int]) -> list[list[int]]:
        """One lookup per sample: an n-gram index costs nothing to batch."""
        return [self.propose(seq)[:room] if room > 0 else [] for seq, room in zip(seqs, rooms)]

    def release(self, key: Hashable) -> None:
        self._indexes.pop(key, None)

"""Prefix-cache keys: a chained hash per full KV block of a sequence (its prompt, then
its generated tokens as they fill blocks, so a conversation's next turn, which re-sends
the previous answer, finds it cached).

A block's key digests its parent block's key and its own token ids, so equal token runs
at different prefixes get different keys; blake2b makes collisions (two different
prefixes sharing KV) practically impossible, unlike Python's `hash`."""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Sequence

_ROOT = b"sarathi_rt.prefix_cache.v1"


def next_block_hash(parent: bytes | None, block: Sequence[int]) -> bytes:
    """The key of the full block `block` after the block keyed `parent` (None: the first)."""
    return hashlib.blake2b((_ROOT if parent is None else parent) + array("q", block).tobytes(),
                           digest_size=32).digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of the full blocks of `token_ids` (a trailing partial block has none)."""
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys.append(next_block_hash(keys[-1] if keys else None, token_ids[start:start + block_size]))
    return keys


@dataclass(frozen=True)
class PrefixCacheStats:
    """Since the scheduler was created: `queries` prompt tokens looked up at admission
    (a request re-admitted after preemption counts again), `hits` of them served from
    the cache, `evictions` cached blocks reused for other contents."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

"""Paged KV cache bookkeeping on top of the C++ BlockAllocator, with an optional
block-level prefix cache."""
from __future__ import annotations

from sarathi_rt._C import BlockAllocator

from .prefix_cache import PrefixCacheStats


class BlockManager:
    """Grows and frees the block lists that requests own. Callers check capacity
    first (`num_free`) so the hot path never relies on exceptions.

    With `enable_prefix_caching`, full blocks whose KV has been computed are registered
    under their chained key (`register`); a later request `match`es the longest run of
    its keys and shares those blocks (`reuse`). Blocks nobody references stay cached on
    the allocator's LRU list and count as free; allocating evicts them, oldest first,
    only when no never-cached block is left."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self._alloc = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._queries = self._hits = self._evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get: free plus cached-free (evictable)."""
        return self._alloc.num_free

    @property
    def num_cached_free(self) -> int:
        return self._alloc.num_cached_free

    @property
    def num_blocks(self) -> int:
        return self._alloc.num_blocks

    def refcount(self, block: int) -> int:
        return self._alloc.refcount(block)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Extend `blocks` to hold `num_tokens` tokens; False (and no change) if the
        cache lacks the blocks."""
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need <= 0:
            return True
        if need > self._alloc.num_free:
            return False
        blocks.extend(self.take(need))
        return True

    def truncate(self, blocks: list[int], num_tokens: int) -> None:
        """Shrink `blocks` to those `num_tokens` tokens need, freeing the rest (a rollback
        of speculated tokens: their slots in the blocks kept are simply overwritten)."""
        keep = self.blocks_for(num_tokens)
        if len(blocks) > keep:
            self.release(blocks[keep:])
            del blocks[keep:]

    def take(self, n: int) -> list[int]:
        """n fresh blocks; the caller has checked num_free."""
        ids = self._alloc.allocate(n)
        if self._key_of:
            for block in ids:
                key = self._key_of.pop(block, None)
                if key is not None:  # evicted: its old contents are about to be overwritten
                    del self._by_key[key]
                    self._evictions += 1
        return ids

    def share(self, blocks: list[int]) -> list[int]:
        """A reference on each of `blocks` (in use by another request) for one more
        owner; returns a new list of them."""
        if blocks:
            self._alloc.incref(blocks)
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        if blocks:
            # Tail first: at equal age the LRU list then evicts a request's last blocks
            # before its first ones, which more prompts share.
            self._alloc.free(blocks[::-1] if self.caching else blocks)
            blocks.clear()

    # ------------------------------------------------------------ prefix cache
    def match(self, keys: list[bytes], max_blocks: int) -> tuple[list[int], int]:
        """The cached blocks of the longest run of `keys[:max_blocks]` from the start,
        and how many of them nobody references (taking those lowers num_free)."""
        found: list[int] = []
        idle = 0
        for key in keys[:max_blocks]:
            block = self._by_key.get(key)
            if block is None:
                break
            found.append(block)
            idle += self._alloc.refcount(block) == 0
        return found, idle

    def reuse(self, blocks: list[int], num_prompt_tokens: int) -> None:
        """Take a reference on matched blocks for a request admitted with a prompt (or
        recompute target) of `num_prompt_tokens`; counts the lookup in the stats."""
        if blocks:
            self._alloc.reuse(blocks)
        self._queries += num_prompt_tokens
        self._hits += len(blocks) * self.block_size

    def register(self, block: int, key: bytes) -> None:
        """`block` now holds the KV of the full block `key`. A key computed twice (two
        requests missed at once) keeps its first block; the copy stays uncached."""
        if key not in self._by_key:
            self._by_key[key] = block
            self._key_of[block] = key
            self._alloc.mark_cached([block])

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits, self._evictions)

"""Paged KV cache bookkeeping on top of the C++ BlockAllocator."""
from __future__ import annotations

from sarathi_rt._C import BlockAllocator


class BlockManager:
    """Grows and frees the block lists that requests own. Callers check capacity
    first (`num_free`) so the hot path never relies on exceptions."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self._alloc = BlockAllocator(num_blocks)
        self.block_size = block_size

    @property
    def num_free(self) -> int:
        return self._alloc.num_free

    @property
    def num_blocks(self) -> int:
        return self._alloc.num_blocks

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
        blocks.extend(self._alloc.allocate(need))
        return True

    def take(self, n: int) -> list[int]:
        """n fresh blocks; the caller has checked num_free."""
        return self._alloc.allocate(n)

    def release(self, blocks: list[int]) -> None:
        if blocks:
            self._alloc.free(blocks)
            blocks.clear()

"""The paged KV cache's storage: one K and one V tensor per layer, all sharing block ids."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sarathi_rt.utils.checks import positive_int
from sarathi_rt.utils.dtypes import DTypeLike, parse_dtype


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: DTypeLike = torch.float32  # a torch dtype or its name; stored as the torch dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            positive_int(name, getattr(self, name))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for_memory(self, budget_bytes: int) -> int:
        """How many blocks fit in `budget_bytes` of cache memory."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        return budget_bytes // self.bytes_per_block


class KVCache:
    """Per-layer K and V tensors [num_blocks, block_size, num_kv_heads, head_dim].

    The storage is left uninitialised: the kernels read a slot only after this step or
    an earlier one wrote it, and on the CPU untouched pages then cost no time at start-up
    and no physical memory until used."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        dims = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.empty(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.v = [torch.empty(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's K and V in every layer."""
        ids = [i for pair in pairs for i in pair]
        if not all(isinstance(i, int) and 0 <= i < self.num_blocks for i in ids):
            raise ValueError(f"block_copies must hold block ids in [0, {self.num_blocks}), got {pairs}")
        device = self.k[0].device
        src = torch.tensor(ids[0::2], device=device)
        dst = torch.tensor(ids[1::2], device=device)
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

"""Ragged paged batches shared by the CPU and CUDA attention tests and the planner tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sarathi_rt import ops
from sarathi_rt.ops import reference

# (q_len, kv_len) per request; lengths 1, 17, 37, 577 as decodes and as chunks.
MIXED = [(1, 577), (17, 17), (1, 1), (37, 614), (1, 37), (577, 577), (1, 17)]
DECODE = [(1, 1), (1, 17), (1, 37), (1, 577), (1, 1154)]
PREFILL = [(17, 17), (37, 54), (577, 577), (1, 1), (37, 37)]
GRIDS = {"mixed": MIXED, "decode": DECODE, "prefill": PREFILL}


@dataclass
class PagedBatch(reference.PagedBatch):
    def run(self, **kwargs: object) -> torch.Tensor:
        return ops.hybrid_attention(*self.args(), **kwargs)

    def reference(self, **kwargs: object) -> torch.Tensor:
        return reference.hybrid_attention(*self.args(), **kwargs)

    def plain_torch(self, scale: float | None = None) -> torch.Tensor:
        return reference.sdpa_per_request(*self.args(), scale=scale)


def make_batch(lengths: list[tuple[int, int]], *, block_size: int = 16, num_kv_heads: int = 2, group: int = 4,
               head_dim: int = 64, dtype: torch.dtype = torch.float32, device: str = "cpu",
               seed: int = 0) -> PagedBatch:
    """reference.random_paged_batch with `group` query heads per KV head and a few blocks
    nobody owns."""
    batch = reference.random_paged_batch(lengths, num_q_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim, block_size=block_size, dtype=dtype, device=device,
                                         spare_blocks=3, seed=seed)
    return PagedBatch(*batch.args())

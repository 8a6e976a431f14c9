"""Ragged paged batches shared by the CPU and CUDA attention tests and the planner tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sarathi_rt import ops
from sarathi_rt.ops import reference

# (q_len, kv_len) per request; lengths 1, 17, 37, 577 as decodes and as chunks.
MIXED = [(1, 577), (17, 17), (1, 1), (37, 614), (1, 37), (577, 577), (1, 17)]
DECODE = [(1, 1), (1, 17), (1, 37), (1, 577), (1, 1154)]
PREFILL = [(17, 17), (37, 54), (577, 577), (1, 1), (37, 37)]
GRIDS = {"mixed": MIXED, "decode": DECODE, "prefill": PREFILL}


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    block_tables: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seqlens_k, self.block_tables

    def run(self, **kwargs: object) -> torch.Tensor:
        return ops.hybrid_attention(*self.args(), **kwargs)

    def reference(self, **kwargs: object) -> torch.Tensor:
        return reference.hybrid_attention(*self.args(), **kwargs)

    def plain_torch(self, scale: float | None = None) -> torch.Tensor:
        """What a user would write without us, at q's dtype: gather the pages, then SDPA
        per request with the bottom-right causal mask."""
        q, k_cache, v_cache, cu, seqlens_k, tables = self.args()
        out = torch.empty_like(q)
        bounds = cu.tolist()
        for b, kv_len in enumerate(seqlens_k.tolist()):
            q_len = bounds[b + 1] - bounds[b]
            if q_len == 0:
                continue
            k, v = (reference.gather_kv(c, tables[b], kv_len).transpose(0, 1) for c in (k_cache, v_cache))
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
            out[bounds[b]:bounds[b + 1]] = F.scaled_dot_product_attention(
                q[bounds[b]:bounds[b + 1]].transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                enable_gqa=True).transpose(0, 1)
        return out


def make_batch(lengths: list[tuple[int, int]], *, block_size: int = 16, num_kv_heads: int = 2, group: int = 4,
               head_dim: int = 64, dtype: torch.dtype = torch.float32, device: str = "cpu",
               seed: int = 0) -> PagedBatch:
    """Random q and caches; each request's pages are scattered over a shuffled pool. Unused
    table columns are -1, so a kernel that reads past a request's pages fails loudly."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-kv // block_size) for _, kv in lengths]
    num_blocks = sum(pages) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    max_pages = max(pages) + 1
    tables = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    cu = torch.tensor([0] + [q for q, _ in lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=g).to(dtype)
    seqlens_k = torch.tensor([kv for _, kv in lengths], dtype=torch.int32)
    return PagedBatch(*(t.to(device) for t in (q, k_cache, v_cache, cu, seqlens_k, tables)))

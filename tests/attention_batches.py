"""Ragged paged batches shared by the CPU and CUDA attention tests and the planner tests."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from sarathi_rt import ops
from sarathi_rt.ops import reference
from sarathi_rt.ops.attention_plan import ITEM_FIELDS

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


def run_in_steps(full: PagedBatch, step: int, **kwargs: object) -> torch.Tensor:
    """The one request of `full` run `step` queries at a time, each step over the keys up
    to its last query (a chunked prefill; one decode a step at step 1), the outputs
    concatenated: equal to full.run() bit for bit where a query's output does not depend
    on the tile or path that computed it."""
    n = full.q.shape[0]
    parts = []
    for start in range(0, n, step):
        end = min(start + step, n)
        part = PagedBatch(**{**full.__dict__, "q": full.q[start:end],
                             "cu_seqlens_q": torch.tensor([0, end - start], dtype=torch.int32),
                             "seqlens_k": torch.tensor([end], dtype=torch.int32)})
        parts.append(part.run(**kwargs))
    return torch.cat(parts)


POISON = 1000.0  # finite (a masked lane times it stays 0) but far outside any real key or value


def poison_unowned_slots(batch: PagedBatch) -> PagedBatch:
    """Fills every cache slot outside each request's [0, kv_len) keys (the tail of its last
    block, spare blocks) with POISON, so a kernel that reads past the end fails loudly."""
    block_size = batch.k_cache.shape[1]
    owned = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool, device=batch.k_cache.device)
    for b, kv_len in enumerate(batch.seqlens_k.tolist()):
        positions = torch.arange(kv_len, device=owned.device)
        owned[batch.block_tables[b, positions // block_size].long(), positions % block_size] = True
    for cache in (batch.k_cache, batch.v_cache):
        cache[~owned] = POISON
    return batch


def poison_chunk_keys(batch: PagedBatch) -> PagedBatch:
    """Sets the values of every key a chunk adds this step, except its first, to POISON:
    the rows that may see them match the reference only if every earlier row stops at its
    causal limit (POISON / kv_len would swamp the tolerance)."""
    block_size = batch.k_cache.shape[1]
    cu = batch.cu_seqlens_q.tolist()
    for b, kv_len in enumerate(batch.seqlens_k.tolist()):
        q_len = cu[b + 1] - cu[b]
        positions = torch.arange(min(kv_len - q_len + 1, kv_len), kv_len, device=batch.v_cache.device)
        batch.v_cache[batch.block_tables[b, positions // block_size].long(), positions % block_size] = POISON
    return batch


# Unit roundoff of the output dtype (with a 2x margin: bfloat16 and float16 round to nearest).
_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
_F32_EPS = 2.0 ** -24


def reference_and_tolerance(batch: PagedBatch, scale: float | None = None, window: int | None = None,
                            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention o = P V and a per-element tolerance that one key too many or too
    few in a row exceeds: rounding the output (u |o|) plus rounding each probability
    before P V (random, so about u sqrt(sum_j p_j^2 v_j^2), with a 4x margin). float32
    kernels: float32 rounding of scores as large as the batch's largest, which moves each
    probability by eps |s| (large with a large scale). window and softcap as in
    reference.hybrid_attention (a soft cap bounds the scores, and so that error)."""
    q, k_cache, v_cache = (t.double() for t in (batch.q, batch.k_cache, batch.v_cache))
    group = q.shape[1] // k_cache.shape[2]
    scale = q.shape[2] ** -0.5 if scale is None else scale
    out, spread = torch.zeros_like(q), torch.zeros_like(q)
    max_score = 0.0
    cu = batch.cu_seqlens_q.tolist()
    for b, kv_len in enumerate(batch.seqlens_k.tolist()):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        k = reference.gather_kv(k_cache, batch.block_tables[b], kv_len).repeat_interleave(group, dim=1)
        v = reference.gather_kv(v_cache, batch.block_tables[b], kv_len).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu[b]:cu[b + 1]], k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        limit = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        key_pos = torch.arange(kv_len, device=q.device)[None, :]
        hidden = key_pos > limit
        if window:
            hidden |= key_pos <= limit - window
        scores = scores.masked_fill(hidden, float("-inf"))
        max_score = max(max_score, scores.nan_to_num(neginf=0.0).abs().max().item())
        p = scores.softmax(dim=-1)
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", p, v)
        spread[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", p * p, v * v).sqrt()
    u = _ROUNDOFF.get(batch.q.dtype)
    if u is None:
        return out, 1e-5 * (1 + out.abs()) + 8 * _F32_EPS * (1 + max_score) * (out.abs() + spread)
    return out, u * out.abs() + 4 * u * spread + 1e-5


def assert_strictly_close(got: torch.Tensor, batch: PagedBatch, scale: float | None = None,
                          window: int | None = None, softcap: float | None = None) -> None:
    want, tol = reference_and_tolerance(batch, scale, window, softcap)
    err = (got.double() - want).abs()
    worst = int((err / tol).flatten().argmax())
    assert torch.isfinite(got).all()
    assert (err <= tol).all(), (f"error {err.flatten()[worst].item():.3g} over tolerance "
                                f"{tol.flatten()[worst].item():.3g} at flat index {worst}")


def move_last_split(plan: ops.AttentionPlan, request: int, key: int) -> None:
    """Moves the boundary between the last two pieces of each split tile of `request` to
    `key`, in place. Even splits never leave a piece that a row of its tile cannot see
    (pieces are longer than a tile's causal spread), so tests of that merge case make one."""
    items = plan.work_items()
    pieces = [i for i, row in enumerate(items.tolist()) if row[ITEM_FIELDS.index("partial")] >= 0
              and row[ITEM_FIELDS.index("request")] == request]
    begin, end = ITEM_FIELDS.index("kv_begin"), ITEM_FIELDS.index("kv_end")
    by_tile: dict[tuple[int, int], list[int]] = {}
    for i in pieces:
        row = items[i].tolist()
        by_tile.setdefault((row[ITEM_FIELDS.index("kv_head")], row[ITEM_FIELDS.index("row_begin")]), []).append(i)
    for group in by_tile.values():
        group.sort(key=lambda i: int(items[i, begin]))
        items[group[-2], end] = key
        items[group[-1], begin] = key


def poison_keys_before_windows(batch: PagedBatch, window: int | None) -> PagedBatch:
    """Sets the values of every key before the window of a request's first query to
    POISON: no row of that request sees them (later rows' windows start later), so a kernel
    that lets one through fails loudly, while one that loads them (tiles start on whole
    key chunks) and masks them passes."""
    if not window:
        return batch
    block_size = batch.k_cache.shape[1]
    cu = batch.cu_seqlens_q.tolist()
    for b, kv_len in enumerate(batch.seqlens_k.tolist()):
        first = kv_len - (cu[b + 1] - cu[b]) + 1 - window  # the first query's first key
        positions = torch.arange(0, max(first, 0), device=batch.v_cache.device)
        batch.v_cache[batch.block_tables[b, positions // block_size].long(), positions % block_size] = POISON
    return batch


@dataclass
class WindowCase:
    """A random hybrid batch with a sliding window, a soft cap and a scale (each may be off)."""

    lengths: list[tuple[int, int]]
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    window: int | None
    softcap: float | None
    scale: float | None


def random_window_case(seed: int, head_dims: tuple[int, ...] = (16, 32, 64, 80)) -> WindowCase:
    """Decodes and prefill chunks over prefixes up to 1500 keys; windows from 1 key to
    longer than any context, around the 64-key chunk size, and often shorter than a chunk
    of queries, so a tile's rows start their windows at different keys."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(rng.randint(2, 7)):
        kv = rng.randint(1, 1500)
        lengths.append((1 if rng.random() < 0.5 else rng.randint(1, min(kv, 150)), kv))
    if rng.random() < 0.2:  # full attention, in each of its spellings
        window = rng.choice([None, 0, 10 ** 6])
    else:
        window = rng.choice([rng.randint(1, 16), rng.randint(17, 200), rng.choice([63, 64, 65, 127, 128, 129]),
                             rng.randint(200, 2000)])
    return WindowCase(lengths, num_kv_heads=rng.choice([1, 2, 3]), group=rng.choice([1, 2, 4, 8]),
                      head_dim=rng.choice(head_dims), block_size=rng.choice([1, 16, 32]), window=window,
                      softcap=rng.choice([None, rng.uniform(1.0, 50.0)]),
                      scale=rng.choice([None, rng.uniform(0.02, 0.5)]))

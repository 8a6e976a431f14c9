"""Plain-PyTorch references of every op, written to be read. Tests compare the kernels
against these, usually in float64. Also the random paged batches that the attention tests
and benchmarks run on, and the gather + SDPA code a user would write without us."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """One request's [kv_len, num_kv_heads, head_dim] keys (or values) from its pages."""
    block_size = cache.shape[1]
    num_blocks = (kv_len + block_size - 1) // block_size
    pages = cache[block_table[:num_blocks].long()]
    return pages.reshape(-1, *cache.shape[2:])[:kv_len]


def hybrid_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seqlens_k: torch.Tensor, block_tables: torch.Tensor, *, scale: float | None = None,
                     window: int | None = None, softcap: float | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per request: gather its keys/values, bottom-right causal softmax attention, in `dtype`.
    window: each query sees only its own key and the window - 1 before it (None or 0: all);
    softcap: logits become softcap * tanh(logits / softcap) before the softmax."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b, kv_len in enumerate(seqlens_k.tolist()):
        qs = q[cu[b]:cu[b + 1]].to(dtype)  # [q_len, Hq, D]
        q_len = qs.shape[0]
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], kv_len).to(dtype).repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[b], kv_len).to(dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        key_pos = torch.arange(kv_len, device=q.device)[None, :]
        hidden = key_pos > query_pos
        if window:
            hidden |= key_pos <= query_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out


def sdpa_per_request(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seqlens_k: torch.Tensor, block_tables: torch.Tensor, *, scale: float | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """What a user would write without us, at q's dtype: per request, gather the pages,
    then torch's SDPA (GQA) with the bottom-right causal mask."""
    out = torch.empty_like(q) if out is None else out
    bounds = cu_seqlens_q.tolist()
    for b, kv_len in enumerate(seqlens_k.tolist()):
        q_len = bounds[b + 1] - bounds[b]
        if q_len == 0:
            continue
        k, v = (gather_kv(c, block_tables[b], kv_len).transpose(0, 1) for c in (k_cache, v_cache))
        mask = None if q_len == 1 else torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
        out[bounds[b]:bounds[b + 1]] = F.scaled_dot_product_attention(
            q[bounds[b]:bounds[b + 1]].transpose(0, 1), k, v, attn_mask=mask, scale=scale,
            enable_gqa=True).transpose(0, 1)
    return out


@dataclass
class PagedBatch:
    """The inputs of one hybrid_attention call."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    block_tables: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seqlens_k, self.block_tables


def random_paged_batch(lengths: list[tuple[int, int]], *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       block_size: int = 16, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       spare_blocks: int = 0, seed: int = 0) -> PagedBatch:
    """Random q and caches for requests of (q_len, kv_len), each request's pages scattered
    over a shuffled pool (plus `spare_blocks` nobody owns). Unused table columns are -1,
    so a kernel that reads past a request's pages fails loudly."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-kv // block_size) for _, kv in lengths]
    num_blocks = sum(pages) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.full((len(lengths), max(pages) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    cu = torch.tensor([0] + [q for q, _ in lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, generator=g).to(dtype)
    seqlens_k = torch.tensor([kv for _, kv in lengths], dtype=torch.int32)
    return PagedBatch(*(t.to(device) for t in (q, k_cache, v_cache, cu, seqlens_k, tables)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = x @ weight.T
    return out if bias is None else out + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x [+ residual]) * weight in x's dtype; with a residual also returns the sum."""
    h = x if residual is None else x + residual
    out = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * weight
    return out if residual is None else (out, h)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Neox-style rotation of each head's first rotary_dim features, in place:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with x1, x2 the two halves."""
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].to(q.dtype)[:, None, :].chunk(2, dim=-1)
    for x in (q, k):
        x1, x2 = x[..., :rotary_dim // 2].clone(), x[..., rotary_dim // 2:rotary_dim].clone()
        x[..., :rotary_dim // 2] = x1 * cos - x2 * sin
        x[..., rotary_dim // 2:rotary_dim] = x2 * cos + x1 * sin


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None = None) -> list[float]:
    """Rotary frequencies in float64, written from the definitions: base^(-2i/d), and for
    llama3 scaling: long wavelengths (> original context / low_freq_factor) slowed down by
    `factor`, short ones (< original context / high_freq_factor) kept, and the band in
    between interpolated linearly in original_context / wavelength."""
    freqs = [base ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)]
    kind = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind != "llama3":
        return freqs
    factor, low, high = rope_scaling["factor"], rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    context = rope_scaling["original_max_position_embeddings"]
    scaled = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < context / high:
            scaled.append(f)
        elif wavelen > context / low:
            scaled.append(f / factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * f / factor + smooth * f)
    return scaled


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    inv_freq = torch.tensor(rope_inv_freq(rotary_dim, base, rope_scaling), dtype=torch.float64)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)

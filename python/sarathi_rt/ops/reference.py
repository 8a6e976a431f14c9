"""Plain-PyTorch references of every op, written to be read. Tests compare the kernels
against these, usually in float64."""
from __future__ import annotations

import torch


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
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per request: gather its keys/values, bottom-right causal softmax attention, in `dtype`."""
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
        query_pos = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        key_pos = torch.arange(kv_len, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out

"""Paged-KV ops: write this step's keys/values into the cache, and hybrid-batch attention."""
from __future__ import annotations

import math
from typing import Any

import torch

from sarathi_rt import _C
from sarathi_rt.ops._checks import DTYPE_CODES, check_same, check_tensor, device_code, stream_of
from sarathi_rt.ops._registry import KERNELS, native_op
from sarathi_rt.ops.attention_plan import AttentionPlan, check_softcap, check_window, plan_attention

_FLOATS = tuple(DTYPE_CODES)
MAX_CPU_HEAD_DIM = 256
CUDA_HEAD_DIMS = (64, 128)
_CUDA_FLOATS = (torch.float16, torch.bfloat16)
# The CPU op's "plan this call yourself": an empty plan buffer.
_NO_PLAN = torch.empty(0, dtype=torch.int32)
_NO_CAPACITY = [0, 0, 0, 0, 0]


def _check_caches(k_cache: object, v_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=_FLOATS, contiguous=True)
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=_FLOATS, contiguous=True)
    check_same("v_cache", v, "k_cache", k, shape=True)
    return k, v


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, sync_check: bool = True) -> None:
    """Scatter key/value [num_tokens, num_kv_heads, head_dim] into the paged caches
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping (int64; slot =
    block * block_size + offset; a negative slot skips that token).

    A slot past the cache raises ValueError naming slot_mapping and writes nothing there.
    On CUDA that waits for the kernel; sync_check=False (for callers whose slots come
    from their own block tables) skips the wait, and a bad slot is then reported by the
    next write_kv call on that device instead."""
    k, v = _check_caches(k_cache, v_cache)
    check_tensor("key", key, ndim=3, dtypes=_FLOATS, last_dim_contiguous=True)
    check_tensor("value", value, ndim=3, dtypes=_FLOATS, last_dim_contiguous=True)
    check_same("key", key, "k_cache", k)
    check_same("value", value, "key", key, shape=True)
    if key.shape[1:] != k.shape[2:]:
        raise ValueError(f"key has {key.shape[1]} heads of dim {key.shape[2]} but k_cache holds "
                         f"{k.shape[2]} heads of dim {k.shape[3]}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), contiguous=True)
    if slot_mapping.device != key.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but key is on {key.device}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")
    torch.ops.sarathi_rt.write_kv(key, value, k, v, slot_mapping, sync_check)


def hybrid_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seqlens_k: torch.Tensor, block_tables: torch.Tensor, *, scale: float | None = None,
                     window: int | None = None, softcap: float | None = None, out: torch.Tensor | None = None,
                     plan: AttentionPlan | None = None) -> torch.Tensor:
    """Attention for a batch mixing prefill chunks and decodes, in one call.

    q [total_q, num_q_heads, head_dim] holds the requests back to back (cu_seqlens_q,
    int32 [batch+1]); seqlens_k (int32 [batch]) counts each request's tokens in the cache,
    this step's included; block_tables (int32 [batch, max_blocks]) maps positions to
    blocks. Query i of a request with q_len queries sees positions 0..kv_len - q_len + i.

    scale multiplies q.k (default head_dim ** -0.5; a model sets its own, e.g. Gemma's
    query_pre_attn_scalar ** -0.5). window: a sliding window of that many keys, the
    query's own included (Mistral, Gemma's local layers); None or 0 = full attention, and
    a window longer than the context is full attention too. softcap: logits become
    softcap * tanh(logits / softcap) before the softmax (Gemma 2); None = off. Both are
    per call, so each layer passes its own; a bad one is a ValueError naming it.

    plan: the step's `plan_attention(...)`, built once and reused by every layer, on CUDA
    (float16/bfloat16, head_dim 64 or 128, any block size) and on the CPU alike. When it
    is None the op plans this call itself (on CUDA that copies the index arrays to the
    host). A given plan must have been built for this batch, this device's kernel and this
    window.
    """
    k, v = _check_caches(k_cache, v_cache)
    check_tensor("q", q, ndim=3, dtypes=_FLOATS, last_dim_contiguous=True)
    check_same("q", q, "k_cache", k)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[2]
    if head_dim != k.shape[3]:
        raise ValueError(f"q has head_dim {head_dim} but k_cache has head_dim {k.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q has {num_q_heads} heads, not a multiple of k_cache's {num_kv_heads} KV heads")
    check_head_dim(head_dim, q.device)
    if q.device.type == "cuda":
        _check_cuda_inputs(q)
        for name, cache in (("k_cache", k), ("v_cache", v)):
            if cache.data_ptr() % 16 != 0:
                raise ValueError(f"{name} must be 16-byte aligned on CUDA")
    for name, t, ndim in (("cu_seqlens_q", cu_seqlens_q, 1), ("seqlens_k", seqlens_k, 1),
                          ("block_tables", block_tables, 2)):
        check_tensor(name, t, ndim=ndim, dtypes=(torch.int32,), contiguous=True)
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    batch = seqlens_k.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_q must have batch + 1 = {batch + 1} entries, got {cu_seqlens_q.shape[0]}")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have {batch} rows (one per request), got {block_tables.shape[0]}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, ndim=3, last_dim_contiguous=True)
        check_same("out", out, "q", q, shape=True)
        if out.dtype != q.dtype:
            raise TypeError(f"out has dtype {out.dtype} but q has dtype {q.dtype}")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")
    window, softcap = check_window(window), check_softcap(softcap)
    if q.device.type == "cuda":
        _check_aligned("out", out)
        if plan is None:
            plan = plan_attention(cu_seqlens_q, seqlens_k, block_tables, k, num_q_heads, window=window)
    if plan is not None:
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
        plan.check_matches(q, k, seqlens_k, block_tables, window)
        run_attention(plan, q, k, v, cu_seqlens_q, seqlens_k, block_tables, scale, out, window=window,
                      softcap=softcap, kernels=torch.ops.sarathi_rt)
    else:
        torch.ops.sarathi_rt.hybrid_attention_out(q, k, v, cu_seqlens_q, seqlens_k, block_tables, _NO_PLAN,
                                                  _NO_CAPACITY, scale, out, window, softcap)
    return out


def run_attention(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, block_tables: torch.Tensor, scale: float,
                  out: torch.Tensor, *, window: int = 0, softcap: float = 0.0, kernels: Any = KERNELS) -> None:
    """The per-layer launch of a planned step (flashinfer's run after plan): it trusts
    that the step's tensors were checked when `plan` was built for them. It checks only
    what differs per layer: that the plan was made for this layer's `window` (int, 0 =
    full attention; a plan for another window would read the wrong keys). softcap is a
    float, 0.0 = off. `hybrid_attention` is the checked entry point; it launches through
    the dispatcher (kernels=torch.ops.sarathi_rt), the model's layers without it."""
    if window != plan.window:
        raise ValueError(f"plan was built for window {plan.window} but this call has {window} (0 = full attention); "
                         f"plan each window separately")
    if plan.kernel == "cuda":
        kernels.hybrid_attention_planned_out(q, k_cache, v_cache, block_tables, plan.buffer, plan.partial_out,
                                             plan.partial_lse, plan.capacity.as_list(), scale, out, window, softcap)
    else:
        kernels.hybrid_attention_out(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_tables, plan.buffer,
                                     plan.capacity.as_list(), scale, out, window, softcap)


def _check_aligned(name: str, t: torch.Tensor) -> None:
    # The CUDA kernel moves 16-byte vectors of q and 4-byte pairs of out.
    if t.data_ptr() % 16 != 0 or t.stride(0) % 8 != 0 or t.stride(1) % 8 != 0:
        raise ValueError(f"{name} must be 16-byte aligned with token and head strides that are multiples of 8 "
                         f"elements on CUDA, got strides {t.stride()}")


def check_head_dim(head_dim: int, device: torch.device | str) -> None:
    """Raise ValueError unless the attention kernel on `device` takes `head_dim`; a
    model checks this when it is built, so a config the kernel cannot run fails before
    any weight is read."""
    kind = torch.device(device).type
    if kind == "cpu" and head_dim > MAX_CPU_HEAD_DIM:
        raise ValueError(f"Unsupported head_dim: {head_dim} (the CPU kernel takes up to {MAX_CPU_HEAD_DIM})")
    if kind == "cuda" and head_dim not in CUDA_HEAD_DIMS:
        raise ValueError(f"Unsupported head_dim: {head_dim} (the CUDA kernel supports {CUDA_HEAD_DIMS})")


def _check_cuda_inputs(q: torch.Tensor) -> None:
    if q.dtype not in _CUDA_FLOATS:
        raise TypeError(f"q must have dtype float16 or bfloat16 on CUDA, got {str(q.dtype).removeprefix('torch.')}")
    _check_aligned("q", q)


@native_op("write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, sync_check: bool = True) -> None:
    _C.write_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
                key.shape[0], key.stride()[:2], value.stride()[:2], tuple(k_cache.shape), DTYPE_CODES[key.dtype],
                device_code(key), stream_of(key), sync_check)


@native_op("hybrid_attention_out", mutates_args=("out",))
def _hybrid_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         seqlens_k: torch.Tensor, block_tables: torch.Tensor, plan_buffer: torch.Tensor,
                         capacity: list[int], scale: float, out: torch.Tensor, window: int = 0,
                         softcap: float = 0.0) -> None:
    _C.hybrid_attention(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cu_seqlens_q.data_ptr(),
                        seqlens_k.data_ptr(), block_tables.data_ptr(), seqlens_k.shape[0], q.shape[0], q.shape[1],
                        block_tables.shape[1], q.stride()[:2], out.stride()[:2], tuple(k_cache.shape), scale,
                        window, softcap, DTYPE_CODES[q.dtype], device_code(q), stream_of(q),
                        plan_buffer.data_ptr() if plan_buffer.numel() else 0, capacity)


@native_op("hybrid_attention_planned_out", mutates_args=("partial_out", "partial_lse", "out"))
def _hybrid_attention_planned_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, plan_buffer: torch.Tensor, partial_out: torch.Tensor,
                                 partial_lse: torch.Tensor, capacity: list[int], scale: float, out: torch.Tensor,
                                 window: int = 0, softcap: float = 0.0) -> None:
    _C.hybrid_attention_planned(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                block_tables.data_ptr(), q.shape[1], block_tables.shape[1], q.stride()[:2],
                                out.stride()[:2], tuple(k_cache.shape), scale, window, softcap, DTYPE_CODES[q.dtype],
                                device_code(q), stream_of(q), plan_buffer.data_ptr(), capacity,
                                partial_out.data_ptr(), partial_lse.data_ptr())


"""Fused elementwise ops of a LLaMA layer: RMSNorm (+ residual add), rotary embedding in
place (neox style), SiLU-and-multiply. Float32 math on float32/float16/bfloat16 storage.
And one row reduction, the greedy sampler's argmax."""
from __future__ import annotations

import math

import torch

from sarathi_rt import _C
from sarathi_rt.utils.checks import positive_int
from sarathi_rt.utils.dtypes import DTypeLike, parse_dtype
from sarathi_rt.ops._checks import DTYPE_CODES, check_same, check_tensor, device_code, stream_of
from sarathi_rt.ops._registry import native_op

_FLOATS = tuple(DTYPE_CODES)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm of x [..., H]: normalize in float32, cast to x.dtype, times weight [H].

    With `residual`, the residual add is fused: returns (rms_norm(x + residual) * weight,
    x + residual), the second value being the next layer's residual.
    """
    check_tensor("x", x, dtypes=_FLOATS, last_dim_contiguous=True)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (the hidden size), got a scalar")
    hidden = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=_FLOATS, contiguous=True)
    check_same("weight", weight, "x", x)
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} entries but x has hidden size {hidden}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if hidden == 0:
        raise ValueError("x must have a non-zero hidden size (its last dimension)")
    rows = x.reshape(-1, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        torch.ops.sarathi_rt.rms_norm_out(rows, None, weight, float(eps), out.view(-1, hidden), None)
        return out
    check_tensor("residual", residual, dtypes=_FLOATS, last_dim_contiguous=True)
    check_same("residual", residual, "x", x, shape=True)
    new_residual = torch.empty_like(out)
    torch.ops.sarathi_rt.rms_norm_out(rows, residual.reshape(-1, hidden), weight, float(eps),
                                      out.view(-1, hidden), new_residual.view(-1, hidden))
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] -> silu(x[..., :I]) * x[..., I:], the gated MLP's activation."""
    check_tensor("x", x, dtypes=_FLOATS, last_dim_contiguous=True)
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x's last dimension must be a positive even size (gate and up halves), "
                         f"got shape {tuple(x.shape)}")
    intermediate = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], intermediate, dtype=x.dtype, device=x.device)
    torch.ops.sarathi_rt.silu_and_mul_out(x.reshape(-1, 2 * intermediate), out.view(-1, intermediate))
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [R]: per row of x [R, N], the first index of its largest value, a NaN counting
    as the largest (torch.argmax(x, dim=1), to the index). On the CPU our vectorized kernel
    (torch's reads a row one element at a time: 24 us for 64 rows of 512 float32 logits on
    one core, 3% of a tiny decode step); elsewhere torch's own. Not a dispatcher op: it runs
    outside any compiled or captured region (the sampler)."""
    check_tensor("x", x, ndim=2, dtypes=_FLOATS, last_dim_contiguous=True)
    if x.shape[1] == 0:
        raise ValueError(f"x's rows must hold at least one value, got shape {tuple(x.shape)}")
    if x.device.type != "cpu":
        return x.argmax(dim=1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _C.argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0), DTYPE_CODES[x.dtype])
    return out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by their tokens' positions (neox style).

    q and k may be strided views of one fused qkv buffer (last dim contiguous). The
    first rotary_dim = cos_sin_cache.shape[1] features of every head are rotated;
    cos_sin_cache is float32 [max_position, rotary_dim] = cat(cos, sin), as made by
    `rope_cos_sin_cache`. positions (int64 [T]) must lie in [0, max_position).
    """
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,), contiguous=True)
    check_tensor("q", q, ndim=3, dtypes=_FLOATS, last_dim_contiguous=True)
    check_tensor("k", k, ndim=3, dtypes=_FLOATS, last_dim_contiguous=True)
    check_same("k", k, "q", q)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,), contiguous=True)
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    num_tokens, head_dim = q.shape[0], q.shape[2]
    if k.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError(f"q, k and positions must have the same number of tokens, got {num_tokens}, "
                         f"{k.shape[0]} and {positions.shape[0]}")
    if k.data_ptr() == q.data_ptr():
        raise ValueError("q and k must be different tensors (the same one would be rotated twice)")
    if k.shape[2] != head_dim:
        raise ValueError(f"k has head_dim {k.shape[2]} but q has head_dim {head_dim}")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim == 0 or rotary_dim % 2 != 0 or rotary_dim > head_dim:
        raise ValueError(f"cos_sin_cache's rotary_dim (dim 1) must be even and in [2, head_dim={head_dim}], "
                         f"got {rotary_dim}")
    if num_tokens == 0:
        return
    # The CPU kernel checks positions itself; on CUDA that would need a sync, which is
    # not allowed while a CUDA graph is captured (the kernel then leaves such rows as is).
    if q.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        lo, hi = torch.aminmax(positions)
        if int(lo) < 0 or int(hi) >= cos_sin_cache.shape[0]:
            raise ValueError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) covered by cos_sin_cache, "
                             f"got values from {int(lo)} to {int(hi)}")
    torch.ops.sarathi_rt.rotary_embedding(positions, q, k, cos_sin_cache)


def _rope_scaling_type(rope_scaling: dict | None) -> str:
    if rope_scaling is None:
        return "default"
    if not isinstance(rope_scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind not in ("default", "llama3", "linear"):
        raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} (supported: 'default', 'llama3', 'linear')")
    return kind


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling, op for op as transformers computes it (so float32
    results match to the bit)."""
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for key in keys:
        value = rope_scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_scaling['{key}'] must be a positive number, got {value!r}")
    factor, low, high, old_context = (rope_scaling[key] for key in keys)
    if high <= low:
        raise ValueError(f"rope_scaling['high_freq_factor'] ({high}) must exceed low_freq_factor ({low})")
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                       dtype: DTypeLike = torch.float32) -> torch.Tensor:
    """[max_position, rotary_dim] = cat(cos, sin) of position * inv_freq, for `rotary_embedding`.

    rope_scaling: None, {"rope_type" (or "type"): "default"}, {"rope_type": "llama3",
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    or {"rope_type": "linear", "factor"} (positions divided by factor).
    In float32 every value equals transformers' LlamaRotaryEmbedding cos/sin; float64
    gives a more exact cache for references.
    """
    positive_int("rotary_dim", rotary_dim)
    positive_int("max_position", max_position)
    if rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0 or not math.isfinite(base):
        raise ValueError(f"base must be a positive finite number, got {base!r}")
    dtype = parse_dtype(dtype, allowed=(torch.float32, torch.float64))  # float32: the kernels' cache
    kind = _rope_scaling_type(rope_scaling)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype) / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif kind == "linear":
        factor = rope_scaling.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"rope_scaling['factor'] must be a positive number, got {factor!r}")
        inv_freq = inv_freq / factor  # as transformers scales it: the frequencies, not the positions
    freqs = torch.arange(max_position, dtype=torch.int64).to(dtype)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


@native_op("rms_norm_out", mutates_args=("out", "residual_out"))
def _rms_norm_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor, residual_out: torch.Tensor | None) -> None:
    has_res = residual is not None and residual_out is not None
    _C.rms_norm(x.data_ptr(), residual.data_ptr() if has_res else 0, weight.data_ptr(), out.data_ptr(),
                residual_out.data_ptr() if has_res else 0, x.shape[0], x.shape[1],
                (x.stride(0), residual.stride(0) if has_res else 0, out.stride(0),
                 residual_out.stride(0) if has_res else 0),
                eps, DTYPE_CODES[x.dtype], device_code(x), stream_of(x))


@native_op("silu_and_mul_out", mutates_args=("out",))
def _silu_and_mul_op(x: torch.Tensor, out: torch.Tensor) -> None:
    _C.silu_and_mul(x.data_ptr(), out.data_ptr(), x.shape[0], out.shape[1], x.stride(0), out.stride(0),
                    DTYPE_CODES[x.dtype], device_code(x), stream_of(x))


@native_op("rotary_embedding", mutates_args=("q", "k"))
def _rotary_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    _C.rotary_embedding(positions.data_ptr(), q.data_ptr(), k.data_ptr(), cos_sin_cache.data_ptr(), q.shape[0],
                        q.shape[1], k.shape[1], q.shape[2], cos_sin_cache.shape[1], cos_sin_cache.shape[0],
                        q.stride()[:2], k.stride()[:2], DTYPE_CODES[q.dtype], device_code(q), stream_of(q))


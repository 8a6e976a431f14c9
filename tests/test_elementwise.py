from __future__ import annotations

import pytest
import torch

from sarathi_rt import ops
from sarathi_rt.ops import reference

from conftest import requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Two roundings to the storage dtype (as HF's RMSNorm does) are allowed on top of float32 math.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _randn(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=RTOL[dtype], atol=RTOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 17, 577])
def test_rms_norm_matches_float64_reference(device: str, dtype: torch.dtype, num_tokens: int) -> None:
    x = _randn(num_tokens, 512, dtype=dtype, device=device)
    w = (1 + 0.1 * _randn(512, seed=1)).to(dtype).to(device)
    out = ops.rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    _close(out, reference.rms_norm(x.double(), w.double(), 1e-5), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual_add(device: str, dtype: torch.dtype) -> None:
    x = _randn(37, 256, dtype=dtype, device=device)
    res = _randn(37, 256, dtype=dtype, device=device, seed=2)
    w = _randn(256, dtype=dtype, device=device, seed=3)
    out, new_res = ops.rms_norm(x, w, 1e-6, residual=res)
    # The new residual is the sum rounded once to the storage dtype, exactly as torch adds.
    assert torch.equal(new_res, x + res)
    ref_out, _ = reference.rms_norm(x.double(), w.double(), 1e-6, residual=res.double())
    _close(out, ref_out, dtype)
    assert torch.equal(out, ops.rms_norm(x + res, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf_llama_rms_norm(dtype: torch.dtype) -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = llama.LlamaRMSNorm(384, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _randn(384, seed=4))
    norm = norm.to(dtype)
    x = _randn(50, 384, dtype=dtype, seed=5)
    with torch.no_grad():
        expected = norm(x)
    # Same rounding steps as HF: at most one storage-dtype ulp apart (summation order).
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(ops.rms_norm(x, norm.weight.detach(), 1e-5), expected, rtol=2 * ulp, atol=2 * ulp)


def test_rms_norm_takes_row_strided_and_batched_inputs() -> None:
    buf = _randn(9, 2, 64)
    x = buf[:, 1]  # rows 128 apart
    w = _randn(64, seed=6)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ops.rms_norm(x.contiguous(), w, 1e-6))
    batched = _randn(2, 5, 64)
    assert torch.equal(ops.rms_norm(batched, w, 1e-6).view(10, 64), ops.rms_norm(batched.view(10, 64), w, 1e-6))
    assert ops.rms_norm(torch.empty(0, 64), w, 1e-6).shape == (0, 64)


def test_rms_norm_bad_inputs_name_the_argument() -> None:
    x, w = _randn(4, 64), _randn(64)
    with pytest.raises(ValueError, match="weight has 32 entries"):
        ops.rms_norm(x, w[:32], 1e-6)
    with pytest.raises(TypeError, match="weight has dtype"):
        ops.rms_norm(x, w.half(), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="residual has shape"):
        ops.rms_norm(x, w, 1e-6, residual=x[:2])
    with pytest.raises(TypeError, match="x must have dtype"):
        ops.rms_norm(x.int(), w, 1e-6)
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        ops.rms_norm(_randn(64, 4).T, w, 1e-6)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        ops.rms_norm(x, w, 1e-6, residual=[1.0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (37, 2 * 96), (3, 5, 2 * 64)])
def test_silu_and_mul_matches_float64_reference(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = _randn(*shape, dtype=dtype, device=device)
    out = ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    _close(out, reference.silu_and_mul(x.double()), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_and_mul_rounds_once_to_nearest_even_on_cpu(dtype: torch.dtype) -> None:
    # Computed in float32 from exactly the same inputs, then rounded once: the half-precision
    # result must be torch's round-to-nearest-even of the float32 one, bit for bit, in full
    # and partial vectors (37 lanes), infinities included; NaN stays NaN (torch and we may
    # pick different NaN payloads).
    x = (_randn(5, 2 * 37) * 40).to(dtype)
    x[0, 0], x[1, 3], x[2, 5], x[3, 37 + 2] = float("inf"), float("-inf"), float("nan"), float("nan")
    out = ops.silu_and_mul(x)
    expected = ops.silu_and_mul(x.float()).to(dtype)
    nan = expected.isnan()
    assert nan.sum() == 3 and torch.equal(out.isnan(), nan)  # silu(-inf) * up is NaN too
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert out.isinf().any()


def test_silu_and_mul_strided_rows_and_bad_inputs() -> None:
    buf = _randn(6, 3, 40)
    assert torch.equal(ops.silu_and_mul(buf[:, 0]), ops.silu_and_mul(buf[:, 0].contiguous()))
    with pytest.raises(ValueError, match="positive even size"):
        ops.silu_and_mul(_randn(4, 7))
    with pytest.raises(TypeError, match="x must have dtype"):
        ops.silu_and_mul(torch.ones(4, 8, dtype=torch.int32))


def _qkv(num_tokens: int, hq: int, hkv: int, head_dim: int, dtype: torch.dtype, device: str):
    """q and k as strided views of one fused qkv buffer, as the model produces them."""
    qkv = _randn(num_tokens, hq + 2 * hkv, head_dim, dtype=dtype, device=device, seed=7)
    return qkv, qkv[:, :hq], qkv[:, hq:hq + hkv]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_embedding_matches_float64_reference(device: str, dtype: torch.dtype, rotary_dim: int) -> None:
    qkv, q, k = _qkv(37, 8, 2, 64, dtype, device)
    before = qkv.clone()
    cache = ops.rope_cos_sin_cache(rotary_dim, 4096, 500000.0, LLAMA3_SCALING).to(device)
    positions = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(8)).to(device)
    q_ref, k_ref = q.double(), k.double()
    reference.rotary_embedding(positions, q_ref, k_ref, cache.double())
    ops.rotary_embedding(positions, q, k, cache)
    _close(q, q_ref, dtype)
    _close(k, k_ref, dtype)
    assert torch.equal(qkv[:, 10:], before[:, 10:])  # v untouched
    assert torch.equal(qkv[..., rotary_dim:], before[..., rotary_dim:])  # features past rotary_dim untouched
    assert not torch.equal(qkv[:, :10, :rotary_dim], before[:, :10, :rotary_dim])


def test_rotary_embedding_matches_hf_apply_rotary_pos_emb() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=16384,
                               rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING})
    positions = torch.tensor([0, 1, 5, 100, 8191, 16000])
    _, q, k = _qkv(6, 4, 2, 64, torch.float32, "cpu")
    cos, sin = llama.LlamaRotaryEmbedding(config)(q, positions[None])
    q_hf, k_hf = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ops.rotary_embedding(positions, q, k, ops.rope_cos_sin_cache(64, 16384, 500000.0, LLAMA3_SCALING))
    torch.testing.assert_close(q, q_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, k_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, LLAMA3_SCALING,
                                     {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_cache_equals_transformers_bit_for_bit(scaling: dict | None) -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    params = {"rope_theta": 500000.0, **(scaling or {"rope_type": "default"})}
    params["rope_type"] = params.pop("type", params.get("rope_type"))
    config = llama.LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=16384,
                               rope_parameters=params)
    positions = torch.arange(0, 16384, 7)
    cos, sin = llama.LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cache = ops.rope_cos_sin_cache(128, 16384, 500000.0, scaling)
    cos_ours, sin_ours = cache[positions].chunk(2, dim=-1)
    assert torch.equal(cos[0], torch.cat((cos_ours, cos_ours), dim=-1))
    assert torch.equal(sin[0], torch.cat((sin_ours, sin_ours), dim=-1))


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_rope_cache_matches_float64_formula(scaling: dict | None) -> None:
    expected = reference.rope_cos_sin_cache(128, 2048, 500000.0, scaling)
    # Rounding the angle p * f to float32 costs up to p * ulp: 2048 * 6e-8 ~ 1.2e-4.
    torch.testing.assert_close(ops.rope_cos_sin_cache(128, 2048, 500000.0, scaling).double(), expected,
                               rtol=0, atol=2e-4)
    torch.testing.assert_close(ops.rope_cos_sin_cache(128, 2048, 500000.0, scaling, dtype=torch.float64),
                               expected, rtol=0, atol=1e-9)
    if scaling is not None:  # the scaling really changed the low frequencies
        assert not torch.allclose(expected, reference.rope_cos_sin_cache(128, 2048, 500000.0))


def test_rope_cache_bad_inputs_name_the_argument() -> None:
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        ops.rope_cos_sin_cache(63, 16, 10000.0)
    with pytest.raises(ValueError, match="max_position"):
        ops.rope_cos_sin_cache(64, 0, 10000.0)
    with pytest.raises(ValueError, match="base"):
        ops.rope_cos_sin_cache(64, 16, -1.0)
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        ops.rope_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match=r"rope_scaling\['low_freq_factor'\]"):
        ops.rope_cos_sin_cache(64, 16, 10000.0, {**LLAMA3_SCALING, "low_freq_factor": None})
    with pytest.raises(ValueError, match="high_freq_factor"):
        ops.rope_cos_sin_cache(64, 16, 10000.0, {**LLAMA3_SCALING, "high_freq_factor": 0.5})
    with pytest.raises(TypeError, match="dtype"):
        ops.rope_cos_sin_cache(64, 16, 10000.0, dtype=torch.float16)


def test_rotary_embedding_bad_inputs_name_the_argument() -> None:
    _, q, k = _qkv(5, 4, 2, 64, torch.float32, "cpu")
    cache = ops.rope_cos_sin_cache(64, 32, 10000.0)
    pos = torch.arange(5)
    with pytest.raises(ValueError, match=r"positions\[2\] = 40 is outside \[0, 32\)"):
        ops.rotary_embedding(torch.tensor([0, 1, 40, 2, 3]), q, k, cache)
    with pytest.raises(TypeError, match="positions must have dtype int64"):
        ops.rotary_embedding(pos.int(), q, k, cache)
    with pytest.raises(TypeError, match="cos_sin_cache must have dtype float32"):
        ops.rotary_embedding(pos, q, k, cache.double())
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.rotary_embedding(pos, q, k, ops.rope_cos_sin_cache(128, 32, 10000.0))
    with pytest.raises(ValueError, match="same number of tokens"):
        ops.rotary_embedding(pos[:3], q, k, cache)
    with pytest.raises(TypeError, match="k has dtype"):
        ops.rotary_embedding(pos, q, k.half(), cache)
    with pytest.raises(ValueError, match="q and k must be different"):
        ops.rotary_embedding(pos, q, q, cache)
    with pytest.raises(ValueError, match="k must be contiguous in its last dimension"):
        ops.rotary_embedding(pos, q, k.transpose(1, 2), cache)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_float64_reference(device: str, dtype: torch.dtype) -> None:
    x = _randn(3, 17, 256, dtype=dtype, device=device)
    w = (_randn(96, 256, dtype=dtype, device=device, seed=9) / 16)
    b = _randn(96, dtype=dtype, device=device, seed=10)
    _close(ops.linear(x, w), reference.linear(x.double(), w.double()), dtype)
    _close(ops.linear(x, w, b), reference.linear(x.double(), w.double(), b.double()), dtype)


def test_linear_bad_inputs_name_the_argument() -> None:
    x, w = _randn(4, 32), _randn(8, 32)
    with pytest.raises(ValueError, match="in_features 32"):
        ops.linear(_randn(4, 16), w)
    with pytest.raises(ValueError, match="bias has 3 entries"):
        ops.linear(x, w, _randn(3))
    with pytest.raises(TypeError, match="weight has dtype"):
        ops.linear(x, w.half())
    with pytest.raises(ValueError, match="weight must have 2 dimensions"):
        ops.linear(x, w[None])


def test_argmax_rows_takes_strided_rows_and_names_bad_inputs() -> None:
    x = _randn(6, 300)
    assert torch.equal(ops.argmax_rows(x[::2, 5:]), x[::2, 5:].argmax(dim=1))  # rows apart, starting inside
    assert ops.argmax_rows(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        ops.argmax_rows(x[0])
    with pytest.raises(TypeError, match="x must have dtype"):
        ops.argmax_rows(x.to(torch.int32))
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        ops.argmax_rows(x.T)
    with pytest.raises(ValueError, match="x's rows must hold at least one value"):
        ops.argmax_rows(x[:, :0])


@requires_cuda
def test_argmax_rows_on_cuda_is_torchs() -> None:
    x = _randn(4, 1000, device="cuda")
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=1))

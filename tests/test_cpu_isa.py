"""The CPU kernels at every ISA level this CPU runs (base, avx2, avx512, avx512_bf16), each
against the float64 reference, and SARATHI_RT_CPU_ISA, the switch that makes a CPU behave as
a lower level (the dtype rule's flags and the kernels' code): values, errors, and a
subprocess that runs under it."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from sarathi_rt import _C, ops
from sarathi_rt.ops import reference
from sarathi_rt.utils.cpu import ISA_ENV, ISA_LEVELS, cpu_flags, isa_level, level_flags, missing_bf16, native_isa

from attention_batches import make_batch
from conftest import ATOL

KERNEL_LEVELS = ["base", "avx2", "avx512", "avx512_bf16"]
RUNNABLE = KERNEL_LEVELS[:KERNEL_LEVELS.index(_C.cpu_isa_native()) + 1]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
AVX512_BF16_HOST = {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd",
                    "avx512_bf16"}
AVX2_HOST = {"avx2", "fma", "f16c", "bmi2", "sse4_2"}


@pytest.fixture(params=RUNNABLE)
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernels run at this level for the test, then at the level they ran before."""
    before = _C.cpu_isa()
    _C.set_cpu_isa(request.param)
    assert _C.cpu_isa() == request.param
    yield request.param
    _C.set_cpu_isa(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 16, 1), (4, 40, 16), (8, 64, 16), (3, 128, 32)])
def test_attention_matches_float64_at_every_level(level: str, dtype: torch.dtype, group: int, head_dim: int,
                                                  block_size: int) -> None:
    batch = make_batch([(1, 17), (37, 37), (17, 577), (1, 577), (1, 1), (64, 300), (1, 2001)], num_kv_heads=2,
                       group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, seed=len(level))
    out, ref = batch.run(), batch.reference()
    torch_err = (batch.plain_torch().double() - ref).abs().max().item()
    slack = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert (out.double() - ref).abs().max().item() <= 2 * torch_err + slack


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [40, 72])
def test_split_decodes_merge_at_every_level(level: str, dtype: torch.dtype, head_dim: int) -> None:
    # head_dim 40 and 72 leave a tail in every vector width (4, 8, 16 floats) in the q load,
    # the output store and the merge of the pieces.
    batch = make_batch([(1, 3001), (1, 2500), (3, 40)], num_kv_heads=1, group=3, head_dim=head_dim, dtype=dtype,
                       seed=head_dim)
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 3)
    assert plan.num_merges > 0, "the plan should split the long decodes"
    out, ref = batch.run(plan=plan), batch.reference()
    torch_err = (batch.plain_torch().double() - ref).abs().max().item()
    slack = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert (out.double() - ref).abs().max().item() <= 2 * torch_err + slack


# (tokens, hidden) drawn at random per seed: hidden sizes below, at and past each vector
# width, most of them not a multiple of any.
RAGGED_ROWS = [(1 + (seed * 7) % 13, [1, 3, 5, 12, 17, 33, 100, 577, 1031][seed]) for seed in range(9)]
# Two roundings to the storage dtype (HF's RMSNorm makes them) on top of float32 math.
TWO_ROUNDINGS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", RAGGED_ROWS)
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_matches_float64_at_every_level(level: str, dtype: torch.dtype, tokens: int, hidden: int,
                                                 fused: bool) -> None:
    g = torch.Generator().manual_seed(tokens * hidden)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    tol = TWO_ROUNDINGS[dtype]
    if fused:
        out, new_res = ops.rms_norm(x, w, 1e-5, residual=res)
        assert torch.equal(new_res, x + res)  # the sum rounded once, as torch adds in the storage dtype
        ref, _ = reference.rms_norm(x.double(), w.double(), 1e-5, residual=res.double())
    else:
        out = ops.rms_norm(x, w, 1e-5)
        ref = reference.rms_norm(x.double(), w.double(), 1e-5)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # A row's result does not depend on the rows beside it.
    assert torch.equal(ops.rms_norm(x[-1:], w, 1e-5), ops.rms_norm(x, w, 1e-5)[-1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(8, 6), (40, 34), (64, 64), (80, 40), (128, 128)])
def test_rotary_matches_float64_at_every_level(level: str, dtype: torch.dtype, head_dim: int, rotary_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim + rotary_dim)
    tokens, hq, hkv = 11, 5, 2
    qkv = torch.randn(tokens, hq + 2 * hkv, head_dim, generator=g).to(dtype)  # q and k: views of one buffer
    before = qkv.clone()
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
    cache = ops.rope_cos_sin_cache(rotary_dim, 2048, 10000.0)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    q_ref, k_ref = q.double(), k.double()
    reference.rotary_embedding(positions, q_ref, k_ref, cache.double())
    ops.rotary_embedding(positions, q, k, cache)
    tol = TWO_ROUNDINGS[dtype] / 2  # one rounding
    torch.testing.assert_close(q.double(), q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k.double(), k_ref, rtol=tol, atol=tol)
    assert torch.equal(qkv[..., rotary_dim:], before[..., rotary_dim:])  # features past rotary_dim untouched
    assert torch.equal(qkv[:, hq + hkv:], before[:, hq + hkv:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(1, 3), (2, 17), (3, 40), (4, 64), (2, 129)])
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_write_kv_matches_reference_at_every_level(level: str, dtype: torch.dtype, heads: int, head_dim: int,
                                                   fused_qkv: bool) -> None:
    g = torch.Generator().manual_seed(heads * head_dim)
    tokens, block_size, blocks = 23, 4, 8
    if fused_qkv:  # heads side by side (one copy per token), tokens strided
        buf = torch.randn(tokens, 3 * heads, head_dim, generator=g).to(dtype)
        key, value = buf[:, heads:2 * heads], buf[:, 2 * heads:]
    else:  # each head its own row, two rows apart
        buf = torch.randn(tokens, heads, 2, head_dim, generator=g).to(dtype)
        key, value = buf[:, :, 0], buf[:, :, 1]
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    slots[::4] = -1  # padding tokens are skipped
    k, v, k_ref, v_ref = (torch.full((blocks, block_size, heads, head_dim), 7.0, dtype=dtype) for _ in range(4))
    ops.write_kv(key, value, k, v, slots)
    reference.write_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert (k == 7.0).any()  # slots nobody owns keep what they held


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", [(1, 1), (3, 15), (2, 16), (5, 17), (64, 100), (7, 1000)])
def test_silu_and_mul_matches_float64_at_every_level(level: str, dtype: torch.dtype, tokens: int,
                                                     intermediate: int) -> None:
    g = torch.Generator().manual_seed(tokens * intermediate)
    x = (torch.randn(tokens, 2 * intermediate, generator=g) * 4).to(dtype)
    x[0, 0] = -100.0  # sigmoid underflows; silu is -0, not NaN
    out = ops.silu_and_mul(x)
    ref = reference.silu_and_mul(x.double())
    assert out.dtype == dtype and out.shape == (tokens, intermediate)
    # One rounding to the storage dtype, relative to the values' size.
    assert torch.allclose(out.double(), ref, rtol=ATOL[dtype] * 2, atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 7, 37), (5, 9, 16), (16, 33, 100), (3, 4, 512), (9, 129, 48)])
def test_streamed_gemm_matches_float64_at_every_level(level: str, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    x = (torch.randn(m, k, generator=g) / k ** 0.5).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    torch.ops.sarathi_rt.linear_out(x, w, b, out, 0, 1, torch.empty(0, dtype=torch.uint8))
    ref = x.double() @ w.double().T + b.double()
    torch_err = (torch.nn.functional.linear(x.float(), w.float(), b.float()).to(dtype).double() - ref).abs().max()
    assert (out.double() - ref).abs().max().item() <= 2 * torch_err.item() + ATOL[dtype]


# Values that tie, the infinities, both zeros and NaN: the cases where "the first index of
# the largest value" is decided by the rule, not by the values.
ARGMAX_PALETTE = [-float("inf"), -1.0, -0.0, 0.0, 1.0, 2.0, float("inf"), float("nan")]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_agrees_with_torch_at_every_level(level: str, dtype: torch.dtype) -> None:
    """Rows of every width around the kernel's vectors (8 lanes, four at a time), drawn from
    a few values so that ties and NaN land in every lane, vector and the tail; and rows of
    normal logits up to a real vocabulary. The index must be torch.argmax's."""
    g = torch.Generator().manual_seed(7)
    palette = torch.tensor(ARGMAX_PALETTE)
    for case in range(300):
        width = int(torch.randint(1, 140, (), generator=g))
        kinds = int(torch.randint(1, len(ARGMAX_PALETTE) + 1, (), generator=g))
        values = palette[torch.randperm(len(ARGMAX_PALETTE), generator=g)[:kinds]]
        x = values[torch.randint(0, kinds, (3, width), generator=g)].to(dtype)
        assert torch.equal(ops.argmax_rows(x), x.argmax(dim=1)), (case, x)
    for rows, width in [(1, 1), (64, 512), (5, 32000), (3, 49153)]:
        x = torch.randn(rows, width, generator=g).to(dtype)
        assert torch.equal(ops.argmax_rows(x), x.argmax(dim=1))
        x[:, width // 3] = float("nan")  # one NaN wins wherever it is
        assert torch.equal(ops.argmax_rows(x), torch.full((rows,), width // 3))


def test_levels_are_ordered_and_read_from_the_flags() -> None:
    assert list(ISA_LEVELS)[:4] == KERNEL_LEVELS
    assert native_isa(set()) == "base" and native_isa(AVX2_HOST) == "avx2"
    assert native_isa(AVX512_BF16_HOST) == "avx512_bf16"
    assert native_isa(AVX512_BF16_HOST | {"amx_bf16", "amx_tile"}) == "amx"
    assert native_isa({"avx2", "avx512f", "avx512_bf16"}) == "base"  # a level needs every flag below it
    assert _C.cpu_isa_native() in KERNEL_LEVELS


def test_the_switch_lowers_the_flags_the_dtype_rule_reads() -> None:
    assert isa_level(AVX512_BF16_HOST, {}) == "avx512_bf16"
    assert isa_level(AVX512_BF16_HOST, {ISA_ENV: " AVX2 "}) == "avx2"
    assert missing_bf16(level_flags(AVX512_BF16_HOST, "avx512")) != ()
    assert missing_bf16(level_flags(AVX512_BF16_HOST, "avx512_bf16")) == ()
    assert level_flags(AVX512_BF16_HOST, "avx2") == AVX2_HOST - {"sse4_2"}


@pytest.mark.parametrize("value,match", [
    ("avx3", r"SARATHI_RT_CPU_ISA must be one of base, avx2, avx512, avx512_bf16, amx .*got 'avx3'.*this CPU is "
             r"avx2 \(flags: avx2 bmi2 f16c fma\)"),
    ("avx512", r"SARATHI_RT_CPU_ISA=avx512 needs avx512f avx512bw avx512dq avx512vl avx512cd, which this CPU lacks"
               r".*this CPU is avx2"),
    ("amx", r"SARATHI_RT_CPU_ISA=amx needs .*avx512_bf16 amx_bf16 amx_tile, which this CPU lacks"),
])
def test_an_unknown_or_missing_level_names_the_variable_and_the_flags(value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        isa_level(AVX2_HOST, {ISA_ENV: value})


def test_set_cpu_isa_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="level must be base, avx2, avx512 or avx512_bf16, got 'amx'"):
        _C.set_cpu_isa("amx")  # the kernels have no AMX level: the switch maps amx to avx512_bf16
    if _C.cpu_isa_native() != "avx512_bf16":
        with pytest.raises(ValueError, match="this CPU runs at most"):
            _C.set_cpu_isa("avx512_bf16")


def _run_under(value: str, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, ISA_ENV: value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_process_under_the_switch_runs_as_an_avx2_host() -> None:
    code = ("from sarathi_rt import _C\nfrom sarathi_rt.engine import EngineConfig\n"
            "print(_C.cpu_isa(), EngineConfig(model='tiny').dtype)")
    done = _run_under("avx2", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["avx2", "torch.float32"]


def test_a_bad_value_fails_the_core_import_naming_the_variable() -> None:
    done = _run_under("sse9", "from sarathi_rt import _C")
    assert done.returncode != 0 and "SARATHI_RT_CPU_ISA must be one of" in done.stderr
    assert "this CPU is " + native_isa(cpu_flags(environ={})) in done.stderr

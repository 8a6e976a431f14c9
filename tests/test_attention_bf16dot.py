"""The attention kernel's avx512_bf16 level for bf16 caches: scores by vdpbf16ps on bf16
pairs (q kept in bf16 as it arrives, the scale applied to each float32 score), P V in
float32. Against the float64 reference under the strict tolerance; a query's output the
same bits whether the decode path (keys and values from the pages) or the prefill path
(keys from the pages, values converted to float32) computed it; a request's output the
same bits alone or in a batch; other dtypes unchanged at the level; and the level chosen
by default and forced both ways by SARATHI_RT_CPU_ISA."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from sarathi_rt import _C, ops
from sarathi_rt.utils.cpu import ISA_ENV, isa_level

from attention_batches import (PagedBatch, assert_strictly_close, make_batch, poison_keys_before_windows,
                               poison_unowned_slots, random_window_case, run_in_steps)

DOT = "avx512_bf16"
needs_dot = pytest.mark.skipif(_C.cpu_isa_native() != DOT, reason="needs a CPU with AVX512-BF16")
# Decodes, whole prompts and chunks over a prefix, GQA 4: lengths 1, 17, 37, 577.
MIXED = [(1, 577), (17, 17), (1, 1), (37, 614), (1, 37), (150, 150), (1, 17)]
AVX512_HOST = {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}


@contextmanager
def level(name: str) -> Iterator[None]:
    """The kernels run at `name` inside the block, then at the level they ran before."""
    before = _C.cpu_isa()
    _C.set_cpu_isa(name)
    try:
        yield
    finally:
        _C.set_cpu_isa(before)


def _run_at(name: str, batch: PagedBatch, **kwargs: object) -> torch.Tensor:
    with level(name):
        return batch.run(**kwargs)


@needs_dot
@pytest.mark.parametrize("seed", range(12))
def test_random_batches_match_the_reference(seed: int) -> None:
    # The strict tolerance (the output's rounding and the probabilities', none for q), as at
    # the float32 levels: q is not rounded at this level (its bf16 bits are the operand, the
    # scale multiplies each float32 score), and a bf16 x bf16 product is exact in float32,
    # so a score carries only float32 summation error.
    case = random_window_case(seed, head_dims=(16, 32, 64, 80, 128))
    batch = make_batch(case.lengths, num_kv_heads=case.num_kv_heads, group=case.group, head_dim=case.head_dim,
                       block_size=case.block_size, dtype=torch.bfloat16, seed=seed)
    batch = poison_keys_before_windows(poison_unowned_slots(batch), case.window)
    kwargs = dict(scale=case.scale, window=case.window, softcap=case.softcap)
    for num_ctas in (2, 64):  # tiles whole, then long ones cut into pieces and merged
        plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                                  batch.q.shape[1], num_ctas=num_ctas, window=case.window)
        assert_strictly_close(_run_at(DOT, batch, plan=plan, **kwargs), batch, **kwargs)


@needs_dot
def test_the_level_changes_bf16_scores_only() -> None:
    bf16 = make_batch(MIXED, dtype=torch.bfloat16)
    dot, plain = _run_at(DOT, bf16), _run_at("avx512", bf16)
    assert not torch.equal(dot, plain)  # the vdpbf16ps path ran
    assert_strictly_close(plain, bf16)
    for dtype in (torch.float32, torch.float16):
        batch = make_batch(MIXED, dtype=dtype)
        assert torch.equal(_run_at(DOT, batch), _run_at("avx512", batch)), dtype


@needs_dot
@pytest.mark.parametrize("group, head_dim, window, softcap", [(1, 80, None, None), (4, 64, None, None),
                                                             (4, 128, 70, 20.0), (8, 40, None, 30.0)])
def test_a_query_gets_the_same_bits_as_a_decode_and_as_a_prefill_row(group: int, head_dim: int, window: int | None,
                                                                     softcap: float | None) -> None:
    """One token a step (group rows per KV head: the decode path) and 7 or 64 a step or the
    whole prompt (more than 8 rows: the prefill path) give every query the same bits.
    head_dim 80 and 40 leave a tail of a 32-element bf16 pair vector."""
    full = make_batch([(150, 150)], group=group, head_dim=head_dim, dtype=torch.bfloat16)
    kwargs = dict(window=window, softcap=softcap)
    with level(DOT):
        whole = full.run(**kwargs)
        for step in (1, 7, 64):
            assert torch.equal(run_in_steps(full, step, **kwargs), whole), f"steps of {step}"


@needs_dot
def test_a_requests_output_does_not_depend_on_the_batch() -> None:
    batch = make_batch(MIXED, dtype=torch.bfloat16, seed=3)
    cu = batch.cu_seqlens_q.tolist()
    with level(DOT):
        together = batch.run()
        for b in range(len(MIXED)):
            alone = PagedBatch(**{**batch.__dict__, "q": batch.q[cu[b]:cu[b + 1]],
                                  "cu_seqlens_q": torch.tensor([0, cu[b + 1] - cu[b]], dtype=torch.int32),
                                  "seqlens_k": batch.seqlens_k[b:b + 1], "block_tables": batch.block_tables[b:b + 1]})
            assert torch.equal(alone.run(), together[cu[b]:cu[b + 1]]), f"request {b}"


def _isa_under(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ISA_ENV}
    if value is not None:
        env[ISA_ENV] = value
    return subprocess.run([sys.executable, "-c", "from sarathi_rt import _C; print(_C.cpu_isa())"], env=env,
                          capture_output=True, text=True, timeout=120)


@needs_dot
@pytest.mark.parametrize("value, runs", [(None, DOT), (DOT, DOT), ("avx512", "avx512")])
def test_the_level_is_the_default_and_forced_both_ways(value: str | None, runs: str) -> None:
    done = _isa_under(value)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [runs]


def test_a_cpu_without_avx512_bf16_refuses_the_level() -> None:
    with pytest.raises(ValueError, match=r"SARATHI_RT_CPU_ISA=avx512_bf16 needs avx512_bf16, which this CPU lacks.*"
                                         r"this CPU is avx512 \(flags: avx2 avx512bw"):
        isa_level(AVX512_HOST, {ISA_ENV: DOT})
    if _C.cpu_isa_native() != DOT:
        with pytest.raises(ValueError, match="this CPU runs at most"):
            _C.set_cpu_isa(DOT)

"""Sliding windows, logit soft-capping and the caller's scale in the CPU hybrid_attention and
in the planner: random mixed batches against the float64 reference under the strict
tolerance (one key too many or too few fails it), keys outside every window poisoned;
plans that read only the window's keys; and bad values named. (The CUDA kernel's are in
test_attention_cuda.py; the float64 model of split windowed plans in test_attention_plan.py.)"""
from __future__ import annotations

import math

import pytest
import torch

from sarathi_rt import ops
from sarathi_rt.ops._registry import KERNELS
from sarathi_rt.ops.attention_plan import ITEM_FIELDS, LAYOUT

from attention_batches import (assert_strictly_close, make_batch, poison_keys_before_windows, poison_unowned_slots,
                               random_window_case, run_in_steps)

CHUNK = LAYOUT["keys_per_chunk"]


def _case_batch(seed: int, dtype: torch.dtype, device: str = "cpu"):
    case = random_window_case(seed)
    batch = make_batch(case.lengths, num_kv_heads=case.num_kv_heads, group=case.group, head_dim=case.head_dim,
                       block_size=case.block_size, dtype=dtype, device=device, seed=seed)
    return case, poison_keys_before_windows(poison_unowned_slots(batch), case.window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(12))
def test_random_batches_match_the_reference(dtype: torch.dtype, seed: int) -> None:
    case, batch = _case_batch(seed, dtype)
    kwargs = dict(scale=case.scale, window=case.window, softcap=case.softcap)
    # Few workers keep tiles whole, many cut the long ones into pieces inside the window.
    for num_ctas in (2, 64):
        plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                                  batch.q.shape[1], num_ctas=num_ctas, window=case.window)
        assert_strictly_close(batch.run(plan=plan, **kwargs), batch, **kwargs)


# A chunk of 37 queries over 614 keys, a whole 150-token prompt and long decodes, with
# windows shorter than the chunk (each row starts its window elsewhere), on a chunk
# boundary, and just past one.
@pytest.mark.parametrize("window", [1, 20, 64, 65, 300])
@pytest.mark.parametrize("group", [1, 8])
def test_windows_that_split_a_chunk(window: int, group: int) -> None:
    batch = make_batch([(37, 614), (150, 150), (1, 1200), (1, 3000), (2, 70)], group=group, head_dim=32,
                       dtype=torch.bfloat16)
    batch = poison_keys_before_windows(poison_unowned_slots(batch), window)
    assert_strictly_close(batch.run(window=window, softcap=30.0, scale=0.2), batch, 0.2, window, 30.0)


def test_off_and_oversized_windows_are_full_attention_bit_for_bit() -> None:
    batch = make_batch([(1, 577), (37, 614), (150, 150)], group=4)
    full = batch.run()
    for window in (0, 614, 10 ** 6, 2 ** 40):
        assert torch.equal(batch.run(window=window), full), window
    assert not torch.equal(batch.run(window=613), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_query_gets_the_same_bits_in_any_chunking(dtype: torch.dtype) -> None:
    """Tiles start at their first row's window, on whole key chunks at absolute positions:
    a query's output must not depend on which tile (or how many chunks before its window)
    computed it."""
    full = make_batch([(300, 300)], group=4, head_dim=64, dtype=dtype)
    kwargs = dict(window=70, softcap=20.0)
    whole = full.run(**kwargs)
    for chunk in (1, 7, 64, 100):
        assert torch.equal(run_in_steps(full, chunk, **kwargs), whole), f"chunks of {chunk}"


def _keys_read(plan: ops.AttentionPlan, request: int) -> dict[tuple[int, int], int]:
    """Keys each (KV head, first row) tile of `request` reads, over all its pieces."""
    read: dict[tuple[int, int], int] = {}
    for row in plan.work_items().tolist():
        it = dict(zip(ITEM_FIELDS, row))
        if it["request"] == request:
            for h in range(it["kv_head"], it["kv_head"] + it["num_heads"]):
                key = (h, it["row_begin"])
                read[key] = read.get(key, 0) + it["kv_end"] - it["kv_begin"]
    return read


@pytest.mark.parametrize("kernel", ["cuda", "cpu"])
def test_a_windowed_decode_over_100k_keys_reads_the_window(kernel: str) -> None:
    """A decode with a 4096-key window over a 100k context reads 4096 keys (to whole
    chunks), not 100k; a 256-query chunk beside it, its window plus its queries."""
    context, window, block_size = 100_000, 4096, 256
    lengths = [(1, context), (256, context)]
    pages = math.ceil(context / block_size)
    tables = torch.arange(2 * pages, dtype=torch.int32).view(2, pages)
    k_cache = torch.empty(2 * pages, block_size, 2, 8)  # the planner reads only its shape
    cu = torch.tensor([0, 1, 257], dtype=torch.int32)
    seqlens = torch.tensor([kv for _, kv in lengths], dtype=torch.int32)
    for num_ctas in (1, 264):
        plan = ops.plan_attention(cu, seqlens, tables, k_cache, 8, num_ctas=num_ctas, kernel=kernel, window=window)
        decode = _keys_read(plan, 0)
        assert len(decode) == 2 and all(window <= n < window + CHUNK for n in decode.values())
        chunk = _keys_read(plan, 1)
        rows_per_tile = LAYOUT["wide_rows"]
        assert all(n < window + rows_per_tile // 4 + CHUNK for n in chunk.values())
        full = ops.plan_attention(cu, seqlens, tables, k_cache, 8, num_ctas=num_ctas, kernel=kernel)
        assert all(n >= context - 256 for n in _keys_read(full, 1).values())
        assert all(n == context for n in _keys_read(full, 0).values())


@pytest.mark.parametrize("seed", range(6))
def test_windowed_plans_cover_each_row_window_once(seed: int) -> None:
    case = random_window_case(seed)
    batch = make_batch(case.lengths, num_kv_heads=case.num_kv_heads, group=case.group, head_dim=8,
                       block_size=case.block_size)
    window = case.window or 300
    for kernel, num_ctas in (("cuda", 264), ("cpu", 4)):
        plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                                  batch.q.shape[1], num_ctas=num_ctas, kernel=kernel, window=window)
        assert plan.window == (0 if window >= 2 ** 31 - 1 else window)
        ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for row in plan.work_items().tolist():
            it = dict(zip(ITEM_FIELDS, row))
            assert it["kv_begin"] % CHUNK == 0
            for h in range(it["kv_head"], it["kv_head"] + it["num_heads"]):
                for r in range(it["row_begin"], it["row_begin"] + it["num_rows"]):
                    token = it["q_token0"] + r // case.group
                    ranges.setdefault((token, h * case.group + r % case.group), []).append(
                        (it["kv_begin"], it["kv_end"], it["causal_offset"] + r // case.group + 1))
        assert len(ranges) == batch.q.shape[0] * batch.q.shape[1]
        for pieces in ranges.values():
            pieces.sort()
            visible = pieces[0][2]
            first = max(0, visible - window)
            assert pieces[0][0] <= first and pieces[-1][1] >= visible  # the whole window, once
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


BAD_WINDOWS = [-1, 1.5, "64", True, float("inf")]
BAD_SOFTCAPS = [0, 0.0, -1.0, float("nan"), float("inf"), "30", True]


def test_bad_windows_and_softcaps_name_the_argument() -> None:
    batch = make_batch([(1, 9), (2, 2)], head_dim=64, block_size=4)
    for window in BAD_WINDOWS:
        with pytest.raises(ValueError, match="window must be"):
            batch.run(window=window)
        with pytest.raises(ValueError, match="window must be"):
            ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8,
                               window=window)
    for softcap in BAD_SOFTCAPS:
        with pytest.raises(ValueError, match="softcap must be"):
            batch.run(softcap=softcap)


def test_a_plan_serves_only_its_window() -> None:
    batch = make_batch([(1, 577), (37, 614)], group=4)
    args = (batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8)
    local = ops.plan_attention(*args, window=64)
    assert torch.equal(batch.run(plan=local, window=64), batch.run(window=64))
    with pytest.raises(ValueError, match="plan was built for window 64 but this call has 0"):
        batch.run(plan=local)
    with pytest.raises(ValueError, match="plan was made for window 64, not window=128"):
        ops.plan_attention(*args, plan=local, window=128)
    assert ops.plan_attention(*args, plan=local, window=64) is local
    out = torch.empty_like(batch.q)
    with pytest.raises(ValueError, match="plan was built for window 64 but this call has 128"):
        ops.attention.run_attention(local, batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q,
                                    batch.seqlens_k, batch.block_tables, 0.125, out, window=128)
    # The kernel itself checks a CPU plan's window, whoever calls it.
    with pytest.raises(ValueError, match="plan was built for window 64 but this call has 0"):
        KERNELS.hybrid_attention_out(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seqlens_k,
                                     batch.block_tables, local.buffer, local.capacity.as_list(), 0.125, out)
    with pytest.raises(ValueError, match="window must be in"):
        KERNELS.hybrid_attention_out(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seqlens_k,
                                     batch.block_tables, local.buffer, local.capacity.as_list(), 0.125, out, -3)
    with pytest.raises(ValueError, match="softcap must be"):
        KERNELS.hybrid_attention_out(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seqlens_k,
                                     batch.block_tables, local.buffer, local.capacity.as_list(), 0.125, out, 64,
                                     float("nan"))

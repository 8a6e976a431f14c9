"""CUDA paged write_kv and fused hybrid attention against the float64 reference, on the
same ragged grids as the planner tests, with every cache slot a request does not own (and
every key past a query's causal limit) poisoned, under a tolerance that one wrong key in a
long row exceeds. Skipped (with the reason) without a CUDA device."""
from __future__ import annotations

import pytest
import torch

from sarathi_rt import ops
from sarathi_rt.ops import reference

from attention_batches import (GRIDS, assert_strictly_close, make_batch, poison_chunk_keys,
                               poison_keys_before_windows, poison_unowned_slots, random_window_case)
from conftest import ATOL, requires_cuda

pytestmark = [requires_cuda, pytest.mark.cuda]

DTYPES = [torch.bfloat16, torch.float16]


def _assert_close_to_reference(got: torch.Tensor, batch, scale: float | None = None) -> None:
    """Error against float64 at most twice what plain PyTorch reaches in the same dtype."""
    want = reference.hybrid_attention(*batch.args(), scale=scale)
    plain = reference.hybrid_attention(*batch.args(), scale=scale, dtype=batch.q.dtype)
    err = (got.double() - want).abs().max().item()
    plain_err = (plain.double() - want).abs().max().item()
    assert torch.isfinite(got).all()
    assert err <= max(2 * plain_err, ATOL[batch.q.dtype]), (err, plain_err)


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_hybrid_attention_cuda_matches_reference(grid: str, dtype: torch.dtype, head_dim: int, block_size: int,
                                                 group: int) -> None:
    batch = make_batch(GRIDS[grid], block_size=block_size, group=group, head_dim=head_dim, dtype=dtype,
                       device="cuda")
    batch = poison_chunk_keys(poison_unowned_slots(batch))
    assert_strictly_close(ops.hybrid_attention(*batch.args()), batch)


# A request with no new token, decodes, chunks over a prefix, a whole prompt.
POISONED = [(1, 577), (17, 17), (0, 9), (37, 614), (1, 1), (5, 300), (64, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 3, 17, 128])
@pytest.mark.parametrize("group", [1, 16, 32])
@pytest.mark.parametrize("scale", [None, 10.0])
def test_poisoned_slots_block_sizes_gqa_and_scale(dtype: torch.dtype, block_size: int, group: int,
                                                  scale: float | None) -> None:
    batch = make_batch(POISONED, block_size=block_size, group=group, num_kv_heads=2, head_dim=128, dtype=dtype,
                       device="cuda")
    batch = poison_chunk_keys(poison_unowned_slots(batch))
    assert_strictly_close(ops.hybrid_attention(*batch.args(), scale=scale), batch, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(8))
def test_random_windows_softcaps_and_scales(dtype: torch.dtype, seed: int) -> None:
    """The CPU tests' random batches (test_attention_window.py): mixed decodes and chunks,
    GQA, windows that split chunks and splits inside windows, keys outside every window
    poisoned; the grid's own size and a few CTAs (long tiles cut into pieces)."""
    case = random_window_case(seed, head_dims=(64, 128))
    batch = make_batch(case.lengths, num_kv_heads=case.num_kv_heads, group=case.group, head_dim=case.head_dim,
                       block_size=case.block_size, dtype=dtype, device="cuda", seed=seed)
    batch = poison_keys_before_windows(poison_unowned_slots(batch), case.window)
    kwargs = dict(scale=case.scale, window=case.window, softcap=case.softcap)
    for num_ctas in (None, 8):
        plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                                  batch.q.shape[1], num_ctas=num_ctas, window=case.window)
        assert_strictly_close(ops.hybrid_attention(*batch.args(), plan=plan, **kwargs), batch, **kwargs)


@pytest.mark.parametrize("window", [1, 20, 64, 65, 300])
@pytest.mark.parametrize("group", [1, 8])
def test_windows_that_split_a_chunk(window: int, group: int) -> None:
    batch = make_batch([(37, 614), (150, 150), (1, 1200), (1, 3000), (2, 70)], group=group, head_dim=128,
                       dtype=torch.bfloat16, device="cuda")
    batch = poison_keys_before_windows(poison_unowned_slots(batch), window)
    got = ops.hybrid_attention(*batch.args(), window=window, softcap=30.0, scale=0.2)
    assert_strictly_close(got, batch, 0.2, window, 30.0)
    with pytest.raises(ValueError, match="softcap must be"):
        ops.hybrid_attention(*batch.args(), window=window, softcap=-1.0)
    with pytest.raises(ValueError, match="window must be"):
        ops.hybrid_attention(*batch.args(), window=-window)


@pytest.mark.parametrize("num_ctas", [None, 64])
def test_context_lengths_around_64k(num_ctas: int | None) -> None:
    batch = make_batch([(1, 65535), (1, 65536), (1, 65537), (16, 65536)], num_kv_heads=2, group=4, head_dim=128,
                       block_size=16, dtype=torch.bfloat16, device="cuda")
    batch = poison_chunk_keys(poison_unowned_slots(batch))
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8,
                              num_ctas=num_ctas)
    assert_strictly_close(ops.hybrid_attention(*batch.args(), plan=plan), batch)


def test_rows_fully_masked_in_a_split_piece() -> None:
    """The last piece of the 4-query tile holds keys 1280 and 1281: queries 0 and 1 see
    neither, so their rows of that piece are fully masked and must merge with weight 0."""
    batch = poison_unowned_slots(make_batch([(4, 1282), (1, 30)], group=4, head_dim=64, dtype=torch.bfloat16,
                                            device="cuda"))
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8,
                              num_ctas=64)
    items = [dict(zip(ops.attention_plan.ITEM_FIELDS, row)) for row in plan.work_items().tolist()]
    assert any(it["partial"] >= 0 and it["causal_offset"] + 1 <= it["kv_begin"] for it in items)
    assert_strictly_close(ops.hybrid_attention(*batch.args(), plan=plan), batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_only_batches_of_hundreds(dtype: torch.dtype) -> None:
    """Far more tiles than CTAs (the unsplit multi-item-per-CTA path) and, with one 32k
    context among them, the balanced split of one long tile."""
    kv = torch.randint(1, 3000, (320,), generator=torch.Generator().manual_seed(0)).tolist()
    for lengths in ([(1, n) for n in kv], [(1, 512)] * 299 + [(1, 32768)]):
        batch = poison_unowned_slots(make_batch(lengths, num_kv_heads=8, group=4, head_dim=128, dtype=dtype,
                                                device="cuda"))
        assert_strictly_close(ops.hybrid_attention(*batch.args()), batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_only_at_head_dim_64(dtype: torch.dtype) -> None:
    batch = make_batch([(577, 577), (64, 64), (65, 65), (1000, 1300)], num_kv_heads=2, group=4, head_dim=64,
                       dtype=dtype, device="cuda")
    batch = poison_chunk_keys(poison_unowned_slots(batch))
    assert_strictly_close(ops.hybrid_attention(*batch.args()), batch)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_strided_q_from_a_fused_qkv_tensor(head_dim: int) -> None:
    batch = poison_unowned_slots(make_batch(GRIDS["mixed"], num_kv_heads=2, group=4, head_dim=head_dim,
                                            dtype=torch.bfloat16, device="cuda"))
    qkv = torch.randn(batch.q.shape[0], 8 + 2 * 2, head_dim, device="cuda").to(torch.bfloat16)
    qkv[:, :8] = batch.q
    batch.q = qkv[:, :8]
    assert not batch.q.is_contiguous()
    assert_strictly_close(ops.hybrid_attention(*batch.args()), batch)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_plan_on_another_device_than_the_current_one() -> None:
    """The plan's copy, and the event its next update waits for, belong to the plan's device."""
    batch = make_batch(GRIDS["mixed"], group=4, head_dim=64, dtype=torch.bfloat16, device="cuda:1")
    with torch.cuda.device(0):
        plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8)
        for _ in range(2):
            plan.update(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache)
            got = ops.hybrid_attention(*batch.args(), plan=plan)
    assert plan.device == torch.device("cuda", 1)
    assert_strictly_close(got, batch)


@pytest.mark.parametrize("num_ctas", [3, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_and_persistent_loop(num_ctas: int, dtype: torch.dtype) -> None:
    # 2048 CTAs: every long context is split and merged; 3 CTAs: each runs many items.
    batch = make_batch(GRIDS["mixed"] + [(1, 4000)], group=4, head_dim=128, dtype=dtype, device="cuda")
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                              batch.q.shape[1], num_ctas=num_ctas)
    assert (plan.num_merges > 0) == (num_ctas == 2048)
    assert plan.stats()["num_workers"] == num_ctas
    _assert_close_to_reference(ops.hybrid_attention(*batch.args(), plan=plan, scale=0.05), batch, scale=0.05)


def test_one_plan_serves_every_layer_and_out_views() -> None:
    batch = make_batch(GRIDS["mixed"], group=4, head_dim=64, dtype=torch.bfloat16, device="cuda")
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8)
    fused = torch.empty(batch.q.shape[0], 2, 8, 64, dtype=torch.bfloat16, device="cuda")
    for layer in range(2):
        batch.q.normal_(generator=torch.Generator("cuda").manual_seed(layer))
        ops.hybrid_attention(*batch.args(), plan=plan, out=fused[:, layer])
        _assert_close_to_reference(fused[:, layer], batch)


def test_planned_step_replays_in_a_cuda_graph() -> None:
    shapes = dict(group=4, head_dim=128, dtype=torch.bfloat16, device="cuda")
    first = make_batch([(1, 300), (1, 17), (62, 100)], **shapes, seed=1)
    second = make_batch([(1, 2000), (31, 31), (32, 900)], **shapes, seed=2)  # same batch and token counts
    static = make_batch([(1, 2000), (31, 31), (32, 900)], **shapes, seed=3)
    plan = ops.AttentionPlan(max_batch=3, max_tokens=64, num_q_heads=8, num_kv_heads=2, head_dim=128,
                             device="cuda", dtype=torch.bfloat16).reserve_partials()  # the graph keeps its address
    pool = (plan.partial_out.data_ptr(), plan.partial_lse.data_ptr())

    def load(src) -> None:
        for name in ("q", "k_cache", "v_cache", "cu_seqlens_q", "seqlens_k", "block_tables"):
            dst = getattr(static, name)
            t = getattr(src, name)
            dst.zero_()
            dst[tuple(slice(0, n) for n in t.shape)].copy_(t)
        plan.update(static.cu_seqlens_q, static.seqlens_k, static.block_tables, static.k_cache)

    out = torch.empty_like(static.q)
    load(first)
    ops.hybrid_attention(*static.args(), plan=plan, out=out)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.hybrid_attention(*static.args(), plan=plan, out=out)
    for src in (first, second):
        load(src)
        assert (plan.partial_out.data_ptr(), plan.partial_lse.data_ptr()) == pool
        graph.replay()
        torch.cuda.synchronize()
        _assert_close_to_reference(out, src)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cuda_strided_fused_qkv(dtype: torch.dtype) -> None:
    g = torch.Generator("cuda").manual_seed(0)
    qkv = torch.randn(37, 3, 4, 128, generator=g, device="cuda").to(dtype)
    k_cache = torch.zeros(8, 16, 4, 128, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(128, device="cuda")[:37]
    slots[::7] = -1
    ops.write_kv(qkv[:, 1], qkv[:, 2], k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.write_kv(qkv[:, 1], qkv[:, 2], k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref) and k_cache.abs().sum() > 0


def test_cuda_bad_inputs_name_the_argument() -> None:
    batch = make_batch(GRIDS["decode"], group=4, head_dim=64, dtype=torch.float16, device="cuda")
    with pytest.raises(TypeError, match="q must have dtype float16 or bfloat16 on CUDA"):
        b32 = make_batch(GRIDS["decode"], group=4, head_dim=64, device="cuda")
        ops.hybrid_attention(*b32.args())
    with pytest.raises(ValueError, match="Unsupported head_dim: 80"):
        b80 = make_batch(GRIDS["decode"], group=4, head_dim=80, dtype=torch.float16, device="cuda")
        ops.hybrid_attention(*b80.args())
    wide = torch.zeros(batch.q.shape[0], 8, 68, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="q must be 16-byte aligned"):
        ops.hybrid_attention(wide[..., 4:], *batch.args()[1:])
    bad = batch.block_tables.clone()
    bad[-1, 0] = -1
    with pytest.raises(ValueError, match="block_tables"):
        ops.hybrid_attention(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seqlens_k, bad)
    cpu_plan = ops.plan_attention(*(t.cpu() for t in (batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables,
                                                      batch.k_cache)), 8)
    with pytest.raises(ValueError, match="plan was built for device"):
        ops.hybrid_attention(*batch.args(), plan=cpu_plan)

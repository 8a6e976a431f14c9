"""The partial-result memory of attention plans: sized from each batch and stated in stats().

On random batches of the property test's distribution (tests/test_attention_plan_property.py),
the bytes stats() reports equal a count made here from the plan's own work items (a split
piece of h KV heads and r rows per head writes h * r partial rows; a CUDA row is head_dim
float32 outputs plus one log-sum-exp), the pieces' rows fill the pool without gap or
overlap, and a fresh plan holds exactly that, far below the fixed pool of 512 rows per CTA
the CUDA kernel used to get (69 MB at 264 CTAs, head_dim 128). A reused plan's pool grows
to its largest batch and no further; reserve_partials() holds the worst case for graphs.
"""
from __future__ import annotations

import random
import statistics

import torch

from sarathi_rt import ops
from sarathi_rt.ops.attention_plan import ITEM_FIELDS, LAYOUT

from attention_batches import assert_strictly_close, make_batch
from test_attention_plan_property import index_tensors, random_batch

NUM_BATCHES = 200
CPU_LANES = 16  # the CPU kernel pads a partial row's head_dim to whole 16-float vectors


def _pieces(plan: ops.AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """First partial row and rows of every split piece, in pool order."""
    items = plan.work_items().long()
    col = {name: items[:, i] for i, name in enumerate(ITEM_FIELDS)}
    split = col["partial"] >= 0
    start, order = col["partial"][split].sort()
    return start, (col["num_heads"] * col["num_rows"])[split][order]


def _row_bytes(kernel: str, head_dim: int) -> int:
    if kernel == "cuda":
        return 4 * (head_dim + 1)
    return 4 * (-(-head_dim // CPU_LANES) * CPU_LANES + 2)


def _old_pool_bytes(num_ctas: int, head_dim: int) -> int:
    """What every CUDA plan allocated before: the capacity's worst case, whatever the batch."""
    return LAYOUT["partial_rows_per_worker"] * num_ctas * _row_bytes("cuda", head_dim)


def test_random_batches_state_the_partial_memory_they_use() -> None:
    rng = random.Random(2)
    shares: list[float] = []
    decode_shares: list[float] = []
    for _ in range(NUM_BATCHES):
        lengths, (q_heads, kv_heads, head_dim), ctas = random_batch(rng)
        plan = ops.plan_attention(*index_tensors(lengths, kv_heads, head_dim), q_heads, num_ctas=ctas, kernel="cuda")
        stats = plan.stats()
        start, count = _pieces(plan)
        rows = int(count.sum())
        # The pieces' rows fill [0, rows) exactly, in order.
        assert torch.equal(start, count.cumsum(0) - count)
        assert stats["partial_rows"] == rows and stats["num_partials"] == len(count)
        assert stats["partial_bytes"] == rows * _row_bytes("cuda", head_dim)
        # A fresh plan holds this batch's pool and nothing more.
        assert plan.partial_out.shape == (rows, head_dim) and plan.partial_lse.shape == (rows,)
        assert stats["partial_pool_bytes"] == stats["partial_bytes"]
        old = _old_pool_bytes(ctas, head_dim)
        assert stats["partial_bytes"] <= stats["partial_max_bytes"] <= old
        shares.append(stats["partial_bytes"] / old)
        if all(q == 1 for q, _ in lengths):
            decode_shares.append(stats["partial_bytes"] / old)
    # Most batches split a few tiles or none; decode pieces have few rows. (Mixed batches
    # whose prefill chunk has a long prefix may split many 64-row tiles: up to ~0.9 of it.)
    assert statistics.median(shares) < 0.01, sorted(shares)[len(shares) // 2]
    assert len(decode_shares) >= NUM_BATCHES // 4 and max(decode_shares) < 0.25, max(decode_shares)


def test_cpu_plans_state_the_rows_their_kernel_allocates_per_call() -> None:
    rng = random.Random(3)
    for _ in range(20):
        lengths, (q_heads, kv_heads, head_dim), _ = random_batch(rng)
        plan = ops.plan_attention(*index_tensors(lengths, kv_heads, head_dim), q_heads, num_ctas=8, kernel="cpu")
        stats = plan.stats()
        rows = int(_pieces(plan)[1].sum())
        assert stats["partial_rows"] == rows
        assert stats["partial_bytes"] == rows * _row_bytes("cpu", head_dim)
        assert stats["partial_pool_bytes"] == 0 and plan.partial_out.numel() == 0


def test_a_reused_plan_grows_its_pool_to_the_largest_batch_then_reserve_fixes_it() -> None:
    q_heads, kv_heads, head_dim, ctas = 32, 8, 128, 264
    rng = random.Random(4)
    plan = ops.AttentionPlan(max_batch=1024, max_tokens=4096, num_q_heads=q_heads, num_kv_heads=kv_heads,
                             head_dim=head_dim, device="cpu", num_ctas=ctas, kernel="cuda")
    batches = [[(1, 512)] * 63 + [(1, 32768)], [(1, 100)], [(1, 4096)] * 40, [(1, 2000)] * 3]
    batches += [[(1, rng.randint(16, 65536)) for _ in range(rng.randint(1, 300))] for _ in range(6)]
    largest, address = 0, None
    for lengths in batches:
        plan.update(*index_tensors(lengths, kv_heads, head_dim))
        rows = plan.stats()["partial_rows"]
        if rows <= largest:  # fits: the pool stays where it was
            assert plan.partial_out.data_ptr() == address
        largest = max(largest, rows)
        address = plan.partial_out.data_ptr()
        assert plan.partial_out.shape[0] == plan.partial_lse.shape[0] == largest
        assert plan.stats()["partial_pool_bytes"] == largest * 4 * (head_dim + 1)
    assert 0 < largest < plan.capacity.max_partial_rows
    plan.reserve_partials()
    stats = plan.stats()
    assert stats["partial_pool_bytes"] == stats["partial_max_bytes"] == _old_pool_bytes(ctas, head_dim)
    addresses = (plan.partial_out.data_ptr(), plan.partial_lse.data_ptr())
    for lengths in batches:
        plan.update(*index_tensors(lengths, kv_heads, head_dim))
        assert (plan.partial_out.data_ptr(), plan.partial_lse.data_ptr()) == addresses  # graph-safe


def test_a_batch_with_no_split_tile_needs_no_pool() -> None:
    plan = ops.plan_attention(*index_tensors([(1, 2048)] * 64, 8, 128), 32, num_ctas=264, kernel="cuda")
    stats = plan.stats()
    assert stats["num_splits"] == 0 and stats["partial_bytes"] == stats["partial_pool_bytes"] == 0
    assert plan.partial_out.numel() == 0 and stats["partial_max_bytes"] > 0


def test_a_split_cpu_plan_pads_its_partial_rows_and_stays_exact() -> None:
    """The CPU kernel allocates its partial rows per call from the planner's count (head_dim
    24 padded to 32, plus max and sum): a split plan still matches the float64 reference."""
    batch = make_batch([(1, 3000), (5, 900), (1, 40)], num_kv_heads=2, group=4, head_dim=24, block_size=16,
                       dtype=torch.float32, seed=5)
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                              batch.q.shape[1], num_ctas=8, kernel="cpu")
    assert plan.stats()["num_splits"] > 0 and plan.stats()["partial_bytes"] == plan.partial_rows * 4 * (32 + 2)
    assert_strictly_close(batch.run(plan=plan), batch)

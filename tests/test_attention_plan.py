"""The CUDA attention planner, tested on the CPU: coverage, split sizes, balance,
capacity and index errors, and a float64 model of split-KV + log-sum-exp merging that
runs the plan's work list and must match the reference."""
from __future__ import annotations

import math

import pytest
import torch

from sarathi_rt import _C, ops
from sarathi_rt.ops import reference
from sarathi_rt.ops.plan import ITEM_FIELDS, LAYOUT, MERGE_FIELDS, NARROW, WIDE

from attention_batches import GRIDS, make_batch

CHUNK = LAYOUT["keys_per_chunk"]


def _plan(batch, num_ctas: int, **kw) -> ops.AttentionPlan:
    return ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                              batch.q.shape[1], num_ctas=num_ctas, **kw)


def _items(plan: ops.AttentionPlan) -> list[dict[str, int]]:
    return [dict(zip(ITEM_FIELDS, row)) for row in plan.work_items().tolist()]


def _merges(plan: ops.AttentionPlan) -> list[dict[str, int]]:
    return [dict(zip(MERGE_FIELDS, row)) for row in plan.merges().tolist()]


def _cost(item: dict[str, int]) -> int:
    return math.ceil((item["kv_end"] - item["kv_begin"]) / CHUNK) * (2 if item["kind"] == WIDE else 1) + 1


# Block size only moves pages around, so it alternates with the grid size.
CASES = [(grid, group, block_size, ctas) for grid in GRIDS for group in (1, 4, 8)
         for block_size, ctas in ((16, 4), (32, 264))]


@pytest.mark.parametrize("grid,group,block_size,num_ctas", CASES)
def test_every_row_is_planned_once_with_all_its_keys(grid: str, group: int, block_size: int, num_ctas: int) -> None:
    lengths = GRIDS[grid]
    batch = make_batch(lengths, block_size=block_size, group=group)
    plan = _plan(batch, num_ctas)
    items, merges = _items(plan), _merges(plan)
    num_kv_heads = batch.k_cache.shape[2]
    covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for it in items:
        q_len, kv_len = lengths[it["request"]]
        assert it["causal_offset"] == kv_len - q_len
        assert it["num_rows"] <= (16 if it["kind"] == NARROW else 64)
        assert it["kind"] == (NARROW if q_len * group <= 16 else WIDE)
        assert it["kv_begin"] % CHUNK == 0 and it["kv_begin"] < it["kv_end"]
        for r in range(it["row_begin"], it["row_begin"] + it["num_rows"]):
            token, head = it["q_token0"] + r // group, it["kv_head"] * group + r % group
            covered.setdefault((token, head), []).append((it["kv_begin"], it["kv_end"]))
    expected = {(int(batch.cu_seqlens_q[b]) + i, h) for b, (q_len, _) in enumerate(lengths)
                for i in range(q_len) for h in range(num_kv_heads * group)}
    assert set(covered) == expected
    for (token, _), ranges in covered.items():
        b = int(torch.searchsorted(batch.cu_seqlens_q, token, right=True)) - 1
        q_len, kv_len = lengths[b]
        visible = kv_len - q_len + (token - int(batch.cu_seqlens_q[b])) + 1
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] >= visible  # keys [0, visible) in order,
        assert all(a[1] == b_[0] for a, b_ in zip(ranges, ranges[1:]))  # each exactly once
    split_items = [it for it in items if it["partial"] >= 0]
    assert sorted(it["partial"] for it in split_items) == list(range(plan.num_partials))
    assert sum(m["num_partials"] for m in merges) == plan.num_partials


def test_small_batches_are_split_to_fill_the_grid() -> None:
    batch = make_batch([(1, 4096)], num_kv_heads=8, group=4, block_size=16)
    plan = _plan(batch, num_ctas=132)
    items = _items(plan)
    assert plan.num_merges == 8  # one per KV head
    assert 0.9 * 132 <= len(items) <= 2 * 132
    sizes = sorted({it["kv_end"] - it["kv_begin"] for it in items})
    assert sizes == [4 * CHUNK]  # 64 chunks per head, 16 equal pieces of the minimum size
    assert all(it["partial"] >= 0 for it in items)


def test_split_pieces_are_near_equal_and_chunk_aligned() -> None:
    batch = make_batch([(1, 5000), (1, 3000)], num_kv_heads=2, group=8)
    plan = _plan(batch, num_ctas=16)
    for m in _merges(plan):
        pieces = [it for it in _items(plan) if m["first_partial"] <= it["partial"] < m["first_partial"]
                  + m["num_partials"]]
        lengths = sorted(it["kv_end"] - it["kv_begin"] for it in pieces)
        assert all(length % CHUNK == 0 for length in lengths[1:])  # only the tail piece is ragged
        assert lengths[-1] - lengths[1 if len(lengths) > 1 else 0] == 0
        assert lengths[0] <= lengths[-1]


def test_many_tiles_are_not_split_and_the_ctas_are_balanced() -> None:
    batch = make_batch([(1, 700 + 37 * i) for i in range(40)] + [(200, 900)], num_kv_heads=4, group=4)
    plan = _plan(batch, num_ctas=32)
    items = _items(plan)
    assert plan.num_merges == 0 and all(it["partial"] == -1 for it in items)
    ranges = plan.cta_ranges().tolist()
    assert ranges[0] == 0 and ranges[-1] == len(items)
    loads = [sum(_cost(it) for it in items[a:b]) for a, b in zip(ranges, ranges[1:])]
    assert max(loads) <= sum(loads) / len(loads) + max(_cost(it) for it in items)
    for a, b in zip(ranges, ranges[1:]):  # each CTA runs its longest item first
        costs = [_cost(it) for it in items[a:b]]
        assert costs == sorted(costs, reverse=True)


def _run_plan_float64(plan: ops.AttentionPlan, batch, scale: float) -> torch.Tensor:
    """What the kernels compute, item by item, in float64 (log2-domain lse, as on the GPU)."""
    q, k_cache, v_cache = (t.double() for t in (batch.q, batch.k_cache, batch.v_cache))
    group = q.shape[1] // k_cache.shape[2]
    out = torch.full_like(q, float("nan"))
    partial_out: dict[tuple[int, int], torch.Tensor] = {}
    partial_lse: dict[tuple[int, int], float] = {}
    for it in _items(plan):
        kv_len = it["causal_offset"] + 1  # at least; gather everything the item may read
        keys = reference.gather_kv(k_cache, batch.block_tables[it["request"]], it["kv_end"])
        values = reference.gather_kv(v_cache, batch.block_tables[it["request"]], it["kv_end"])
        for r in range(it["num_rows"]):
            flat = it["row_begin"] + r
            token, head = it["q_token0"] + flat // group, it["kv_head"] * group + flat % group
            limit = min(it["kv_end"], it["causal_offset"] + flat // group + 1)
            s = keys[it["kv_begin"]:limit, it["kv_head"]] @ q[token, head] * scale * math.log2(math.e)
            if s.numel() == 0:
                o, lse = torch.zeros(q.shape[2], dtype=torch.float64), -math.inf
            else:
                mx = s.max()
                p = torch.exp2(s - mx)
                o = p @ values[it["kv_begin"]:limit, it["kv_head"]] / p.sum()
                lse = float(mx + torch.log2(p.sum()))
            if it["partial"] < 0:
                out[token, head] = o
            else:
                partial_out[(it["partial"], r)], partial_lse[(it["partial"], r)] = o, lse
        assert kv_len >= 1
    for m in _merges(plan):
        for r in range(m["num_rows"]):
            slots = range(m["first_partial"], m["first_partial"] + m["num_partials"])
            lses = torch.tensor([partial_lse[(s, r)] for s in slots], dtype=torch.float64)
            w = torch.exp2(lses - lses.max())
            merged = sum(wi * partial_out[(s, r)] for wi, s in zip(w, slots)) / w.sum()
            flat = m["row_begin"] + r
            out[m["q_token0"] + flat // group, m["kv_head"] * group + flat % group] = merged
    return out


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("group", [1, 8])
def test_float64_model_of_the_planned_kernel_matches_the_reference(grid: str, group: int) -> None:
    lengths = [(q, kv) for q, kv in GRIDS[grid] if q <= 37]  # the 577-token chunk is covered above
    batch = make_batch(lengths, group=group, block_size=16, head_dim=16, num_kv_heads=2)
    plan = _plan(batch, num_ctas=64)  # more CTAs than tiles: long contexts get split and merged
    assert grid == "prefill" or plan.num_merges > 0
    got = _run_plan_float64(plan, batch, scale=0.3)
    want = reference.hybrid_attention(*batch.args(), scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_plan_keeps_its_buffers_across_steps() -> None:
    plan = ops.AttentionPlan(max_batch=8, max_tokens=700, num_q_heads=8, num_kv_heads=2, head_dim=64,
                             device="cpu", num_ctas=16)
    addresses = (plan.buffer.data_ptr(), plan.partial_out.data_ptr(), plan.partial_lse.data_ptr())
    for grid in GRIDS.values():
        batch = make_batch(grid, group=4)
        ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8, plan=plan)
        assert plan.num_items > 0 and plan.batch == len(grid)
        assert torch.equal(plan.buffer, plan._host)
    assert (plan.buffer.data_ptr(), plan.partial_out.data_ptr(), plan.partial_lse.data_ptr()) == addresses


def test_capacity_errors_name_the_limit() -> None:
    plan = ops.AttentionPlan(max_batch=2, max_tokens=40, num_q_heads=8, num_kv_heads=2, head_dim=64, device="cpu",
                             num_ctas=4)
    batch = make_batch(GRIDS["decode"], group=4)
    with pytest.raises(ValueError, match="max_batch=2"):
        plan.update(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache)
    batch = make_batch([(17, 17), (37, 37)], group=4)
    with pytest.raises(ValueError, match="max_tokens=40"):
        plan.update(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache)
    buf = torch.zeros(4096, dtype=torch.int32)
    with pytest.raises(ValueError, match="work items but the plan holds 1"):
        _C.build_attention_plan(buf.data_ptr(), batch.cu_seqlens_q.data_ptr(), batch.seqlens_k.data_ptr(),
                                batch.block_tables.data_ptr(), 2, 54, 8, batch.block_tables.shape[1],
                                tuple(batch.k_cache.shape), [1, 1, 1, 4])
    with pytest.raises(ValueError, match="max_batch must be positive"):
        ops.AttentionPlan(max_batch=0, max_tokens=1, num_q_heads=8, num_kv_heads=2, head_dim=64, device="cpu")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.AttentionPlan(max_batch=1, max_tokens=1, num_q_heads=6, num_kv_heads=4, head_dim=64, device="cpu")


def test_bad_indices_name_the_argument() -> None:
    batch = make_batch(GRIDS["mixed"], group=4)
    bad_tables = batch.block_tables.clone()
    bad_tables[0, 0] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[0\]"):
        ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, bad_tables, batch.k_cache, 8)
    short = batch.seqlens_k.clone()
    short[1] = 3
    with pytest.raises(ValueError, match=r"seqlens_k\[1\] = 3 is smaller"):
        ops.plan_attention(batch.cu_seqlens_q, short, batch.block_tables, batch.k_cache, 8)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32"):
        ops.plan_attention(batch.cu_seqlens_q.long(), batch.seqlens_k, batch.block_tables, batch.k_cache, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q must have batch"):
        ops.plan_attention(batch.cu_seqlens_q[:-1], batch.seqlens_k, batch.block_tables, batch.k_cache, 8)
    with pytest.raises(TypeError, match="plan must be an AttentionPlan"):
        ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8, plan="x")


def test_cpu_attention_accepts_a_matching_plan_and_rejects_a_stale_one() -> None:
    batch = make_batch([(1, 577), (17, 17), (37, 54)], group=4)
    plan = _plan(batch, num_ctas=8)
    want = ops.hybrid_attention(*batch.args())
    torch.testing.assert_close(ops.hybrid_attention(*batch.args(), plan=plan), want, rtol=0, atol=0)
    other = make_batch(GRIDS["decode"], group=4)
    stale = _plan(other, num_ctas=8)
    with pytest.raises(ValueError, match="plan was built for"):
        ops.hybrid_attention(*batch.args(), plan=stale)
    fresh = ops.AttentionPlan(max_batch=8, max_tokens=8, num_q_heads=8, num_kv_heads=2, head_dim=64, device="cpu")
    with pytest.raises(ValueError, match="plan has not been updated"):
        ops.hybrid_attention(*batch.args(), plan=fresh)

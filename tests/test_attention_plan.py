"""The attention planner, tested on the CPU for both kernels it plans for: coverage, split
sizes, capacity and index errors, and a float64 model of split-KV + log-sum-exp merging
that runs the plan's work list and must match the reference. (Load balance and stats are
in test_attention_plan_balance.py.)"""
from __future__ import annotations

import math

import pytest
import torch

from sarathi_rt import _C, ops
from sarathi_rt.ops import reference
from sarathi_rt.ops.attention_plan import ITEM_FIELDS, KERNELS, LAYOUT, MERGE_FIELDS, NARROW, WIDE

from attention_batches import GRIDS, make_batch, move_last_split

CHUNK = LAYOUT["keys_per_chunk"]
NARROW_ROWS = {"cuda": LAYOUT["narrow_rows"], "cpu": LAYOUT["cpu_direct_rows"]}


def _plan(batch, num_ctas: int, kernel: str = "cuda", **kw) -> ops.AttentionPlan:
    return ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                              batch.q.shape[1], num_ctas=num_ctas, kernel=kernel, **kw)


def _heads(entry: dict[str, int]) -> range:
    return range(entry["kv_head"], entry["kv_head"] + entry["num_heads"])


def _items(plan: ops.AttentionPlan) -> list[dict[str, int]]:
    return [dict(zip(ITEM_FIELDS, row)) for row in plan.work_items().tolist()]


def _merges(plan: ops.AttentionPlan) -> list[dict[str, int]]:
    return [dict(zip(MERGE_FIELDS, row)) for row in plan.merges().tolist()]


def _cost(item: dict[str, int]) -> int:
    """The CUDA cost model (attention_plan.h): per chunk 3 (narrow) or 6 (wide), plus 3 per item."""
    return math.ceil((item["kv_end"] - item["kv_begin"]) / CHUNK) * (6 if item["kind"] == WIDE else 3) + 3


def _rows(entry: dict[str, int]) -> int:
    """Partial rows of one piece: its rows for each of its KV heads."""
    return entry["num_heads"] * entry["num_rows"]


def _partial_row(start: int, entry: dict[str, int], h: int, r: int) -> int:
    """Pool row of head h, row r of a piece (or merge) whose rows start at `start`."""
    return start + (h - entry["kv_head"]) * entry["num_rows"] + r



# Block size only moves pages around, so it alternates with the grid size and kernel.
CASES = [(grid, group, block_size, ctas, kernel) for grid in GRIDS for group in (1, 4, 8)
         for block_size, ctas, kernel in ((16, 4, "cuda"), (32, 264, "cuda"), (3, 4, "cpu"))]


@pytest.mark.parametrize("grid,group,block_size,num_ctas,kernel", CASES)
def test_every_row_is_planned_once_with_all_its_keys(grid: str, group: int, block_size: int, num_ctas: int,
                                                     kernel: str) -> None:
    lengths = GRIDS[grid]
    batch = make_batch(lengths, block_size=block_size, group=group, num_kv_heads=3)
    plan = _plan(batch, num_ctas, kernel)
    items, merges = _items(plan), _merges(plan)
    num_kv_heads = batch.k_cache.shape[2]
    covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for it in items:
        q_len, kv_len = lengths[it["request"]]
        narrow = q_len * group <= NARROW_ROWS[kernel]
        assert it["causal_offset"] == kv_len - q_len
        assert it["num_rows"] <= (NARROW_ROWS[kernel] if narrow else 64)
        assert it["kind"] == (NARROW if narrow else WIDE)
        # CUDA tiles hold one KV head; CPU decode items may carry several (the planner picks).
        assert it["num_heads"] == 1 or (narrow and kernel == "cpu" and num_kv_heads % it["num_heads"] == 0)
        assert it["kv_begin"] % CHUNK == 0 and it["kv_begin"] < it["kv_end"]
        for h in _heads(it):
            for r in range(it["row_begin"], it["row_begin"] + it["num_rows"]):
                token, head = it["q_token0"] + r // group, h * group + r % group
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
    # Pieces tile the partial pool exactly: each owns num_heads * num_rows rows, none shared.
    pool = sorted((it["partial"], _rows(it)) for it in items if it["partial"] >= 0)
    assert [start for start, _ in pool] == [sum(n for _, n in pool[:i]) for i in range(len(pool))]
    assert sum(n for _, n in pool) == plan.partial_rows == sum(m["num_partials"] * _rows(m) for m in merges)


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
        pieces = sorted((it for it in _items(plan) if m["first_partial"] <= it["partial"] < m["first_partial"]
                         + m["num_partials"] * _rows(m)), key=lambda it: it["kv_begin"])
        assert len(pieces) == m["num_partials"]
        chunks = [math.ceil((it["kv_end"] - it["kv_begin"]) / CHUNK) for it in pieces]
        assert all(it["kv_begin"] % CHUNK == 0 for it in pieces)
        assert max(chunks) - min(chunks) <= 1  # whole chunks, spread evenly


def _lpt_max_load(costs: list[int], workers: int) -> int:
    loads = [0] * workers
    for c in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads)


def test_many_tiles_are_balanced_and_split_only_where_that_lowers_the_max_load() -> None:
    batch = make_batch([(1, 700 + 37 * i) for i in range(40)] + [(200, 900)], num_kv_heads=4, group=4)
    plan = _plan(batch, num_ctas=32)
    items = _items(plan)
    assert plan.stats()["load_efficiency"] >= 0.95
    # The unsplit tiles: whole items, and each split tile rebuilt from its pieces.
    tiles = [_cost(it) for it in items if it["partial"] < 0]
    for m in _merges(plan):
        pieces = [it for it in items if m["first_partial"] <= it["partial"] < m["first_partial"]
                  + m["num_partials"] * _rows(m)]
        tiles.append(_cost({**pieces[0], "kv_begin": 0, "kv_end": max(it["kv_end"] for it in pieces)}))
    assert plan.num_merges == 0 or plan.stats()["max_load"] < _lpt_max_load(tiles, 32)
    ranges = plan.cta_ranges().tolist()
    assert ranges[0] == 0 and ranges[-1] == len(items)
    loads = [sum(_cost(it) for it in items[a:b]) for a, b in zip(ranges, ranges[1:])]
    assert max(loads) <= sum(loads) / len(loads) + max(_cost(it) for it in items)
    for a, b in zip(ranges, ranges[1:]):  # each CTA runs its longest item first
        costs = [_cost(it) for it in items[a:b]]
        assert costs == sorted(costs, reverse=True)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            softcap: float | None = None) -> tuple[torch.Tensor, float]:
    """Softmax attention of one query row over `keys`, and its log2-domain log-sum-exp."""
    if keys.shape[0] == 0:  # a row that sees none of this piece's keys
        return torch.zeros(q.shape[0], dtype=torch.float64), -math.inf
    s = keys @ q * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s * math.log2(math.e)
    p = torch.exp2(s - s.max())
    return p @ values / p.sum(), float(s.max() + torch.log2(p.sum()))


def _run_plan_float64(plan: ops.AttentionPlan, batch, scale: float, softcap: float | None = None) -> torch.Tensor:
    """What the kernels compute, item by item, in float64 (log2-domain lse, as they do),
    each row masked to its window (the plan's) inside the item's keys."""
    q, k_cache, v_cache = (t.double() for t in (batch.q, batch.k_cache, batch.v_cache))
    group = q.shape[1] // k_cache.shape[2]
    out = torch.full_like(q, float("nan"))
    partials: dict[tuple[int, int, int], tuple[torch.Tensor, float]] = {}
    for it in _items(plan):
        keys = reference.gather_kv(k_cache, batch.block_tables[it["request"]], it["kv_end"])
        values = reference.gather_kv(v_cache, batch.block_tables[it["request"]], it["kv_end"])
        for h in _heads(it):
            for r in range(it["num_rows"]):
                flat = it["row_begin"] + r
                token, head = it["q_token0"] + flat // group, h * group + flat % group
                visible = it["causal_offset"] + flat // group + 1
                limit = min(it["kv_end"], visible)
                start = max(it["kv_begin"], visible - plan.window if plan.window else 0)
                o, lse = _attend(q[token, head], keys[start:limit, h], values[start:limit, h], scale, softcap)
                if it["partial"] < 0:
                    out[token, head] = o
                else:
                    partials[_partial_row(it["partial"], it, h, r)] = o, lse
    for m in _merges(plan):
        for h in _heads(m):
            for r in range(m["num_rows"]):
                pieces = [partials[_partial_row(m["first_partial"], m, h, r) + s * _rows(m)]
                          for s in range(m["num_partials"])]
                lses = torch.tensor([lse for _, lse in pieces], dtype=torch.float64)
                w = torch.exp2(lses - lses.max())
                flat = m["row_begin"] + r
                out[m["q_token0"] + flat // group, h * group + flat % group] = (
                    sum(wi * o for wi, (o, _) in zip(w, pieces)) / w.sum())
    return out


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_float64_model_covers_skewed_splits(kernel: str) -> None:
    """The balanced splits of long contexts among short ones, wide tiles split on CUDA, and
    (CPU) pieces of items that span every KV head."""
    lengths = [(1, 40), (1, 3000), (1, 75), (2, 2200), (12, 1100), (1, 1)]
    batch = make_batch(lengths, group=4, block_size=17, head_dim=8, num_kv_heads=2)
    plan = _plan(batch, num_ctas=6 if kernel == "cuda" else 3, kernel=kernel)
    items = _items(plan)
    assert plan.num_merges >= 2 and max(it["kv_begin"] for it in items) >= 1024
    assert kernel == "cuda" or any(it["num_heads"] == 2 and it["partial"] >= 0 for it in items)
    got = _run_plan_float64(plan, batch, scale=0.3)
    want = reference.hybrid_attention(*batch.args(), scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# (kernel, lengths, workers): move_last_split makes the last piece of the first request's
# tile start past its first query's causal limit (1279 keys of 1282; 17408 of 17409).
FULLY_MASKED = [("cuda", [(4, 1282), (1, 30)], 64), ("cpu", [(2, 17409), (1, 30)], 64)]


@pytest.mark.slow
@pytest.mark.parametrize("kernel, lengths, num_ctas", FULLY_MASKED, ids=[c[0] for c in FULLY_MASKED])
def test_float64_model_covers_rows_fully_masked_in_a_split_piece(kernel: str, lengths, num_ctas: int) -> None:
    batch = make_batch(lengths, group=4, head_dim=8, num_kv_heads=2)
    plan = _plan(batch, num_ctas=num_ctas, kernel=kernel)
    move_last_split(plan, 0, lengths[0][1] - lengths[0][0] + 1)
    assert any(it["partial"] >= 0 and it["causal_offset"] + 1 <= it["kv_begin"] for it in _items(plan))
    got = _run_plan_float64(plan, batch, scale=0.3)
    torch.testing.assert_close(got, reference.hybrid_attention(*batch.args(), scale=0.3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("window", [40, 1000, 2500])
def test_float64_model_covers_windowed_splits(kernel: str, window: int) -> None:
    """Windowed tiles cut into pieces inside the window (pieces that start mid-context),
    rows whose window ends before a piece does or starts after it, and a soft cap."""
    lengths = [(1, 3000), (12, 4000), (70, 2600), (1, 30), (3, 3)]
    batch = make_batch(lengths, group=4, block_size=16, head_dim=8, num_kv_heads=2)
    plan = _plan(batch, num_ctas=64, kernel=kernel, window=window)
    items = _items(plan)
    assert min(it["kv_begin"] for it in items if it["request"] == 1) >= 4000 - 12 - window - CHUNK
    min_piece = LAYOUT["min_split_chunks" if kernel == "cuda" else "cpu_min_split_chunks"] * CHUNK
    assert plan.num_merges > 0 or window < 2 * min_piece  # windows with room for two pieces are split
    got = _run_plan_float64(plan, batch, scale=0.3, softcap=2.0)
    want = reference.hybrid_attention(*batch.args(), scale=0.3, window=window, softcap=2.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_plan_keeps_its_buffers_across_steps() -> None:
    plan = ops.AttentionPlan(max_batch=8, max_tokens=700, num_q_heads=8, num_kv_heads=2, head_dim=64,
                             device="cpu", num_ctas=16)
    address = plan.buffer.data_ptr()
    for grid in GRIDS.values():
        batch = make_batch(grid, group=4)
        ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8, plan=plan)
        assert plan.num_items > 0 and plan.batch == len(grid)
        assert torch.equal(plan.buffer, plan._host)
    assert plan.buffer.data_ptr() == address


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
                                tuple(batch.k_cache.shape), [1, 1, 1, 4, KERNELS["cuda"]])
    with pytest.raises(ValueError, match="max_batch must be positive"):
        ops.AttentionPlan(max_batch=0, max_tokens=1, num_q_heads=8, num_kv_heads=2, head_dim=64, device="cpu")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.AttentionPlan(max_batch=1, max_tokens=1, num_q_heads=6, num_kv_heads=4, head_dim=64, device="cpu")
    with pytest.raises(ValueError, match="kernel must be one of"):
        ops.AttentionPlan(max_batch=1, max_tokens=1, num_q_heads=8, num_kv_heads=2, head_dim=64, device="cpu",
                          kernel="tpu")
    with pytest.raises(ValueError, match="plan has not been updated"):
        plan.stats()


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


def test_cpu_attention_runs_its_plan_and_rejects_a_stale_or_foreign_one() -> None:
    batch = make_batch([(1, 577), (17, 17), (37, 54)], group=4)
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8)
    assert plan.kernel == "cpu" and plan.buffer is plan._host  # nothing to copy on the CPU
    want = ops.hybrid_attention(*batch.args())  # plans internally, for the same workers
    torch.testing.assert_close(ops.hybrid_attention(*batch.args(), plan=plan), want, rtol=0, atol=0)
    other = make_batch(GRIDS["decode"], group=4)
    stale = _plan(other, num_ctas=8, kernel="cpu")
    with pytest.raises(ValueError, match="plan was built for"):
        ops.hybrid_attention(*batch.args(), plan=stale)
    # Same shapes, other lengths: only the plan's items can tell.
    swapped = make_batch([(1, 54), (17, 17), (37, 577)], group=4)
    assert swapped.block_tables.shape == batch.block_tables.shape and swapped.k_cache.shape == batch.k_cache.shape
    with pytest.raises(ValueError, match="plan does not match this call"):
        ops.hybrid_attention(*swapped.args(), plan=plan)
    with pytest.raises(ValueError, match="plan was built for kernel cuda but this call has cpu"):
        ops.hybrid_attention(*batch.args(), plan=_plan(batch, num_ctas=8, kernel="cuda"))
    fresh = ops.AttentionPlan(max_batch=8, max_tokens=8, num_q_heads=8, num_kv_heads=2, head_dim=64, device="cpu")
    with pytest.raises(ValueError, match="plan has not been updated"):
        ops.hybrid_attention(*batch.args(), plan=fresh)
    with pytest.raises(ValueError, match="plan was made for the cpu kernel"):
        ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8, plan=plan,
                           kernel="cuda")

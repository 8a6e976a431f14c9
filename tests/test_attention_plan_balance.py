"""Load balance of the attention planner on skewed batches (planned on the CPU for a
264-CTA GPU, as on an H100/H200): every CTA's cost near total / num_ctas under the
planner's cost model, fixed capacities across steps, and honest stats."""
from __future__ import annotations

import math

import pytest
import torch

from sarathi_rt import ops
from sarathi_rt.ops import reference
from sarathi_rt.ops.attention_plan import ITEM_FIELDS, LAYOUT, WIDE

CHUNK = LAYOUT["keys_per_chunk"]
NUM_CTAS = 264


def _uniform(n: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# The batches of the balance target: (q_len, kv_len) per request.
SKEWED = {
    "63x512 + 1x32k": [(1, 512)] * 63 + [(1, 32768)],
    "40x4k": [(1, 4096)] * 40,
    "256 x U(100, 8k)": [(1, kv) for kv in _uniform(256, 100, 8192, seed=0)],
    "2k prefill + 100 x U(1k, 16k)": [(2048, 2048)] + [(1, kv) for kv in _uniform(100, 1024, 16384, seed=1)],
}


def _batch(lengths: list[tuple[int, int]]) -> reference.PagedBatch:
    """Index arrays of the batch and an unfilled cache: the planner reads no keys. 32 query
    heads on 8 KV heads (Llama-3-8B's attention); head_dim does not matter to the plan."""
    block = 16
    pages = [-(-kv // block) for _, kv in lengths]
    tables = torch.full((len(lengths), max(pages)), -1, dtype=torch.int32)
    for b, n in enumerate(pages):
        tables[b, :n] = torch.arange(sum(pages[:b]), sum(pages[:b]) + n, dtype=torch.int32)
    cu = torch.tensor([0] + [q for q, _ in lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    k_cache = torch.empty(sum(pages), block, 8, 2)
    return reference.PagedBatch(torch.empty(int(cu[-1]), 32, 2), k_cache, k_cache, cu,
                                torch.tensor([kv for _, kv in lengths], dtype=torch.int32), tables)


def _cuda_cost(item: dict[str, int]) -> int:
    """The CUDA cost model (attention_plan.h): per chunk 3 (narrow) or 6 (wide), plus 3 per item."""
    return math.ceil((item["kv_end"] - item["kv_begin"]) / CHUNK) * (6 if item["kind"] == WIDE else 3) + 3


@pytest.fixture(scope="module")
def shared_plan() -> ops.AttentionPlan:
    """One plan sized for every batch above, reused like a runner's plan across steps."""
    return ops.AttentionPlan(max_batch=256, max_tokens=2200, num_q_heads=32, num_kv_heads=8, head_dim=2,
                             device="cpu", dtype=torch.float32, num_ctas=NUM_CTAS, kernel="cuda")


@pytest.mark.parametrize("name", list(SKEWED))
def test_skewed_batches_keep_every_cta_near_its_share(name: str, shared_plan: ops.AttentionPlan) -> None:
    batch = _batch(SKEWED[name])
    address, pool_rows = shared_plan.buffer.data_ptr(), shared_plan.partial_out.shape[0]
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 32,
                              plan=shared_plan)
    assert plan.buffer.data_ptr() == address  # the work list has a fixed capacity
    stats = plan.stats()
    assert plan.partial_out.shape[0] == plan.partial_lse.shape[0] == max(pool_rows, stats["partial_rows"])  # grows
    items = [dict(zip(ITEM_FIELDS, row)) for row in plan.work_items().tolist()]
    ranges = plan.cta_ranges().tolist()
    loads = [sum(_cuda_cost(it) for it in items[a:b]) for a, b in zip(ranges, ranges[1:])]
    assert stats["num_items"] == len(items) and stats["max_load"] == max(loads)
    assert stats["mean_load"] == pytest.approx(sum(loads) / NUM_CTAS)
    assert stats["load_efficiency"] == pytest.approx(sum(loads) / NUM_CTAS / max(loads))
    assert stats["load_efficiency"] >= 0.9, stats
    # No single item is longer than a CTA's share: long tiles were split.
    assert max(_cuda_cost(it) for it in items) <= 1.1 * stats["mean_load"]
    assert stats["num_splits"] == plan.num_merges and stats["partial_rows"] <= plan.capacity.max_partial_rows
    assert stats["partial_bytes"] == stats["partial_rows"] * 4 * (plan.head_dim + 1)


def test_the_long_context_is_split_and_uniform_decodes_fill_whole_waves() -> None:
    one_long = _batch(SKEWED["63x512 + 1x32k"])
    plan = ops.plan_attention(one_long.cu_seqlens_q, one_long.seqlens_k, one_long.block_tables, one_long.k_cache,
                              32, num_ctas=NUM_CTAS, kernel="cuda")
    items = [dict(zip(ITEM_FIELDS, row)) for row in plan.work_items().tolist()]
    assert plan.stats()["num_splits"] == 8  # the 32k request's tile of each KV head
    assert all(it["partial"] >= 0 for it in items if it["request"] == 63)
    assert all(it["partial"] < 0 for it in items if it["request"] < 63)  # short tiles stay whole
    # 320 equal tiles on 264 CTAs would leave 2 waves for 1.2 waves of work; pieces fix that.
    uniform = _batch(SKEWED["40x4k"])
    plan = ops.plan_attention(uniform.cu_seqlens_q, uniform.seqlens_k, uniform.block_tables, uniform.k_cache, 32,
                              num_ctas=NUM_CTAS, kernel="cuda")
    stats = plan.stats()
    assert stats["num_items"] > 320 and stats["load_efficiency"] >= 0.9


def test_cpu_plans_balance_threads_the_same_way() -> None:
    batch = _batch([(1, 600)] * 5 + [(1, 16384)])
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 32,
                              num_ctas=4, kernel="cpu")
    stats = plan.stats()
    items = [dict(zip(ITEM_FIELDS, row)) for row in plan.work_items().tolist()]
    assert stats["num_workers"] == 4 and stats["load_efficiency"] >= 0.9
    assert all(8 % it["num_heads"] == 0 for it in items)  # decodes: the planner picks the heads per item
    pieces = [it for it in items if it["partial"] >= 0]
    assert len(pieces) >= 3 and all(it["request"] == 5 for it in pieces)
    assert min(it["kv_end"] - it["kv_begin"] for it in pieces) >= LAYOUT["cpu_min_split_chunks"] * CHUNK
    assert stats["partial_pool_bytes"] == 0 and stats["partial_bytes"] > 0  # allocated per call


def test_cpu_plans_split_kv_heads_where_keys_cannot_be() -> None:
    """One decode too short to cut into key ranges (< 2 x 1024 keys) still fills the
    workers: its KV heads go to separate items, with no merge."""
    batch = _batch([(1, 1500)])
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 32,
                              num_ctas=4, kernel="cpu")
    items = [dict(zip(ITEM_FIELDS, row)) for row in plan.work_items().tolist()]
    assert len(items) == 4 and all(it["num_heads"] == 2 and it["partial"] < 0 for it in items)
    assert plan.stats()["load_efficiency"] == 1.0


def test_a_single_short_decode_is_planned_fast_and_reported_honestly() -> None:
    """Nothing can fill 528 CTAs with one 16-key decode: one item per KV head, and stats()
    says so instead of hiding it."""
    batch = _batch([(1, 16)])
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 32,
                              num_ctas=528, kernel="cuda")
    stats = plan.stats()
    assert stats["num_items"] == 8 and stats["num_splits"] == 0 and stats["partial_rows"] == 0
    assert stats["max_load"] == _cuda_cost({"kv_begin": 0, "kv_end": 16, "kind": 0})
    assert stats["load_efficiency"] == pytest.approx(8 / 528)

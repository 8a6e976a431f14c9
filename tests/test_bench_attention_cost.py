"""The GPU check of the attention cost model (bench/bench_attention_cost.py), on the CPU:
its batches give every CTA the item shape it names, and its fit recovers the model from
timings that follow it and flags timings that do not (fake timings: no GPU here)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sarathi_rt import ops
from sarathi_rt.ops.attention_plan import ITEM_FIELDS, NARROW, WIDE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_attention_cost import (BOUNDS, CHUNK, KINDS, Layout, Point, costliest_cta, shape_lengths,  # noqa: E402
                                  summary_rows)

CTAS = 264
CHUNKS = [1, 2, 4, 8, 16, 32, 64]
PER_CTA = [1, 4]


def _index_batch(lengths: list[tuple[int, int]], lay: Layout):
    """Index arrays and an unfilled cache (the planner reads no keys; pages may be shared)."""
    pages = -(-lengths[0][1] // lay.block_size)
    cu = torch.tensor([0] + [q for q, _ in lengths]).cumsum(0).to(torch.int32)
    seqlens = torch.tensor([kv for _, kv in lengths], dtype=torch.int32)
    tables = torch.arange(pages, dtype=torch.int32).expand(len(lengths), -1).contiguous()
    return cu, seqlens, tables, torch.empty(pages, lay.block_size, lay.kv_heads, lay.head_dim, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def points() -> list[Point]:
    """The GPU run's shapes, planned here for a 264-CTA grid."""
    lay, out = Layout(), []
    for kind in KINDS:
        for c in CHUNKS:
            for k in PER_CTA:
                plan = ops.plan_attention(*_index_batch(shape_lengths(kind, c, k, CTAS, lay.kv_heads), lay),
                                          lay.q_heads, num_ctas=CTAS, kernel="cuda")
                stats = plan.stats()
                ranges = plan.cta_ranges()
                # Every CTA runs exactly k whole items of the kind, c chunks each.
                assert stats["num_splits"] == 0 and torch.equal(ranges[1:] - ranges[:-1], torch.full((CTAS,), k))
                col = dict(zip(ITEM_FIELDS, plan.work_items().T))
                assert set(col["kind"].tolist()) == {NARROW if kind == "narrow" else WIDE}
                assert set(((col["kv_end"] - col["kv_begin"] + CHUNK - 1) // CHUNK).tolist()) == {c}
                out.append(Point(kind, c, k, *costliest_cta(plan)))
                assert (out[-1].items, out[-1].chunk_heads) == (k, k * c)
    return out


def _by_metric(rows: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {r["metric"]: r for r in rows}


def test_timings_that_follow_the_model_match_it(points: list[Point]) -> None:
    for p in points:
        p.ms = 0.004 + 0.0009 * p.cost  # launch plus a fixed time per cost unit
    rows = _by_metric(summary_rows(points))
    assert rows["chunk_wide / chunk_narrow"]["baseline_value"] == pytest.approx(2.0)  # 6 vs 3 per chunk
    assert rows["item_narrow / chunk_narrow"]["baseline_value"] == pytest.approx(1.0)
    for name in BOUNDS:
        assert rows[name]["ratio"] == pytest.approx(1.0, abs=1e-3)
    assert rows["worst time / model"]["ratio"] == pytest.approx(1.0, abs=1e-3)


def test_timings_off_the_model_are_flagged(points: list[Point]) -> None:
    """A GPU on which a wide chunk costs 3x a narrow one (the model says 2x) and items cost
    nothing fixed: the ratios leave their bounds and some shape misses its prediction."""
    for p in points:
        per_chunk = 0.003 if p.kind == "narrow" else 0.009
        p.ms = 0.004 + per_chunk * p.chunk_heads
    rows = _by_metric(summary_rows(points))
    low, high = BOUNDS["chunk_wide / chunk_narrow"]
    assert rows["chunk_wide / chunk_narrow"]["ratio"] == pytest.approx(1.5, abs=1e-3) and not low <= 1.5 <= high
    assert rows["item_narrow / chunk_narrow"]["ratio"] == pytest.approx(0.0, abs=1e-3)
    assert abs(rows["worst time / model"]["ratio"] - 1.0) > 0.25

"""The attention planner's cost model (csrc/include/sarathi_rt/attention_plan.h) against the
CUDA kernel's time, per work-item shape.

Each batch holds items of one kind (narrow: decodes, 4 query rows per KV head; wide:
16-token chunks, 64 rows per KV head) with `chunks` 64-key chunks each, `per_cta` items per
CTA (32 query heads on 8 KV heads, head_dim 128, bf16; every request on pages of its own,
so keys come from HBM, not L2). A launch is timed inside a CUDA graph (no host launch
cost in the time), and the times are fitted per kind over the costliest CTA as

    time = launch + item * items + chunk * chunk_heads

The same fit of the planner's own cost of each plan (stats()["max_load"]) gives the model's
coefficients, and the table compares the ratios the model rests on: chunk_wide /
chunk_narrow (a wide chunk's MMA row tiles vs a narrow one's) and item / chunk_narrow (the
fixed per-item overhead). attention_plan.h's bounds: the measured ratio within 0.75..1.25
and 0.5..2 of the model's. It also prints, per shape, measured time / the time the model
predicts once one launch time and one scale (us per cost unit) are fitted to all shapes.

    python bench/bench_attention_cost.py [--summary FILE] [--smoke]

--smoke: tiny shapes planned for and run by the CPU kernel (no claims; the quick lane).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from sarathi_rt import ops
from sarathi_rt.ops.attention import run_attention
from sarathi_rt.ops.attention_plan import ITEM_FIELDS, LAYOUT

CHUNK = LAYOUT["keys_per_chunk"]
KINDS = {"narrow": 1, "wide": 16}  # query tokens per request: 4 or 64 rows per KV head at group 4
# Bounds on measured / model of each ratio (attention_plan.h: 1.5..2.5 for a model ratio of 2,
# 0.5..2 for a model ratio of 1).
BOUNDS = {"chunk_wide / chunk_narrow": (0.75, 1.25), "item_narrow / chunk_narrow": (0.5, 2.0),
          "item_wide / chunk_narrow": (0.5, 2.0)}


@dataclass(frozen=True)
class Layout:
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass
class Point:
    kind: str
    chunks: int
    per_cta: int
    items: int        # on the costliest CTA
    chunk_heads: int  # sum over its items of chunks x KV heads
    cost: int         # the plan's max_load (planner's cost units)
    ms: float = 0.0


def shape_lengths(kind: str, chunks: int, per_cta: int, workers: int, kv_heads: int) -> list[tuple[int, int]]:
    """(q_len, kv_len) of a batch whose plan gives every worker `per_cta` items of one kind
    (a request is one item per KV head) with `chunks` chunks each: equal items that fill
    whole waves, which the planner keeps whole."""
    q_len = KINDS[kind]
    return [(q_len, chunks * CHUNK)] * -(-workers * per_cta // kv_heads)


def costliest_cta(plan: ops.AttentionPlan) -> tuple[int, int, int]:
    """(items, chunk-heads, cost) of the plan's costliest worker."""
    items = plan.work_items().long()
    col = {name: items[:, i] for i, name in enumerate(ITEM_FIELDS)}
    chunk_heads = ((col["kv_end"] - col["kv_begin"] + CHUNK - 1) // CHUNK) * col["num_heads"]
    ranges = plan.cta_ranges().tolist()
    worst = max(range(len(ranges) - 1), key=lambda w: int(chunk_heads[ranges[w]:ranges[w + 1]].sum()))
    lo, hi = ranges[worst], ranges[worst + 1]
    return hi - lo, int(chunk_heads[lo:hi].sum()), plan.stats()["max_load"]


def fit(points: list[Point], value: Callable[[Point], float]) -> tuple[float, float, float]:
    """Least squares (launch, item, chunk) of value = launch + item * items + chunk * chunk_heads."""
    x = torch.tensor([[1.0, p.items, p.chunk_heads] for p in points], dtype=torch.float64)
    y = torch.tensor([[value(p)] for p in points], dtype=torch.float64)
    launch, item, chunk = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    return launch, item, chunk


def model_ratios(points: list[Point], value: Callable[[Point], float]) -> dict[str, float]:
    narrow = fit([p for p in points if p.kind == "narrow"], value)
    wide = fit([p for p in points if p.kind == "wide"], value)
    return {"chunk_wide / chunk_narrow": wide[2] / narrow[2], "item_narrow / chunk_narrow": narrow[1] / narrow[2],
            "item_wide / chunk_narrow": wide[1] / narrow[2]}


def predicted_ms(points: list[Point]) -> list[float]:
    """Each point's time under the model: launch + scale * cost, both fitted to all points."""
    x = torch.tensor([[1.0, p.cost] for p in points], dtype=torch.float64)
    y = torch.tensor([[p.ms] for p in points], dtype=torch.float64)
    launch, scale = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    return [launch + scale * p.cost for p in points]


def summary_rows(points: list[Point]) -> list[dict[str, object]]:
    """One row per ratio of the model (measured vs the model's own), then the worst shape."""
    measured, model = model_ratios(points, lambda p: p.ms), model_ratios(points, lambda p: p.cost)
    rows = []
    for name, (low, high) in BOUNDS.items():
        rows.append(row("cost model", name, measured[name], "model", model[name], measured[name] / model[name],
                        f"{low}..{high}"))
    ratios = [p.ms / want for p, want in zip(points, predicted_ms(points))]
    worst = max(range(len(points)), key=lambda i: abs(ratios[i] - 1.0))
    p = points[worst]
    rows.append(row(f"{p.kind} {p.chunks} chunks x {p.per_cta}/CTA", "worst time / model", p.ms, "model fit",
                    p.ms / ratios[worst], ratios[worst], "0.8..1.25"))
    return rows


def row(case: str, metric: str, value: float, baseline: str, base_value: float, ratio: float,
        target: str) -> dict[str, object]:
    return dict(bench="attention cost", case=case, metric=metric, value=round(value, 4), unit="", baseline=baseline,
                baseline_value=round(base_value, 4), ratio=round(ratio, 3), target=target)


def make_batch(lengths: list[tuple[int, int]], lay: Layout, dtype: torch.dtype, device: torch.device):
    """q, caches and index arrays with every request on consecutive pages of its own."""
    pages = -(-lengths[0][1] // lay.block_size)
    batch = len(lengths)
    k = torch.randn(batch * pages, lay.block_size, lay.kv_heads, lay.head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(sum(n for n, _ in lengths), lay.q_heads, lay.head_dim, device=device).to(dtype)
    cu = torch.tensor([0] + [n for n, _ in lengths], device=device).cumsum(0).to(torch.int32)
    seqlens = torch.tensor([kv for _, kv in lengths], dtype=torch.int32, device=device)
    tables = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
    return q, k, v, cu, seqlens, tables


def time_ms(run: Callable[[], None], device: torch.device, reps: int = 15, inner: int = 10) -> float:
    """Median per-launch time: on CUDA of `inner` launches replayed from one graph."""
    run()
    if device.type != "cuda":  # the smoke path: host time, no claims
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            run()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def measure(lay: Layout, chunks: list[int], per_cta: list[int], device: torch.device, kernel: str,
            workers: int | None) -> list[Point]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if workers is None:  # the kernel's persistent grid on this GPU
        workers = ops.AttentionPlan(max_batch=1, max_tokens=1, num_q_heads=lay.q_heads, num_kv_heads=lay.kv_heads,
                                    head_dim=lay.head_dim, device=device, dtype=dtype).capacity.num_ctas
    points = []
    for kind in KINDS:
        for c in chunks:
            for k in per_cta:
                lengths = shape_lengths(kind, c, k, workers, lay.kv_heads)
                q, kc, vc, cu, seqlens, tables = make_batch(lengths, lay, dtype, device)
                plan = ops.plan_attention(cu, seqlens, tables, kc, lay.q_heads, num_ctas=workers, kernel=kernel)
                out = torch.empty_like(q)
                scale = lay.head_dim ** -0.5
                ms = time_ms(lambda: run_attention(plan, q, kc, vc, cu, seqlens, tables, scale, out), device)
                points.append(Point(kind, c, k, *costliest_cta(plan), ms=ms))
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes through the CPU kernel (no claims)")
    ap.add_argument("--summary", help="append the summary rows as JSON lines to this file")
    args = ap.parse_args()
    if args.smoke:
        lay, chunks, per_cta = Layout(q_heads=4, kv_heads=1, head_dim=16), [1, 2, 4], [1, 2]
        points = measure(lay, chunks, per_cta, torch.device("cpu"), "cpu", 2)
    else:
        lay, chunks, per_cta = Layout(), [1, 2, 4, 8, 16, 32, 64], [1, 4]
        points = measure(lay, chunks, per_cta, torch.device("cuda"), "cuda", None)
    print(f"# {lay}; time per launch (ms) of the costliest CTA's items and chunk-heads")
    print(f"{'kind':<7} {'chunks':>6} {'per CTA':>7} {'items':>5} {'chunk-heads':>11} {'cost':>6} {'ms':>9} "
          f"{'/ model':>8}")
    for p, want in zip(points, predicted_ms(points)):
        print(f"{p.kind:<7} {p.chunks:>6} {p.per_cta:>7} {p.items:>5} {p.chunk_heads:>11} {p.cost:>6} "
              f"{p.ms:>9.4f} {p.ms / want:>8.3f}")
    rows = summary_rows(points)
    for r in rows:
        print(f"{r['case']:<28} {r['metric']:<28} {r['value']:>9} vs {r['baseline']} {r['baseline_value']:>8}  "
              f"ratio {r['ratio']:>6}  (target {r['target']})")
    if args.summary:
        with open(args.summary, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()

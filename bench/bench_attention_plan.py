"""Load balance of the attention planner, planned on this CPU for a GPU grid (default 264
CTAs: 132 SMs x 2, an H100/H200) and for this machine's CPU kernel.

First the named skewed batches (32 query heads on 8 KV heads): work items, split tiles,
partial rows and their MB at head_dim 128, load efficiency (mean / max worker cost under the planner's cost
model) and the host time of one plan update (median). Then the distribution of the
property test (tests/test_attention_plan_property.py: random decode-only and mixed
batches, six head layouts): min, p5 and median load efficiency per CTA count, over the
batches with >= 4096 key-head pairs per CTA (target: p5 >= 0.90, min >= 0.80), and the
partial-result memory each plan needs (its CUDA pool) against the fixed pool of 512 rows
per CTA every plan held before.

    python bench/bench_attention_plan.py [--num-ctas 264] [--iters 50] [--batches 500] [--smoke]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from sarathi_rt import _C, ops
from sarathi_rt.ops import reference
from sarathi_rt.ops.attention_plan import KERNELS, LAYOUT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_attention_plan_property import CTAS, MIN_PAIRS_PER_CTA, index_tensors, random_batch  # noqa: E402

Q_HEADS, KV_HEADS, BLOCK = 32, 8, 16


def batches(seed: int) -> dict[str, list[tuple[int, int]]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "63 x 512 + 1 x 32k decodes": [(1, 512)] * 63 + [(1, 32768)],
        "40 x 4k decodes": [(1, 4096)] * 40,
        "256 decodes, U(100, 8k)": [(1, kv) for kv in torch.randint(100, 8193, (256,), generator=g).tolist()],
        "2k prefill + 100 x U(1k, 16k)": [(2048, 2048)] + [(1, kv) for kv in
                                                          torch.randint(1024, 16385, (100,), generator=g).tolist()],
        "uniform 64 x 2k decodes": [(1, 2048)] * 64,
    }


def index_batch(lengths: list[tuple[int, int]]) -> reference.PagedBatch:
    """Index arrays and an unfilled cache: planning reads no keys."""
    pages = [-(-kv // BLOCK) for _, kv in lengths]
    tables = torch.full((len(lengths), max(pages)), -1, dtype=torch.int32)
    for b, n in enumerate(pages):
        tables[b, :n] = torch.arange(sum(pages[:b]), sum(pages[:b]) + n, dtype=torch.int32)
    cu = torch.tensor([0] + [q for q, _ in lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    cache = torch.empty(sum(pages), BLOCK, KV_HEADS, 2)
    return reference.PagedBatch(torch.empty(int(cu[-1]), Q_HEADS, 2), cache, cache, cu,
                                torch.tensor([kv for _, kv in lengths], dtype=torch.int32), tables)


def partial_mb(kernel: str, rows: int) -> float:
    return _C.attention_partial_bytes(KERNELS[kernel], 128, rows) / 1e6


def distribution(seed: int, count: int) -> None:
    """Plans every batch of the property test's distribution for each CTA count."""
    rng = random.Random(seed)
    effs: dict[int, list[float]] = {c: [] for c in CTAS}
    times: list[float] = []
    memory: list[float] = []  # partial bytes / the old fixed pool
    for _ in range(count):
        lengths, (q_heads, kv_heads, head_dim), _ = random_batch(rng)
        tensors = index_tensors(lengths, kv_heads, head_dim)
        for ctas in CTAS:
            if sum(kv for _, kv in lengths) * kv_heads < MIN_PAIRS_PER_CTA * ctas:
                continue
            plan = ops.plan_attention(*tensors, q_heads, num_ctas=ctas, kernel="cuda")
            start = time.perf_counter()  # planning again into the same buffers, as a runner's step does
            plan.update(*tensors)
            times.append(time.perf_counter() - start)
            stats = plan.stats()
            effs[ctas].append(stats["load_efficiency"])
            memory.append(stats["partial_bytes"] / (LAYOUT["partial_rows_per_worker"] * ctas * 4 * (head_dim + 1)))
    print(f"\ndistribution: {count} random batches (seed {seed}), those with >= {MIN_PAIRS_PER_CTA} "
          f"key-head pairs per CTA")
    print(f"{'CTAs':>5} {'batches':>8} {'min':>6} {'p5':>6} {'median':>7}")
    for ctas, e in effs.items():
        if not e:
            continue
        e.sort()
        print(f"{ctas:>5} {len(e):>8} {e[0]:>6.3f} {e[len(e) // 20]:>6.3f} {statistics.median(e):>7.3f}")
    if times:
        print(f"plan update host time: median {1e3 * statistics.median(times):.3f} ms, "
              f"p95 {1e3 * sorted(times)[len(times) * 19 // 20]:.3f} ms, max {1e3 * max(times):.2f} ms")
        memory.sort()
        print(f"partial memory / the old fixed pool (512 rows per CTA): median {statistics.median(memory):.4f}, "
              f"p95 {memory[len(memory) * 19 // 20]:.3f}, max {memory[-1]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-ctas", type=int, default=264)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batches", type=int, default=500, help="random batches of the distribution")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code paths")
    args = ap.parse_args()
    if args.smoke:
        args.iters, args.batches = 2, 12
    # Partial memory at head_dim 128 (the index batches here have head_dim 2: planning reads no keys).
    print(f"{'batch':<32} {'kernel':<6} {'workers':>7} {'items':>6} {'splits':>6} {'p.rows':>7} {'p.MB':>6} "
          f"{'load eff':>8} {'plan ms':>8}")
    worst = 1.0
    for name, lengths in batches(args.seed).items():
        b = index_batch(lengths)
        for kernel, workers in (("cuda", args.num_ctas), ("cpu", None)):
            plan = ops.plan_attention(b.cu_seqlens_q, b.seqlens_k, b.block_tables, b.k_cache, Q_HEADS,
                                      num_ctas=workers, kernel=kernel)
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                plan.update(b.cu_seqlens_q, b.seqlens_k, b.block_tables, b.k_cache)
                times.append(time.perf_counter() - start)
            s = plan.stats()
            if kernel == "cuda":
                worst = min(worst, s["load_efficiency"])
            print(f"{name:<32} {kernel:<6} {s['num_workers']:>7} {s['num_items']:>6} {s['num_splits']:>6} "
                  f"{s['partial_rows']:>7} {partial_mb(kernel, s['partial_rows']):>6.2f} {s['load_efficiency']:>8.3f} "
                  f"{1e3 * statistics.median(times):>8.3f}")
    print(f"worst GPU-grid load efficiency {worst:.3f} (target >= 0.9)")
    distribution(args.seed, args.batches)


if __name__ == "__main__":
    main()

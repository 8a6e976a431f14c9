"""Load balance of the attention planner on skewed batches, planned on this CPU for a GPU
grid (default 264 CTAs: 132 SMs x 2, an H100/H200) and for this machine's CPU kernel.

For each batch: work items, split tiles, partial slots, load efficiency (mean / max
worker cost under the planner's cost model; target >= 0.9 on the GPU grid) and the
host time of one plan update (median). Batches use 32 query heads on 8 KV heads.

    python bench/bench_attention_plan.py [--num-ctas 264] [--iters 50]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from sarathi_rt import ops
from sarathi_rt.ops import reference

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-ctas", type=int, default=264)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{'batch':<32} {'kernel':<6} {'workers':>7} {'items':>6} {'splits':>6} {'partials':>8} "
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
                  f"{s['num_partials']:>8} {s['load_efficiency']:>8.3f} {1e3 * statistics.median(times):>8.3f}")
    print(f"worst GPU-grid load efficiency {worst:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()

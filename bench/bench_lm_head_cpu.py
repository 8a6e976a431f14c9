"""The LM head on the CPU: our streamed-weight kernel (what `ops.linear` runs for weights
of 16 MiB and more) against torch's GEMM on the same rows padded to 16 (the batch-invariant
way `ops.linear` calls torch for smaller weights), on SmolLM2-135M's head ([49152, 576]),
one thread, float32 and bfloat16, at decode batches of 1 to 128 rows.

    python bench/bench_lm_head_cpu.py [--rows 1,16,64,128] [--repeats 7] [--smoke]

Each repeat times both sides back to back (alternating which goes first), so the VM's
drift falls on both; it prints the medians, the weight's read rate and FLOP rate of ours,
and the ratio ours / torch (below 1: ours is faster).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from sarathi_rt.ops.linear import apply_linear

ROW_TILE = 16  # ops.linear pads torch's rows to this, for batch invariance


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--rows", default="1,16,64,128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = ap.parse_args()
    if args.smoke:
        args.vocab, args.rows, args.repeats = 8192, "1,17", 2  # 8192 x 576 float32 is 18 MiB: still streamed
    torch.set_num_threads(1)
    print(f"LM head [{args.vocab}, {args.hidden}], 1 thread, {args.repeats} alternating repeats, "
          f"load {os.getloadavg()[0]:.1f}")
    print(" dtype    | rows | ours ms | torch ms | ours GB/s | ours GFLOP/s | ours / torch")
    for dtype in (torch.float32, torch.bfloat16):
        weight = (torch.randn(args.vocab, args.hidden) / args.hidden ** 0.5).to(dtype)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden).to(dtype)
            padded = torch.cat([x, x.new_zeros(-rows % ROW_TILE, args.hidden)])
            ours, theirs = [], []
            for i in range(args.repeats):
                sides = [(ours, lambda: apply_linear(x, weight)),
                         (theirs, lambda: torch.nn.functional.linear(padded, weight))]
                for times, fn in sides if i % 2 == 0 else sides[::-1]:
                    times.append(timed(fn))
            o, t = statistics.median(ours), statistics.median(theirs)
            gb = weight.numel() * weight.element_size() / o / 1e9
            gflops = 2 * rows * args.vocab * args.hidden / o / 1e9
            print(f" {str(dtype).removeprefix('torch.'):8s} | {rows:4d} | {o * 1e3:7.1f} | {t * 1e3:8.1f} | "
                  f"{gb:9.1f} | {gflops:12.1f} | {o / t:.2f}x")
    print(f"load at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

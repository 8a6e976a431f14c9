"""sarathi_rt.ops.linear (CUTLASS, planned tiles) against torch.matmul (cuBLAS), measured
in the same run, for the Llama-3-8B projections and M = 1..4096 tokens.

Prints per (projection, M): the planned configuration, split-K and waves, TFLOP/s of both,
and the ratio ours / cuBLAS (median of --repeats CUDA-event timings after a warm-up);
writes a CSV and a PNG of the staircase. Targets: >= 0.95x cuBLAS for M >= 256, and
tile-aligned M on the top edge of their stair.

    python bench/bench_gemm_gpu.py --out-dir bench/out --summary bench/out/device_summary.jsonl
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

import torch

from sarathi_rt import ops

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SUMMARY_M = (1, 16, 64, 256, 257, 1024, 4096)  # the M reported in device_check.sh's table


def m_grid(max_m: int) -> list[int]:
    """Powers of two, every 32 up to 1024 and every 128 beyond, and each tile edge + 1."""
    ms = {1 << i for i in range(13)} | set(range(32, 1025, 32)) | set(range(1152, 4097, 128))
    ms |= {m + 1 for m in range(128, 4097, 128)}
    return sorted(m for m in ms if m <= max_m)


def median_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for ax, name in zip(axes.flat, PROJECTIONS):
        sel = [r for r in rows if r["projection"] == name]
        ax.plot([r["m"] for r in sel], [r["tflops_ours"] for r in sel], label="sarathi_rt (CUTLASS)", lw=1.2)
        ax.plot([r["m"] for r in sel], [r["tflops_cublas"] for r in sel], label="torch.matmul (cuBLAS)", lw=1.2)
        ax.set_title(f"{name}: N={PROJECTIONS[name][0]}, K={PROJECTIONS[name][1]}")
        ax.set_xscale("log", base=2)
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("M (tokens)")
    axes[0, 0].legend()
    fig.suptitle(f"Linear GEMM staircase, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--max-m", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out-dir", default="bench/out")
    ap.add_argument("--summary", help="append summary rows as JSON lines to this file (bench/device_summary.py)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny, seconds-long run of the same code path (the quick test lane runs it); "
                         "without a GPU it says so and exits 0")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        if args.smoke:
            print("bench_gemm_gpu.py --smoke: skipped, no CUDA device (its code runs only on a GPU)")
            return
        raise SystemExit("bench_gemm_gpu.py needs a CUDA device")
    if args.smoke:
        args.max_m, args.repeats = 257, 2  # M >= 256 has a row: the target line reads it
    dtype = getattr(torch, args.dtype)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    rows = []
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, median of {args.repeats}")
    print(f"{'proj':>8} {'M':>5} {'config':>18} {'split':>5} {'waves':>5} {'ours TF/s':>9} {'cuBLAS':>8} {'ratio':>6}")
    for name, (n, k) in PROJECTIONS.items():
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        x_all = torch.randn(args.max_m, k, device="cuda", dtype=dtype)
        for m in m_grid(args.max_m):
            x = x_all[:m]
            err = (ops.linear(x, w).float() - torch.matmul(x, w.T).float()).abs().max().item()
            ours = median_ms(lambda: ops.linear(x, w), args.repeats)
            cublas = median_ms(lambda: torch.matmul(x, w.T), args.repeats)
            plan = ops.gemm_plan(m, n, k, dtype, "cuda")
            flop = 2.0 * m * n * k
            row = {"projection": name, "m": m, "n": n, "k": k, "config": plan.config, "split_k": plan.split_k,
                   "waves": plan.waves, "ms_ours": ours, "ms_cublas": cublas, "tflops_ours": flop / ours / 1e9,
                   "tflops_cublas": flop / cublas / 1e9, "ratio": cublas / ours, "max_abs_err": err}
            rows.append(row)
            print(f"{name:>8} {m:>5} {plan.config:>18} {plan.split_k:>5} {plan.waves:>5} "
                  f"{row['tflops_ours']:>9.1f} {row['tflops_cublas']:>8.1f} {row['ratio']:>6.2f}")

    with open(out_dir / "gemm_gpu.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out_dir / "gemm_staircase.png")

    big = [r for r in rows if r["m"] >= 256]
    worst = min(big, key=lambda r: r["ratio"])
    print(f"M >= 256: median ratio {statistics.median(r['ratio'] for r in big):.3f}, worst {worst['ratio']:.3f} "
          f"({worst['projection']}, M={worst['m']}); target >= 0.95: {'met' if worst['ratio'] >= 0.95 else 'MISSED'}")
    print(f"max |ours - cuBLAS| = {max(r['max_abs_err'] for r in rows):.3g}")
    edges = [(r, s) for r in rows for s in rows
             if s["projection"] == r["projection"] and s["m"] == r["m"] + 1 and r["m"] % 128 == 0]
    if edges:
        gain = statistics.median(s["ms_ours"] / r["ms_ours"] for r, s in edges)
        print(f"stair edges: T(M+1) / T(M) at M = 128j, median {gain:.3f} over {len(edges)} edges")
    print(f"wrote {out_dir / 'gemm_gpu.csv'} and {out_dir / 'gemm_staircase.png'}")
    if args.summary:
        with open(args.summary, "a") as f:
            for r in rows:
                if r["m"] in SUMMARY_M:
                    f.write(json.dumps(summary_row(r)) + "\n")


def summary_row(r: dict) -> dict:
    return {"bench": "gemm", "case": f"{r['projection']} M={r['m']} ({r['config']}, split {r['split_k']})",
            "metric": "TFLOP/s", "value": round(r["tflops_ours"], 1), "unit": "TFLOP/s",
            "baseline": "torch.matmul (cuBLAS)", "baseline_value": round(r["tflops_cublas"], 1),
            "ratio": round(r["ratio"], 3), "target": ">= 0.95" if r["m"] >= 256 else ""}


if __name__ == "__main__":
    main()

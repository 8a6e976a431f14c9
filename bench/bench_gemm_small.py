"""SmolLM2-135M's projections at small batches on the CPU: effective weight GB/s of each
GEMM path against this machine's streaming-copy GB/s, measured in the same run.

    python bench/bench_gemm_small.py [--rows 1,2,4,8,16,64,512] [--threads 1,2]
                                     [--dtypes float32,bfloat16] [--repeats 7] [--smoke]

At 1-16 rows a projection is bound by reading its weight, so the figure of merit is the
weight's bytes over the call's time. Each weight is timed cold, as a decode step meets
it (30 layers of weights are far past the caches): the bench cycles through enough
copies of it to fill 96 MiB. Paths, for every weight (fused qkv, o, fused gate_up, down,
the LM head):

- `apply_linear`: what the model runs today (the weight's path, chosen by `ops.linear`);
- `padded16`: torch's GEMM on the rows padded to 16 (batch-invariant, the old rule);
- `torch`: torch's GEMM on the rows as they are (NOT batch-invariant: the bound to beat);
- `streamed`: our kernel (csrc/cpu/gemm_streamed.cpp) on every weight.

torch's bf16 GEMM is oneDNN's: it uses AMX where the CPU has amx_bf16 and AVX512-BF16
where it has that, which the header line reports. Each thread count runs in a child
process (the native kernels size their OpenMP team when they load). Within a child each
repeat times every path once, in a rotated order, so the machine's drift lands on all of
them; the figures are medians. The last table is the ratio of each path's time to
`apply_linear`'s (below 1: faster than today).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

COLD_BYTES = 96 << 20  # three times the largest L3 we run on
WEIGHTS = {  # SmolLM2-135M: hidden 576, 9 q / 3 kv heads of 64, intermediate 1536, vocab 49152
    "qkv": (576 + 2 * 3 * 64, 576), "o": (576, 576), "gate_up": (2 * 1536, 576), "down": (576, 1536),
    "lm_head": (49152, 576)}
PATHS = ("apply_linear", "padded16", "torch", "streamed")


def child(args: argparse.Namespace) -> None:
    """One thread count: prints one JSON line of medians {dtype/weight/rows/path: seconds}."""
    import torch

    from bench_roofline_cpu import copy_bandwidth

    from sarathi_rt.ops.linear import apply_linear

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    empty = torch.empty(0, dtype=torch.uint8)

    def streamed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
        torch.ops.sarathi_rt.linear_out(x, w, None, out, 0, 1, empty)
        return out

    def padded16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        pad = -x.shape[0] % 16
        return torch.nn.functional.linear(torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x, w)[:x.shape[0]]

    fns: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "apply_linear": apply_linear, "padded16": padded16, "torch": torch.nn.functional.linear,
        "streamed": streamed}
    result: dict[str, float] = {"copy_gbps": copy_bandwidth(COLD_BYTES >> 20, args.repeats) / 1e9}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name in args.weights.split(","):
            n, k = WEIGHTS[name]
            if args.smoke:
                n = min(n, 4096)
            one = (torch.randn(n, k) / k ** 0.5).to(dtype)
            copies = [one] + [one.clone() for _ in range(max(1, COLD_BYTES // one.nbytes) - 1)]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k).to(dtype)
                # Enough calls per sample that the timer's cost vanishes, whole sweeps of the copies.
                calls = len(copies) * max(1, round(2e6 / max(one.nbytes, 2 * rows * n * k / 50)))
                times: dict[str, list[float]] = {p: [] for p in PATHS}
                for p in PATHS:
                    fns[p](x, one)  # first-call costs
                for rep in range(args.repeats):
                    for p in PATHS[rep % len(PATHS):] + PATHS[:rep % len(PATHS)]:
                        fn = fns[p]
                        start = time.perf_counter()
                        for c in range(calls):
                            fn(x, copies[c % len(copies)])
                        times[p].append((time.perf_counter() - start) / calls)
                for p in PATHS:
                    result[f"{dtype_name}/{name}/{rows}/{p}"] = statistics.median(times[p])
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--weights", default=",".join(WEIGHTS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--isa", default="", help="run our kernel at this level (SARATHI_RT_CPU_ISA) and cap oneDNN "
                    "at the same (avx2: as an AVX2 host does)")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.threads, args.repeats, args.weights = "1,17", "1", 2, "o,lm_head"
    if args.child:
        child(args)
        return
    from sarathi_rt.utils.cpu import native_flags

    flags = sorted(native_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    isa_env = {"SARATHI_RT_CPU_ISA": args.isa, "ONEDNN_MAX_CPU_ISA": args.isa.upper()} if args.isa else {}
    load_before = os.getloadavg()[0]
    print(f"CPU flags: {' '.join(flags) or 'none of avx2/avx512f/avx512_bf16/amx_bf16'}; "
          f"weights cold ({COLD_BYTES >> 20} MiB of copies each); {args.repeats} rotated repeats; "
          f"load {load_before:.1f}" + (f"; forced ISA {args.isa}" if args.isa else ""))
    worst: list[float] = []
    for threads in args.threads.split(","):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]],
                             env={**os.environ, "OMP_NUM_THREADS": threads, **isa_env}, check=True, capture_output=True,
                             text=True).stdout
        res = json.loads(out.splitlines()[-1])
        copy = res["copy_gbps"]
        print(f"\n{threads} thread(s): streaming copy {copy:.1f} GB/s; cells: weight GB/s (% of copy)")
        print(f" {'dtype':8s} | {'weight':8s} | {'rows':>4s} | " + " | ".join(f"{p:>15s}" for p in PATHS)
              + " | " + " | ".join(f"{p} / today" for p in PATHS[1:]))
        for dtype_name in args.dtypes.split(","):
            for name in args.weights.split(","):
                n, k = WEIGHTS[name]
                if args.smoke:
                    n = min(n, 4096)
                nbytes = n * k * (4 if dtype_name == "float32" else 2)
                for rows in args.rows.split(","):
                    t = {p: res[f"{dtype_name}/{name}/{rows}/{p}"] for p in PATHS}
                    cells = [f"{nbytes / t[p] / 1e9:6.1f} ({100 * nbytes / t[p] / 1e9 / copy:4.0f}%)" for p in PATHS]
                    ratios = [t[p] / t["apply_linear"] for p in PATHS[1:]]
                    worst.append(t["apply_linear"] / min(t.values()))
                    print(f" {dtype_name:8s} | {name:8s} | {rows:>4s} | " + " | ".join(cells) + " | "
                          + " | ".join(f"{r:{len(p) + 8}.2f}" for r, p in zip(ratios, PATHS[1:])))
    print(f"\nworst cell: today's path {max(worst):.2f}x the fastest path's time; "
          f"load: before {load_before:.1f}, after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""T(n) of a model's linear layers on the CPU, for n = 1..N tokens: the staircase the
token-budget calibration reads.

Times one decoder layer's four projections (qkv, o, gate_up, down) of the `cpu-small`
preset through sarathi_rt.ops.linear (torch's GEMM on the CPU), median of --repeats runs
after a warm-up, and scales by the layer count. Writes `num_tokens,time_s` (the whole
model's linears per step) to --csv and prints the staircase: every --print-every-th n,
the largest steps T(n+1) / T(n), and T(n) / n against the best per-token cost (the
"baseline" measured in this run).

    python bench/bench_linear_staircase.py --max-tokens 1024 --csv linear_staircase_cpu.csv
"""
from __future__ import annotations

import argparse
import csv
import statistics
import time
from dataclasses import dataclass

import torch

from sarathi_rt import ops
from sarathi_rt.sim.budget import StepTimeCurve, choose_token_budget
from sarathi_rt.measure.plots import plot_step_time


@dataclass(frozen=True)
class Shapes:
    hidden: int = 512
    intermediate: int = 1536
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    num_layers: int = 8

    def projections(self) -> dict[str, tuple[int, int]]:
        """name -> (N, K) of the weight."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return {"qkv": (qkv, self.hidden), "o": (self.num_heads * self.head_dim, self.hidden),
                "gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}


def time_layer(n: int, weights: dict[str, torch.Tensor], repeats: int) -> float:
    xs = {name: torch.randn(n, w.shape[1], dtype=w.dtype) for name, w in weights.items()}
    samples = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        for name, w in weights.items():
            ops.linear(xs[name], w)
        if i:  # the first run warms caches and oneDNN's kernel selection
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--step", type=int, default=1, help="measure every step-th n (1 = every n)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--csv", default="linear_staircase_cpu.csv")
    ap.add_argument("--print-every", type=int, default=64)
    ap.add_argument("--tbt-slo", type=float, default=0.05,
                    help="feed T(n) to the token-budget calibration with this TBT target (s)")
    ap.add_argument("--tile-size", type=int, default=16, help="budget granularity for the calibration")
    ap.add_argument("--plot", default="linear_staircase_budget.png")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = ap.parse_args()
    if args.smoke:
        # A target no loaded machine misses: the smoke run checks the calibration runs, not its answer.
        args.max_tokens, args.step, args.repeats, args.tbt_slo = 64, 16, 1, 10.0
    if args.max_tokens < 1 or args.step < 1 or args.repeats < 1:
        ap.error("--max-tokens, --step and --repeats must be >= 1")

    shapes = Shapes()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, dtype=dtype) / k ** 0.5 for name, (n, k) in shapes.projections().items()}
    counts = sorted({1, args.max_tokens} | set(range(args.step, args.max_tokens + 1, args.step)))
    times = {n: shapes.num_layers * time_layer(n, weights, args.repeats) for n in counts}

    with open(args.csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["num_tokens", "time_s"])
        writer.writerows((n, f"{t:.9f}") for n, t in times.items())

    best_per_token = min(t / n for n, t in times.items())
    print(f"cpu-small linears ({', '.join(shapes.projections())}) x {shapes.num_layers} layers, {args.dtype}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'n':>6} {'T(n) ms':>10} {'us/token':>10} {'vs best us/token':>17}")
    for n, t in times.items():
        if n == 1 or n % args.print_every == 0 or n == args.max_tokens:
            print(f"{n:>6} {t * 1e3:>10.3f} {t / n * 1e6:>10.2f} {t / n / best_per_token:>16.2f}x")
    steps = sorted(((times[b] / times[a], a, b) for a, b in zip(counts, counts[1:])), reverse=True)[:8]
    print("largest steps T(b) / T(a): " + ", ".join(f"{a}->{b}: {r:.2f}x" for r, a, b in steps))
    print(f"wrote {args.csv} ({len(times)} rows)")

    # The calibration reads the same staircase: the largest tile-aligned budget whose
    # linears alone fit the TBT target (attention and overheads come on top, which the
    # engine-level measure_step_curve measures).
    profile = StepTimeCurve(tuple(times), tuple(times.values()), num_decodes=0, context_len=0,
                              label="cpu-small linears")
    choice = choose_token_budget(profile, args.tbt_slo, args.tile_size)
    plot_step_time(profile, choice, args.plot)
    print(f"token budget for a {args.tbt_slo * 1e3:.0f} ms TBT target (linears only, tile {args.tile_size}, "
          f"margin {choice.margin:.0%}): {choice.token_budget} tokens, T = {choice.step_time * 1e3:.2f} ms; "
          f"plot {args.plot}")


if __name__ == "__main__":
    main()

"""Capacity study (simulator): does the SLO-adaptive token budget match the best static
budget without a sweep?

For each vidur profile (A100 Llama-2-7B, A100 Llama-3-8B) x trace (ShareGPT, arXiv,
Splitwise) x SLO (strict: 5x, relaxed: 25x the time of a decode-only step of 32 requests
at 2k context), the capacity (max QPS with P99 TBT <= SLO and P50 scheduling delay
<= 2 s) of: vllm; sarathi at the SLO-derived static budget (`sarathi-rt capacity`'s
choice: T(n) with 32 decodes over the trace's mean length); sarathi at the best static
budget of a sweep; sarathi --adaptive-budget (token_budget = --adaptive-cap as its cap).
Prints a markdown table and writes JSON and (with matplotlib) a bar plot.

Each capacity is bisected to --rel-tol, so it is only known to lie between the highest
passing and the lowest failing probed rate; the table shows the adaptive / best-static ratio
with the range those brackets allow. --slos, --profiles and --traces pick cells, and --update
re-runs them inside an earlier study's JSON (the other cells are kept as they were).

    python bench/bench_adaptive_budget.py [--num-requests 300] [--out bench_out/adaptive]
    python bench/bench_adaptive_budget.py --profiles llama-2-7b --traces sharegpt \
        --sweep 128,256,384,512 --rel-tol 0.01 --update bench/results/adaptive_budget_capacity.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

from sarathi_rt.sim.budget import choose_token_budget, cost_model_curve
from sarathi_rt.sim.capacity import SLO, CapacityResult, simulated_capacity
from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.step_time.shape import StepShape
from sarathi_rt.sim import VidurCostModel
from sarathi_rt.workloads import WorkloadConfig, data_path, make_workload

PROFILES = {"llama-2-7b": "a100_llama-2-7b_mlp.csv.gz", "llama-3-8b": "a100_llama-3-8b_mlp.csv.gz"}
SLO_FACTORS = {"strict": 5, "relaxed": 25}  # x a decode-only step of 32 requests at 2k context


def slo_budget(cost: VidurCostModel, workload: WorkloadConfig, slo: float, blocks: int, block_size: int) -> int:
    requests = make_workload(workload)
    mean_len = sum(r.num_prompt_tokens + r.num_decode_tokens for r in requests) // len(requests)
    context = min(mean_len, blocks * block_size // 32)
    profile = cost_model_curve(cost, list(range(32, 8193, 32)), num_decodes=32, context_len=context)
    return choose_token_budget(profile, slo, 128).token_budget


def cell(cost: VidurCostModel, workload: WorkloadConfig, slo_s: float, sweep: list[int], args) -> dict:
    blocks = cost.kv_cache_blocks(args.block_size)
    slo = SLO(slo_s)
    search = dict(qps_start=args.qps_start, rel_tol=args.rel_tol, max_probes=args.max_probes)
    base = SchedulerConfig(token_budget=sweep[0], max_num_seqs=128, block_size=args.block_size,
                           num_blocks=blocks, tile_size=128)

    brackets: dict = {}

    def capacity(cfg: SchedulerConfig, key: str) -> float:
        result = simulated_capacity(workload, cfg, cost, slo, **search)
        brackets[key] = bracket(result)
        return result.max_qps

    longest = max(r.num_prompt_tokens + r.num_decode_tokens for r in make_workload(workload))
    out: dict = {"slo_s": slo_s}
    out["vllm"] = capacity(replace(base, policy="vllm", token_budget=longest, chunk_size=longest, tile_size=None),
                           "vllm")
    static = {b: capacity(replace(base, token_budget=b, chunk_size=b), str(b)) for b in sweep}
    out["static"] = static
    out["best_budget"] = max(static, key=lambda b: static[b])
    out["best_static"] = static[out["best_budget"]]
    derived = slo_budget(cost, workload, slo_s, blocks, args.block_size)
    out["slo_budget"] = derived
    out["slo_static"] = static.get(derived) or capacity(replace(base, token_budget=derived, chunk_size=derived),
                                                        str(derived))
    cap = args.adaptive_cap
    out["adaptive"] = capacity(replace(base, token_budget=cap, chunk_size=cap, tbt_slo=slo_s,
                                       slo_margin=args.margin), "adaptive")
    out.update(rel_tol=args.rel_tol, num_requests=workload.num_requests, brackets=brackets)
    return out


def bracket(result: CapacityResult) -> list[float | None]:
    """[highest passing, lowest failing] probed rate: the capacity lies in between (None
    when the probes ran out before a rate failed)."""
    failed = [p.qps for p in result.probes if not p.ok and p.qps > result.max_qps]
    return [result.max_qps, min(failed, default=None)]


def ratio_range(r: dict) -> str:
    """The adaptive / best-static ratio's range allowed by both capacities' brackets."""
    if "brackets" not in r:
        return f"each capacity to {r.get('rel_tol', 0.03):.0%}"
    (a_lo, a_hi), (s_lo, s_hi) = r["brackets"]["adaptive"], r["brackets"][str(r["best_budget"])]
    low = f"{a_lo / s_hi:.2f}" if s_hi else "0"
    high = f"{a_hi / s_lo:.2f}x" if a_hi and s_lo else "unbounded"
    return f"{low}-{high}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--traces", default="sharegpt,arxiv,splitwise")
    p.add_argument("--slos", default="strict,relaxed")
    p.add_argument("--sweep", default="128,256,512,1024,2048,4096")
    p.add_argument("--adaptive-cap", type=int, default=4096, help="the adaptive budget's token_budget")
    p.add_argument("--margin", type=float, default=0.05, help="the adaptive budget's slo_margin")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--qps-start", type=float, default=1.0)
    p.add_argument("--rel-tol", type=float, default=0.03)
    p.add_argument("--max-probes", type=int, default=14)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/adaptive_budget")
    p.add_argument("--update", metavar="JSON", help="replace the re-run cells in this earlier study's JSON, "
                   "then print the table and write the plot of all its cells")
    args = p.parse_args()
    sweep = sorted(int(b) for b in args.sweep.split(","))
    slos = {name: factor for name, factor in SLO_FACTORS.items() if name in args.slos.split(",")}
    if set(args.slos.split(",")) - set(SLO_FACTORS):
        raise ValueError(f"--slos must name some of {sorted(SLO_FACTORS)}, got {args.slos!r}")
    os.makedirs(args.out, exist_ok=True)
    results = []
    for model in args.profiles.split(","):
        cost = VidurCostModel(data_path(PROFILES[model]))
        t32 = cost.predict_shape(StepShape.hybrid(0, 0, 32, 32 * 2049))
        for trace in args.traces.split(","):
            workload = WorkloadConfig(num_requests=args.num_requests, lengths=trace, seed=args.seed)
            for name, factor in slos.items():
                t0 = time.perf_counter()
                r = cell(cost, workload, factor * t32, sweep, args)
                r.update(model=model, trace=trace, slo=name)
                results.append(r)
                print(f"{model} {trace} {name} ({r['slo_s'] * 1e3:.0f} ms): vllm {r['vllm']:.3f}, "
                      f"static@{r['slo_budget']} {r['slo_static']:.3f}, best static@{r['best_budget']} "
                      f"{r['best_static']:.3f}, adaptive {r['adaptive']:.3f} QPS "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        json.dump(results, f, indent=1)
    if args.update:
        results = merged(args.update, results)
        with open(args.update, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results))
    plot(results, os.path.splitext(args.update)[0] + ".png" if args.update else os.path.join(args.out, "capacity.png"))


def merged(path: str, rerun: list[dict]) -> list[dict]:
    """The study in `path` with its cells of the same (model, trace, SLO) replaced by `rerun`."""
    def key(r: dict) -> tuple:
        return r["model"], r["trace"], r["slo"]

    with open(path) as f:
        old = json.load(f)
    new = {key(r): r for r in rerun}
    missing = set(new) - {key(r) for r in old}
    return [new.get(key(r), r) for r in old] + [r for r in rerun if key(r) in missing]


def table(results: list[dict]) -> str:
    lines = ["| model | trace | SLO | vllm | sarathi, SLO budget | sarathi, best static | adaptive | "
             "adaptive / best static | bisection tolerance | ratio's range |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = r["adaptive"] / r["best_static"] if r["best_static"] else float("nan")
        lines.append(f"| {r['model']} | {r['trace']} | {r['slo']} {r['slo_s'] * 1e3:.0f} ms | {r['vllm']:.3f} | "
                     f"{r['slo_static']:.3f} ({r['slo_budget']}) | {r['best_static']:.3f} ({r['best_budget']}) | "
                     f"{r['adaptive']:.3f} | {ratio:.2f}x | {r.get('rel_tol', 0.03):.0%} | {ratio_range(r)} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("vllm", "vllm"), ("slo_static", "sarathi, SLO budget"), ("best_static", "sarathi, best static"),
            ("adaptive", "sarathi, adaptive")]
    fig, ax = plt.subplots(figsize=(max(8, len(results) * 1.1), 4))
    width = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        ax.bar([j + i * width for j in range(len(results))], [r[key] for r in results], width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))])
    ax.set_xticklabels([f"{r['model']}\n{r['trace']}\n{r['slo']}" for r in results], fontsize=7)
    ax.set_ylabel("capacity (QPS)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

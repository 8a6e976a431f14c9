"""Capacity grid (simulator): is the default budget rule (with a TBT SLO and no token
budget: the SLO-adaptive budget) never far from the best static budget?

Every cell of vidur profile (each `*_mlp.csv.gz` shipped in sarathi_rt/data) x hardware
preset (a100, h100, h200: the peaks and the KV memory) x trace (ShareGPT, arXiv,
Splitwise) x SLO (strict: 5x, relaxed: 25x the time of a decode-only step of 32 requests
at 2k context) x seed gets the capacity (max QPS with P99 TBT <= SLO and P50 scheduling
delay <= 2 s) of: sarathi at every static budget of one sweep; sarathi under the default
rule; and, for reference, sarathi at the SLO-derived static budget (the old default,
still `--budget-rule slo-static`). One sweep, one bisection tolerance and one request
count for every cell. The table is sorted worst cell first (default / best static), and
the worst cell is printed before it.

With `--static-from capacity.json` (a previous run's output with the same sweep, request
count, tolerance, probes and cells) the static capacities come from that run and only the
default rule is searched, plus each cell's best static budget again: the static policies
never read the adaptive rule, so a change to that rule needs only its own column, and the
rerun best static must reproduce the file's figure exactly (else the run stops: the static
policies changed and the whole grid must be rerun).

    python bench/bench_adaptive_budget.py [--jobs 2] [--num-requests 200] [--traces sharegpt,arxiv] [--out DIR]
    python bench/bench_adaptive_budget.py --static-from bench/results/adaptive_budget_capacity.json
    python bench/bench_adaptive_budget.py --smoke
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import time
from dataclasses import replace
from pathlib import Path

from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim import HARDWARE, VidurCostModel
from sarathi_rt.scheduler.config import ADAPTIVE_CAP
from sarathi_rt.sim.budget import choose_token_budget, loaded_curve
from sarathi_rt.sim.capacity import SLO, CapacityResult, simulated_capacity
from sarathi_rt.step_time import StepShape
from sarathi_rt.workloads import BUILTIN_TRACES, WorkloadConfig, data_path, make_workload

SLO_FACTORS = {"strict": 5, "relaxed": 25}  # x a decode-only step of 32 requests at 2k context
SWEEP = (128, 256, 384, 512, 768, 1024, 1536, 2048, 4096)


def shipped_profiles() -> list[str]:
    return sorted(p.name for p in Path(data_path("")).glob("*_mlp.csv.gz"))


def cost_model(profile: str, hardware: str) -> VidurCostModel:
    return VidurCostModel(data_path(profile), hardware=hardware)


def slo_seconds(cost: VidurCostModel, slo: str) -> float:
    return SLO_FACTORS[slo] * cost.predict_shape(StepShape.hybrid(0, 0, 32, 32 * 2049))


def capacity(task: tuple) -> tuple[tuple, str, list]:
    """One capacity search: (cell, rule) -> (cell, rule, [max_qps, lowest failing qps])."""
    cell, rule, args = task
    profile, hardware, trace, slo, seed = cell
    cost = cost_model(profile, hardware)
    slo_s = slo_seconds(cost, slo)
    workload = WorkloadConfig(num_requests=args["num_requests"], lengths=trace, seed=seed)
    base = SchedulerConfig(max_num_seqs=128, num_blocks=cost.kv_cache_blocks(16), tile_size=128)
    if rule == "default":
        cap = ADAPTIVE_CAP["gpu"]
        cfg = replace(base, token_budget=cap, chunk_size=cap, tbt_slo=slo_s)
    elif rule == "slo-static":
        curve = loaded_curve(cost, make_workload(workload), base.num_blocks, base.block_size)
        budget = choose_token_budget(curve, slo_s, 128).token_budget
        cfg = replace(base, token_budget=budget, chunk_size=budget)
    else:
        cfg = replace(base, token_budget=int(rule), chunk_size=int(rule))
    result = simulated_capacity(workload, cfg, cost, SLO(slo_s), qps_start=1.0, rel_tol=args["rel_tol"],
                                max_probes=args["max_probes"])
    return cell, rule, bracket(result)


def bracket(result: CapacityResult) -> list[float | None]:
    """[highest passing, lowest failing] probed rate: the capacity lies in between (None
    when the probes ran out before a rate failed)."""
    return [result.max_qps, result.lowest_failing]


def best_budget(brackets: dict[str, list], sweep: list[int]) -> int:
    return max(sweep, key=lambda b: brackets[str(b)][0])


def reused_statics(path: str, search: dict, cells: list[tuple]) -> dict[tuple, dict[str, list]]:
    """Each cell's capacity brackets from a previous run's capacity.json, which must have
    been searched exactly as this run would (sweep, requests, tolerance, probes, cells)."""
    with open(path) as f:
        saved = json.load(f)
    for key, value in search.items():
        if saved.get(key) != value:
            raise SystemExit(f"--static-from {path}: {key} is {saved.get(key)!r}, this run's is {value!r}")
    previous = {(c["profile"], c["hardware"], c["trace"], c["slo"], c["seed"]): c["brackets"] for c in saved["cells"]}
    missing = [cell for cell in cells if cell not in previous]
    if missing:
        raise SystemExit(f"--static-from {path}: no cell {' '.join(map(str, missing[0]))} ({len(missing)} missing)")
    return previous


def summarize(cell: tuple, found: dict[str, list], sweep: list[int]) -> dict:
    profile, hardware, trace, slo, seed = cell
    static = {b: found[str(b)][0] for b in sweep}
    best = best_budget(found, sweep)
    ratio = found["default"][0] / static[best] if static[best] else float("nan")
    return dict(profile=profile, hardware=hardware, trace=trace, slo=slo, seed=seed, static=static,
                best_budget=best, best_static=static[best], default=found["default"][0],
                slo_static=found["slo-static"][0], ratio=ratio, brackets=found)


def table(rows: list[dict], rel_tol: float) -> str:
    lines = ["| profile | hardware | trace | SLO | seed | default rule | best static (budget) | default / best "
             "| SLO-derived static | bisection tolerance |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['profile'].removesuffix('_mlp.csv.gz')} | {r['hardware']} | {r['trace']} | {r['slo']} | "
                     f"{r['seed']} | {r['default']:.3f} | {r['best_static']:.3f} ({r['best_budget']}) | "
                     f"{r['ratio']:.3f}x | {r['slo_static']:.3f} | {rel_tol:.0%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rel-tol", type=float, default=0.01)
    p.add_argument("--max-probes", type=int, default=16)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--traces", default=",".join(BUILTIN_TRACES), help="a part of the grid: these traces only")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="capacity searches in parallel")
    p.add_argument("--out", default="bench_out/adaptive_budget")
    p.add_argument("--smoke", action="store_true", help="one small cell, two budgets: the same code path in seconds")
    p.add_argument("--static-from", help="reuse the static capacities of this capacity.json (see above)")
    args = p.parse_args()
    traces = args.traces.split(",")
    unknown = sorted(set(traces) - set(BUILTIN_TRACES))
    if unknown:
        raise SystemExit(f"--traces: no shipped trace {unknown[0]!r} (shipped: {', '.join(BUILTIN_TRACES)})")
    profiles, hardware, slos = shipped_profiles(), sorted(HARDWARE), list(SLO_FACTORS)
    sweep, seeds = list(SWEEP), [int(s) for s in args.seeds.split(",")]
    if args.smoke:
        profiles, hardware, traces, slos, seeds, sweep = profiles[:1], ["a100"], ["sharegpt"], ["strict"], [0], [256, 512]
        args.num_requests, args.max_probes, args.rel_tol = 40, 4, 0.1
    search = dict(num_requests=args.num_requests, rel_tol=args.rel_tol, max_probes=args.max_probes)
    cells = list(itertools.product(profiles, hardware, traces, slos, seeds))
    rules = [str(b) for b in sweep] + ["default", "slo-static"]
    found: dict[tuple, dict[str, list]] = {cell: {} for cell in cells}
    if args.static_from:
        previous = reused_statics(args.static_from, dict(sweep=sweep, **search), cells)
        tasks = []
        for cell in cells:
            best = str(best_budget(previous[cell], sweep))
            found[cell] = {r: b for r, b in previous[cell].items() if r not in ("default", best)}
            tasks += [(cell, "default", search), (cell, best, search)]
    else:
        tasks = [(cell, rule, search) for cell in cells for rule in rules]
    start = time.perf_counter()
    with multiprocessing.Pool(args.jobs) as pool:
        for i, (cell, rule, result) in enumerate(pool.imap_unordered(capacity, tasks), 1):
            if args.static_from and rule != "default" and result != previous[cell][rule]:
                raise SystemExit(f"{' '.join(map(str, cell))}: static {rule} now gives {result}, the file "
                                 f"{previous[cell][rule]}: the static policies changed, rerun the whole grid")
            found[cell][rule] = result
            if len(found[cell]) == len(rules):
                r = summarize(cell, found[cell], sweep)
                print(f"  {' '.join(map(str, cell))}: default {r['default']:.3f}, best static {r['best_static']:.3f} "
                      f"at {r['best_budget']}: {r['ratio']:.3f}x ({i}/{len(tasks)} searches, "
                      f"{time.perf_counter() - start:.0f} s)", flush=True)
    rows = sorted((summarize(cell, found[cell], sweep) for cell in cells), key=lambda r: r["ratio"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        json.dump(dict(sweep=sweep, **search, cells=rows), f, indent=1)
    worst = rows[0]
    print(f"worst cell: {worst['profile']} {worst['hardware']} {worst['trace']} {worst['slo']} seed {worst['seed']}: "
          f"default {worst['default']:.3f} QPS = {worst['ratio']:.3f}x the best static ({worst['best_static']:.3f} "
          f"at {worst['best_budget']}); {sum(r['ratio'] >= 0.97 for r in rows)} of {len(rows)} cells >= 0.97x "
          f"({time.perf_counter() - start:.0f} s, {len(cells)} cells, {len(tasks)} searches)")
    print(table(rows, args.rel_tol))


if __name__ == "__main__":
    main()

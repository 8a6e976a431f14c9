"""Pipeline parallelism on the simulator: median bubble time per request and capacity
(max QPS under a P99 TBT SLO and a P50 scheduling delay of 2 s) for sarathi (uniform
token-budgeted micro-batches) against vllm (whole-prompt prefills, decodes apart) at
PP=2 and PP=4, with Llama-3-8B's measured A100 op times (vidur profile).

    python bench/bench_pipeline_capacity.py [--requests 300] [--tp 1] [--tbt-slo 0.1]

Prints per (PP, policy): median and P90 bubble seconds per request at a common load
(vllm's capacity at that PP, so both are measured where the baseline still copes), the
capacity, and sarathi's ratios against vllm measured in the same run."""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from sarathi_rt.sim.capacity import SLO, simulated_capacity
from sarathi_rt.measure.metrics import percentile
from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim.cost import VidurCostModel
from sarathi_rt.sim.simulator import simulate
from sarathi_rt.workloads import WorkloadConfig, data_path, make_workload

PROFILE = "a100_llama-3-8b_mlp.csv.gz"
POLICIES = ("sarathi", "vllm")


def scheduler_config(policy: str, budget: int, pp: int, num_blocks: int, longest: int) -> SchedulerConfig:
    if policy == "vllm":  # whole prompts: the cap is the longest request (vLLM's default)
        return SchedulerConfig(policy=policy, token_budget=max(budget, longest), max_num_seqs=128,
                               num_blocks=num_blocks)
    return SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=128, num_blocks=num_blocks,
                           tile_size=128, max_partial_prefills=pp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tbt-slo", type=float, default=0.1, help="P99 TBT target (s)")
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--trace", default="arxiv")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = ap.parse_args()
    if args.smoke:
        args.requests = 20
    workload = WorkloadConfig(num_requests=args.requests, lengths=args.trace, max_total_tokens=8192, seed=0)
    longest = max(r.num_prompt_tokens + r.num_decode_tokens for r in make_workload(workload))
    slo = SLO(args.tbt_slo)
    print(f"Llama-3-8B A100 profile, TP={args.tp}, {args.trace} trace, {args.requests} requests, "
          f"P99 TBT SLO {args.tbt_slo * 1e3:.0f} ms, sarathi token budget {args.token_budget}")
    for pp in (2, 4):
        cost = VidurCostModel(data_path(PROFILE), num_layers=32, tp=args.tp)
        blocks = cost.kv_cache_blocks(16, pipeline_stages=pp)
        configs = {p: scheduler_config(p, args.token_budget, pp, blocks, longest) for p in POLICIES}
        t0 = time.perf_counter()
        capacity = {p: simulated_capacity(workload, c, cost, slo, pipeline_stages=pp, rel_tol=0.03).max_qps
                    for p, c in configs.items()}
        load = capacity["vllm"]
        bubbles = {}
        for p, c in configs.items():
            res = simulate(make_workload(dataclasses.replace(workload, qps=load)), c, cost, pipeline_stages=pp)
            bubbles[p] = res.bubble_times
        for p in POLICIES:
            b = bubbles[p]
            print(f"PP={pp} {p:8s} capacity {capacity[p]:7.3f} QPS | at {load:.3f} QPS bubble/request "
                  f"median {statistics.median(b) * 1e3:8.2f} ms, P90 {percentile(b, 90) * 1e3:8.2f} ms")
        s, v = statistics.median(bubbles["sarathi"]), statistics.median(bubbles["vllm"])
        ratio = f"{v / s:.2f}x lower" if s > 0 else "zero for sarathi"
        print(f"PP={pp} sarathi vs vllm: median bubble {ratio}; capacity "
              f"{capacity['sarathi'] / capacity['vllm']:.2f}x  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

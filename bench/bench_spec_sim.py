"""What speculative decoding buys under a strict TBT SLO, on the simulator (Llama-2-7B's
measured A100 op times, the vidur profile), with the scheduler's per-step sizing rule
(scheduler.speculation) against no speculation and against a fixed k.

    python bench/bench_spec_sim.py [--requests 300] [--tbt-slo 0.05] [--k 4] [--smoke]

1. Decodes alone (sim.speculation.run_decodes): a batch of 1..128 decodes over 1024
   cached tokens, every request accepting each draft with probability a, for 200 steps:
   output tokens/s and P99 step time with no speculation, fixed k and the rule, under
   the TBT target. Prints the rule's worst ratio to fixed k where fixed k pays within
   the target and its worst ratio to no speculation.
2. Serving capacity (max QPS with P99 TBT within the SLO and P50 scheduling delay within
   2 s) of the sarathi policy with the adaptive budget (each step sized to the SLO) on
   the sharegpt trace, without speculation and with k proposals per decode at acceptance
   0.0, 0.3, 0.6 and 0.8 (every request the same rate), the same requests at every rate."""
from __future__ import annotations

import argparse
import time

from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim.capacity import SLO, simulated_capacity
from sarathi_rt.sim.cost import VidurCostModel
from sarathi_rt.sim.speculation import AcceptanceDistribution, SimSpeculation, run_decodes
from sarathi_rt.workloads import WorkloadConfig, data_path

PROFILE = "a100_llama-2-7b_mlp.csv.gz"
ACCEPTANCES = (0.0, 0.3, 0.6, 0.8)


def decode_grid(cost: VidurCostModel, k: int, target: float, batches: tuple[int, ...],
                acceptances: tuple[float, ...], steps: int) -> None:
    print(f"decodes alone, k={k}, TBT target {target * 1e3:.0f} ms: tokens/s (P99 step ms)")
    print(f"{'decodes':>7} {'accept':>6} {'none':>16} {'fixed k':>16} {'rule':>16} {'rule/fixed':>10}")
    vs_fixed, vs_none = [], []
    for n in batches:
        for a in acceptances:
            runs = {s: run_decodes(cost, n, a, k=k, sizing=s, time_target=target, steps=steps)  # type: ignore[arg-type]
                    for s in ("none", "fixed", "rule")}
            none, fixed, rule = runs["none"], runs["fixed"], runs["rule"]
            ratio = rule.tokens_per_s / fixed.tokens_per_s
            print(f"{n:>7} {a:>6.2f} " + " ".join(f"{r.tokens_per_s:>8.0f} ({r.step_p99 * 1e3:>5.1f})"
                                                  for r in (none, fixed, rule)) + f" {ratio:>9.2f}x")
            if fixed.step_p99 <= target and fixed.tokens_per_s > none.tokens_per_s:
                vs_fixed.append(ratio)
            vs_none.append(rule.tokens_per_s / none.tokens_per_s)
    print(f"rule / fixed k where fixed k pays within the target: worst {min(vs_fixed):.3f}x; "
          f"rule / no speculation: worst {min(vs_none):.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tbt-slo", type=float, default=0.05, help="P99 TBT target (s)")
    ap.add_argument("--k", type=int, default=4, help="proposals per decode per step")
    ap.add_argument("--trace", default="sharegpt")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = ap.parse_args()
    cost = VidurCostModel(data_path(PROFILE))
    smoke = args.smoke
    decode_grid(cost, args.k, args.tbt_slo, (1, 16, 128) if smoke else (1, 4, 16, 64, 128),
                (0.0, 0.8) if smoke else (0.0, 0.3, 0.6, 0.8, 0.95), 50 if smoke else 200)

    requests = 16 if smoke else args.requests
    workload = WorkloadConfig(num_requests=requests, lengths=args.trace, max_total_tokens=4096, seed=0)
    config = SchedulerConfig(policy="sarathi", token_budget=4096, max_num_seqs=128, tile_size=128,
                             num_blocks=cost.kv_cache_blocks(16), tbt_slo=args.tbt_slo)
    slo = SLO(args.tbt_slo)
    search = dict(rel_tol=0.25 if smoke else 0.03, max_probes=4 if smoke else 20)
    print(f"\ncapacity, sarathi with the adaptive budget, {args.trace} trace, {requests} requests, "
          f"P99 TBT SLO {args.tbt_slo * 1e3:.0f} ms, k={args.k}")
    t0 = time.perf_counter()
    base = simulated_capacity(workload, config, cost, slo, **search).max_qps
    print(f"  no speculation: {base:.3g} QPS")
    for a in (0.0, 0.8) if smoke else ACCEPTANCES:
        spec = SimSpeculation(args.k, AcceptanceDistribution(a))
        qps = simulated_capacity(workload, config, cost, slo, speculation=spec, **search).max_qps
        print(f"  acceptance {a:.1f}: {qps:.3g} QPS, {qps / base if base else float('nan'):.2f}x no speculation")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

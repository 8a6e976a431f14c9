"""`sarathi-rt deploy`: the cheapest deployments (fewest GPUs: replicas x TP x PP, policy,
token budget) that serve --qps within the SLOs, searched on the simulator. Candidates
whose weights do not fit, whose single decode step misses the TBT SLO, or whose
throughput ceiling needs more than --max-gpus are dropped before simulating; the
others are simulated cheapest first until no remaining one can beat the plans found."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from sarathi_rt.config.flags import add_config_flags, given_options
from sarathi_rt.config.speculative import SpeculativeOptions
from sarathi_rt.sim.deploy import DeploymentRequest, DeploymentSLO, plan_deployment
from sarathi_rt.sim import HARDWARE
from sarathi_rt.workloads import ARRIVALS, BUILTIN_TRACES, WorkloadConfig, data_path

from ._serving import add_acceptance_flag, sim_speculation


DEFAULT_PROFILE = "a100_llama-3-8b_mlp.csv.gz"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("deploy", help="cheapest GPU deployment meeting the SLOs at a rate (simulated)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--qps", type=float, required=True, help="target request rate")
    p.add_argument("--tbt-slo", type=float, required=True, help="P99 time-between-tokens limit (s)")
    p.add_argument("--ttft-p50", type=float, default=None, help="P50 time-to-first-token limit (s)")
    p.add_argument("--max-sched-delay", type=float, default=2.0, help="P50 scheduling delay limit (s)")
    p.add_argument("--vidur-profile", metavar="CSV", default=DEFAULT_PROFILE,
                   help="vidur mlp.csv of the model: a path or a file shipped in sarathi_rt/data")
    p.add_argument("--num-layers", type=int, default=32, help="layers of the profiled model")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="a100")
    p.add_argument("--gpus-per-node", type=int, default=8, help="the largest tensor-parallel size")
    p.add_argument("--max-gpus", type=int, default=64)
    p.add_argument("--policy", default="sarathi,vllm", help="comma-separated policies to consider")
    p.add_argument("--token-budget", default=None,
                   help="comma-separated budgets for the chunked policies (default: derived from the SLO)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--top", type=int, default=5, help="plans to print")
    p.add_argument("--trace", default="sharegpt", help=f"request lengths: {', '.join(BUILTIN_TRACES)} or a CSV")
    p.add_argument("--num-requests", type=int, default=200, help="requests per simulated run")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    add_config_flags(p, (SpeculativeOptions,))
    add_acceptance_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    profile = args.vidur_profile if os.path.exists(args.vidur_profile) else data_path(args.vidur_profile)
    if not os.path.exists(profile):
        raise ValueError(f"--vidur-profile {args.vidur_profile!r} is neither a file nor one shipped in "
                         "sarathi_rt/data")
    policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
    request = DeploymentRequest(
        qps=args.qps, slo=DeploymentSLO(args.tbt_slo, args.max_sched_delay, args.ttft_p50), profile=profile,
        num_layers=args.num_layers, hardware=args.hardware, gpus_per_node=args.gpus_per_node,
        max_gpus=args.max_gpus, policies=policies,
        token_budgets=tuple(int(b) for b in args.token_budget.split(",")) if args.token_budget else (),
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, top=args.top,
        speculation=sim_speculation(given_options(args, (SpeculativeOptions,)), args.acceptance, policies, args.seed))
    workload = WorkloadConfig(num_requests=args.num_requests, arrival=args.arrival, lengths=args.trace,
                              seed=args.seed)
    start = time.perf_counter()
    result = plan_deployment(request, workload, log=(lambda _: None) if args.json else
                             (lambda line: print(f"  simulated {line}", flush=True)))
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps({"plans": [dict(dataclasses.asdict(p), gpus=p.gpus) for p in result.deployments],
                          "simulated": result.simulated, "pruned": result.pruned,
                          "seconds": round(elapsed, 1)}, indent=1))
        return 0 if result.deployments else 1
    print(f"{result.simulated} candidates simulated in {elapsed:.0f} s; pruned before simulating: "
          + (", ".join(f"{n} ({why})" for why, n in result.pruned.items()) or "none"))
    if not result.deployments:
        print(f"no deployment of at most {args.max_gpus} GPUs serves {args.qps:g} QPS within the SLOs")
        return 1
    print(f"{'GPUs':>5} {'replicas':>8} {'TP':>3} {'PP':>3} {'policy':>8} {'budget':>6} "
          f"{'QPS/replica':>11} {'headroom':>8}")
    for p in result.deployments:
        print(f"{p.gpus:>5} {p.replicas:>8} {p.tp:>3} {p.pp:>3} {p.policy:>8} {p.token_budget:>6} "
              f"{p.capacity_qps:>11.3g} {p.headroom:>8.0%}")
    return 0

"""`sarathi-rt capacity`: the highest QPS each policy serves with P99 TBT within the SLO
and P50 scheduling delay within 2 s (with --qos-classes: with every class at or above
--attainment), found by bisection on the engine or (--simulate) on the simulator.
Without --token-budget the chunked policies get the default budget rule: each step
sized to the SLO (the adaptive budget); `--budget-rule slo-static`
derives one static budget instead, the largest tile-aligned step whose measured (or
modelled) time stays within the SLO. At each policy's capacity it prints the SLO-first
metrics `bench` prints (P99.9 and max TBT, prefill-wait share, goodput against
--ttft-slo and --tbt-slo)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from sarathi_rt.sim.capacity import SLO, AttainmentSLO, CapacityResult, find_capacity
from sarathi_rt.measure.metrics import MetricsSummary, summarize
from sarathi_rt.measure.slo import SLOMetrics, slo_metrics
from sarathi_rt.workloads import make_workload

from .bench import format_slo_table
from ._serving import EngineBackend, SimBackend, add_common_args, fill_defaults, make_backend, optional_plots, \
    parse_policies, policy_budget, slo_derived_budget, workload_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("capacity", help="max QPS per policy under a TBT SLO",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, policies="sarathi,vllm")
    p.add_argument("--attainment", type=float,
                   help="with --qos-classes: the share of each class's requests that must meet their deadlines "
                        "(default 0.99)")
    p.add_argument("--ttft-slo", type=float, default=None, help="time-to-first-token target (s) of goodput")
    p.add_argument("--max-sched-delay", type=float, default=2.0, help="P50 scheduling delay limit (s)")
    p.add_argument("--qps-start", type=float, default=1.0, help="first rate probed")
    p.add_argument("--rel-tol", type=float, default=0.02, help="stop when the bracket is this tight")
    p.add_argument("--max-probes", type=int, default=16, help="most runs per policy")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    fill_defaults(args, num_requests=(12, 1000), length_scale=(1 / 8, 1.0))
    policies = parse_policies(args.policy)
    slo: SLO | AttainmentSLO
    if args.qos_classes is not None:
        slo = AttainmentSLO(0.99 if args.attainment is None else args.attainment)
    elif args.tbt_slo is None:
        raise ValueError("--tbt-slo is required (or --qos-classes with --qos-mix)")
    else:
        slo = SLO(args.tbt_slo, args.max_sched_delay)
    backend = make_backend(args)
    try:
        return _capacity(args, policies, slo, backend)
    finally:
        backend.close()  # stops the engine's worker processes, if any


def _capacity(args: argparse.Namespace, policies: list[str], slo: SLO, backend: SimBackend | EngineBackend) -> int:
    os.makedirs(args.out, exist_ok=True)
    slo_derived_budget(args, backend)
    config = workload_config(args, args.qps_start, backend.max_total_tokens)
    results: dict[str, CapacityResult] = {}
    tails: dict[str, dict[float, SLOMetrics]] = {p: {} for p in policies}  # by policy, then probed rate
    for policy in policies:

        def at_qps(qps: float, policy: str = policy) -> MetricsSummary:
            workload = make_workload(dataclasses.replace(config, qps=qps))
            requests, steps = backend.run(policy, workload, None)
            summary = summarize(requests, steps, args.stall_factor, args.qos_classes)
            tails[policy][qps] = slo_metrics(requests, steps, args.ttft_slo, args.tbt_slo)
            classes = "".join(f", {c} {q.attainment:.1%}" for c, q in summary.qos.items())
            print(f"  {policy} @ {qps:.4g} QPS: P99 TBT {summary.tbt.p99 * 1e3:.1f} ms, "
                  f"P50 sched delay {summary.sched_delay.p50:.3g} s{classes}")
            return summary

        results[policy] = find_capacity(at_qps, slo, policy=policy, qps_start=args.qps_start,
                                        rel_tol=args.rel_tol, max_probes=args.max_probes)
        print(f"{policy}: capacity {results[policy].max_qps:.4g} QPS")
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        json.dump({p: r.max_qps for p, r in results.items()}, f, indent=2)
    # The capacity is a probed rate that passed (or 0.0, never probed).
    at_capacity = {p: tails[p].get(r.max_qps) for p, r in results.items()}
    with open(os.path.join(args.out, "capacity_probes.json"), "w") as f:
        budgets = {p: policy_budget(args, p).token_budget for p in policies}
        json.dump({"token_budget": budgets, "tbt_slo": args.tbt_slo, "ttft_slo": args.ttft_slo,
                   "probes": {p: [{**dataclasses.asdict(x), "slo": tails[p][x.qps].to_dict()} for x in r.probes]
                              for p, r in results.items()},
                   "at_capacity": {p: m and m.to_dict() for p, m in at_capacity.items()}}, f, indent=1)
    found = {f"{p} @ {results[p].max_qps:.4g} QPS": m for p, m in at_capacity.items() if m is not None}
    if found:
        print("at capacity:\n" + format_slo_table(found))
    plots = optional_plots()
    if plots is not None:
        plots.plot_capacity(results, args.tbt_slo, os.path.join(args.out, "capacity.png"))
    if "sarathi" in results and "vllm" in results and results["vllm"].max_qps > 0:
        print(f"sarathi / vllm capacity = {results['sarathi'].max_qps / results['vllm'].max_qps:.2f}x")
    print(f"wrote {args.out}/capacity.json, capacity_probes.json" + (", capacity.png" if plots else ""))
    return 0

"""`sarathi-rt bench`: serve the same workload with several scheduling policies and
compare latency: TTFT, TBT, generation stalls, throughput, scheduling delay.

By default it runs the real engine on the CPU (the cpu-small preset, ShareGPT lengths
scaled to 1/8); `--simulate` replays the workload through the simulator with an A100
cost model instead."""
from __future__ import annotations

import argparse
import json
import math
import os
import time

from tqdm.auto import tqdm

from sarathi_rt.metrics import MetricsSummary, save_requests_csv, save_steps_csv, summarize
from sarathi_rt.slo_metrics import SLOMetrics, slo_metrics
from sarathi_rt.workloads import make_workload

from ._serving import add_common_args, fill_defaults, make_backend, optional_plots, parse_policies, workload_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="compare scheduling policies on one workload",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, policies="sarathi,vllm,orca")
    p.add_argument("--qps", type=float, default=None, help="request rate (default: 0.75 on the engine, 1.5 simulated)")
    p.add_argument("--tbt-slo", type=float, default=None,
                   help="time-between-tokens target (s): of --adaptive-budget, and of goodput")
    p.add_argument("--ttft-slo", type=float, default=None, help="time-to-first-token target (s) of goodput")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    fill_defaults(args, qps=(0.75, 1.5), num_requests=(12, 1000), length_scale=(1 / 8, 1.0),
                  token_budget=(32, 512), max_num_seqs=(32, 128))
    policies = parse_policies(args.policy)
    backend = make_backend(args)
    workload = make_workload(workload_config(args, args.qps, backend.max_total_tokens))
    os.makedirs(args.out, exist_ok=True)
    mode = "simulator" if args.simulate else f"{args.model} on {args.device}"
    print(f"sarathi-rt bench: {len(workload)} requests of {args.trace} (length x{args.length_scale:.4g}) at "
          f"{args.qps:g} QPS, {mode}; chunked policies: token budget {args.token_budget}")
    summaries: dict[str, MetricsSummary] = {}
    slos: dict[str, SLOMetrics] = {}
    tbts, steps_by_policy = {}, {}
    for policy in policies:
        start = time.perf_counter()
        with tqdm(total=len(workload), desc=f"{policy:>8}", unit="req", leave=False) as bar:
            requests, steps = backend.run(policy, workload, bar.update)
        summaries[policy] = summarize(requests, steps, args.stall_factor)
        slos[policy] = slo_metrics(requests, steps, args.ttft_slo, args.tbt_slo)
        tbts[policy] = [g for r in requests for g in r.tbts]
        steps_by_policy[policy] = steps
        save_requests_csv(os.path.join(args.out, f"{policy}_requests.csv"), requests)
        save_steps_csv(os.path.join(args.out, f"{policy}_steps.csv"), steps)
        print(f"  {policy}: {len(steps)} steps in {time.perf_counter() - start:.1f} s")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({p: {**s.bench_dict(), **slos[p].to_dict()} for p, s in summaries.items()}, f, indent=2)
    written = "summary.json"
    plots = optional_plots()
    if plots is not None:
        plots.plot_tbt_cdf(tbts, os.path.join(args.out, "tbt_cdf.png"))
        plots.plot_tokens_per_step(steps_by_policy, os.path.join(args.out, "tokens_per_step.png"))
        written += ", tbt_cdf.png, tokens_per_step.png"
    print(format_table(summaries))
    print(format_slo_table(slos))
    if "sarathi" in summaries and "vllm" in summaries:
        s, v = summaries["sarathi"], summaries["vllm"]
        ratio = s.tbt.p99 / v.tbt.p99 if v.tbt.p99 > 0 else math.nan
        print(f"sarathi P99 TBT / vllm P99 TBT = {ratio:.3f}; stalls {s.stalls} vs {v.stalls}")
    print(f"wrote {args.out}/{written} and per-policy CSVs")
    return 0


def format_table(summaries: dict[str, MetricsSummary]) -> str:
    head = ["policy", "TTFT P50", "TTFT P99", "TBT P50", "TBT P99", "stalls", "tokens/s", "sched P50",
            "preempt"]
    rows = [[p, _ms(s.ttft.p50), _ms(s.ttft.p99), _ms(s.tbt.p50), _ms(s.tbt.p99), str(s.stalls),
             f"{s.tokens_per_s:.1f}", _ms(s.sched_delay.p50), str(s.num_preemptions)]
            for p, s in summaries.items()]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(times in ms)"


def format_slo_table(slos: dict[str, SLOMetrics]) -> str:
    head = ["policy", "TBT P99.9", "TBT max", "worst gap P50", "prefill wait", "goodput", "step err P50",
            "step err P99"]
    rows = [[p, _ms(m.tbt_p999), _ms(m.tbt_max), _ms(m.request_max_tbt.p50), _pct(m.prefill_wait_share),
             "n/a" if math.isnan(m.goodput) else f"{m.goodput:.3f}/s", _pct(m.step_error_p50), _pct(m.step_error_p99)]
            for p, m in slos.items()]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(goodput: requests within --ttft-slo and --tbt-slo; step err: the adaptive " \
                               "budget's step-time forecasts)"


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"

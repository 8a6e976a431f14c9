"""The adaptive token budget on the real engine (CPU), with a load whose mix changes
mid-run: a quiet phase of short chats, then a burst of long prompts.

The TBT SLO is --slo-factor x the measured time of a 32-token hybrid step (8 decodes),
so the study means the same on any machine. Three engines serve the same seeded
requests: a static budget tuned for the quiet phase (--quiet-budget: whole short
prompts in one step), a static budget tuned for the burst (the SLO-derived budget: the
largest multiple of 16 whose measured step with 8 decodes meets the SLO), and the
adaptive budget (LLM(tbt_slo=S), capped at --quiet-budget). Per phase (a gap belongs to
the phase its later token falls in; a request to the phase it arrives in): P99 TBT,
TTFT P50 and generated tokens/s.

    python bench/bench_adaptive_budget_engine.py [--model cpu-small] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from sarathi_rt.harness.step_timing import measure_step_curve
from sarathi_rt.sim.budget import choose_token_budget
from sarathi_rt.measure.metrics import RequestMetrics, StepMetrics, percentile
from sarathi_rt.workloads import RequestSpec


def phased_workload(args: argparse.Namespace) -> tuple[list[RequestSpec], float]:
    rng = np.random.default_rng(args.seed)
    quiet = np.cumsum(rng.exponential(1 / args.quiet_qps, args.quiet_requests))
    start = float(quiet[-1]) + 1.0 / args.quiet_qps
    burst = start + np.cumsum(rng.exponential(1 / args.burst_qps, args.burst_requests)) - 1 / args.burst_qps
    specs = [(float(t), int(rng.integers(24, 97)), int(rng.integers(24, 65))) for t in quiet - quiet[0]]
    specs += [(float(t - quiet[0]), int(rng.integers(args.burst_prompt // 2, args.burst_prompt + 1)),
               int(rng.integers(16, 33))) for t in burst]
    return [RequestSpec(i, t, p, d) for i, (t, p, d) in enumerate(specs)], start - float(quiet[0])


def phase_stats(requests: list[RequestMetrics], steps: list[StepMetrics], t0: float, burst_at: float) -> dict:
    out = {}
    end = max(r.finish_time for r in requests)  # type: ignore[type-var]
    for name, lo, hi in (("quiet", t0, t0 + burst_at), ("burst", t0 + burst_at, end)):
        gaps = [b - a for r in requests for a, b in zip(r.token_times, r.token_times[1:]) if lo <= b < hi]
        ttft = [r.ttft for r in requests if lo <= r.arrival_time < hi and r.ttft is not None]
        tokens = sum(1 for r in requests for t in r.token_times if lo <= t < hi)
        out[name] = {"tbt_p99": percentile(gaps, 99), "ttft_p50": percentile(ttft, 50),
                     "tokens_per_s": tokens / (hi - lo) if hi > lo else float("nan"),
                     "steps": sum(1 for s in steps if lo <= s.start_time < hi)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cpu-small")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quiet-requests", type=int, default=10)
    p.add_argument("--quiet-qps", type=float, default=1.0)
    p.add_argument("--burst-requests", type=int, default=8)
    p.add_argument("--burst-qps", type=float, default=2.0)
    p.add_argument("--burst-prompt", type=int, default=1024, help="longest burst prompt (shortest: half)")
    p.add_argument("--quiet-budget", type=int, default=512)
    p.add_argument("--slo-factor", type=float, default=2.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/adaptive_engine")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny, seconds-long run of the same code path (the quick test lane runs it)")
    args = p.parse_args()
    if args.smoke:
        args.model, args.quiet_requests, args.burst_requests, args.burst_prompt = "tiny", 4, 4, 128
        args.quiet_budget, args.quiet_qps, args.burst_qps = 128, 4.0, 8.0
    import torch

    from sarathi_rt import LLM
    from sarathi_rt.harness.replay import replay, warm_up
    from sarathi_rt.measure.slo import slo_metrics

    torch.set_num_threads(args.threads)
    workload, burst_at = phased_workload(args)

    def engine(budget: int, slo: float | None = None):
        return LLM(args.model, token_budget=budget, max_num_seqs=32, tbt_slo=slo, seed=args.seed).engine

    probe = engine(args.quiet_budget)
    warm_up(probe)
    profile = measure_step_curve(probe, list(range(16, args.quiet_budget + 1, 16)), num_decodes=8, context_len=128,
                                repeats=3, warmup=1)
    # Never below the factor times the smallest step: on a busy machine one timing spike
    # of the 16-token step would otherwise leave no tile-aligned budget within the SLO.
    slo = args.slo_factor * max(profile.step_time(16), profile.step_time(32))
    burst_budget = choose_token_budget(profile, slo, 16).token_budget
    print(f"{args.model}, {args.threads} thread(s): T(32) = {profile.step_time(32) * 1e3:.1f} ms, "
          f"T({args.quiet_budget}) = {profile.step_time(args.quiet_budget) * 1e3:.1f} ms -> SLO {slo * 1e3:.1f} ms; "
          f"burst-tuned static budget {burst_budget}; burst at t = {burst_at:.1f} s")
    configs = {f"static {args.quiet_budget} (quiet-tuned)": (args.quiet_budget, None),
               f"static {burst_budget} (burst-tuned)": (burst_budget, None),
               f"adaptive (cap {args.quiet_budget})": (args.quiet_budget, slo)}
    results = {}
    for name, (budget, tbt_slo) in configs.items():
        eng = engine(budget, tbt_slo)
        warm_up(eng)
        requests, steps = replay(eng, workload, seed=args.seed)
        t0 = min(r.arrival_time for r in requests)
        results[name] = phase_stats(requests, steps, t0, burst_at)
        m = slo_metrics(requests, steps, tbt_target=slo)
        results[name]["step_error"] = {"p50": m.step_error_p50, "p99": m.step_error_p99,
                                       "under_predicted": m.under_predicted}
        print(f"  ran {name}: {len(steps)} steps", flush=True)
    print(f"\nSLO {slo * 1e3:.1f} ms (P99 TBT per phase)")
    print(f"{'config':>28} | {'quiet P99 TBT':>13} {'TTFT P50':>9} {'tok/s':>6} | "
          f"{'burst P99 TBT':>13} {'TTFT P50':>9} {'tok/s':>6}")
    for name, r in results.items():
        q, b = r["quiet"], r["burst"]
        print(f"{name:>28} | {q['tbt_p99'] * 1e3:10.1f} ms {q['ttft_p50'] * 1e3:6.0f} ms {q['tokens_per_s']:6.1f} | "
              f"{b['tbt_p99'] * 1e3:10.1f} ms {b['ttft_p50'] * 1e3:6.0f} ms {b['tokens_per_s']:6.1f}")
    adaptive = results[f"adaptive (cap {args.quiet_budget})"]["step_error"]
    print(f"adaptive step-time forecasts: |error| P50 {100 * adaptive['p50']:.1f}%, P99 {100 * adaptive['p99']:.1f}%, "
          f"{100 * adaptive['under_predicted']:.0f}% of steps took longer than forecast")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "phases.json"), "w") as f:
        json.dump({"slo_s": slo, "burst_at_s": burst_at, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

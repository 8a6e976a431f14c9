"""Does the simulator predict this machine? For each workload: profile the CPU engine by
step shape (`sarathi-rt profile`, just before), run the real engine `--runs` times per
policy, simulate the same seeded workload with the profile, and print each metric's
simulated error against the real median next to the real runs' own spread
((max - min) / median). A metric passes when its error is within the spread or 10%.

A shared machine's speed drifts by tens of percent within minutes, so the profile's own
mixed batches are re-timed beside every real run (`speed_factor`) and the simulation runs
at the median of those speeds (ShapeCostModel's time_scale); the error at the profile's
speed is printed beside it.

    python bench/bench_sim_fidelity.py [--workloads 12@0.75,24@1.5] [--policies sarathi,vllm]
                                       [--runs 3] [--repeats 3] [--threads 1]

Workloads are NUM_REQUESTS@QPS of `sarathi-rt bench`'s engine defaults (cpu-small,
ShareGPT lengths / 8, token budget 32, max_num_seqs 32).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from sarathi_rt.commands._serving import EngineBackend, SimBackend, add_common_args, fill_defaults
from sarathi_rt.metrics import MetricsSummary, summarize
from sarathi_rt.shape_profiling import speed_factor
from sarathi_rt.sim.shape_model import ShapeCostModel
from sarathi_rt.workloads import make_workload

METRICS = {"TTFT P50": lambda s: s.ttft.p50, "TTFT P99": lambda s: s.ttft.p99, "TBT P50": lambda s: s.tbt.p50,
           "TBT P99": lambda s: s.tbt.p99, "steps": lambda s: s.num_steps, "stalls": lambda s: s.stalls,
           "tokens/s": lambda s: s.tokens_per_s}


def serving_args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_common_args(p, policies="sarathi,vllm")
    p.add_argument("--tbt-slo", type=float, default=None)
    args = p.parse_args(extra)
    fill_defaults(args, num_requests=(12, 1000), length_scale=(1 / 8, 1.0), token_budget=(32, 512),
                  max_num_seqs=(32, 128))
    return args


def compare(real: list[MetricsSummary], sim: MetricsSummary) -> list[tuple[str, float, float, float, bool]]:
    rows = []
    for name, get in METRICS.items():
        values = [get(s) for s in real]
        med = statistics.median(values)
        spread = (max(values) - min(values)) / med if med else 0.0
        err = get(sim) / med - 1 if med else (0.0 if get(sim) == 0 else float("inf"))
        rows.append((name, med, get(sim), err, abs(err) <= max(spread, 0.10)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="12@0.75,24@1.5")
    p.add_argument("--policies", default="sarathi,vllm")
    p.add_argument("--runs", type=int, default=3, help="real runs per policy and workload")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each profiled batch")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_out/sim_fidelity")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report = {}
    for spec in args.workloads.split(","):
        n, qps = spec.split("@")
        common = ["--num-requests", n, "--threads", str(args.threads), "--policy", args.policies]
        t0 = time.perf_counter()
        prof_dir = os.path.join(args.out, f"profile_{n}at{qps}")
        from sarathi_rt.cli import main as cli

        cli(["profile", *common, "--qps", qps, "--repeats", str(args.repeats), "--out", prof_dir])
        profile = os.path.join(prof_dir, "step_profile.json")
        eng = EngineBackend(serving_args(common))
        sim = SimBackend(serving_args([*common, "--simulate", "--profile", profile, "--length-scale", "0.125",
                                       "--token-budget", "32", "--max-num-seqs", "32"]))
        workload = make_workload(_workload(eng.args, float(qps), eng.max_total_tokens))
        assert workload == make_workload(_workload(sim.args, float(qps), sim.max_total_tokens))
        report[spec] = {}
        as_measured = sim.cost_model  # a ShapeCostModel of the profile, at its own speed
        for policy in args.policies.split(","):
            # The machine's speed, re-timed beside every real run (before each and after
            # the last) on the profile's own mixed batches; the simulation runs at their
            # median, and once more at the profile's speed for comparison.
            real, speed = [], [speed_factor(eng.engine(policy, workload), as_measured.profile)]
            for _ in range(args.runs):
                real.append(summarize(*eng.run(policy, workload, None)))
                speed.append(speed_factor(eng.engine(policy, workload), as_measured.profile))
            scale = statistics.median(speed)
            sim.cost_model = as_measured
            as_profiled = compare(real, summarize(*sim.run(policy, workload, None)))
            sim.cost_model = ShapeCostModel(as_measured.profile, time_scale=scale)
            rows = compare(real, summarize(*sim.run(policy, workload, None)))
            report[spec][policy] = {
                "speed": speed, "time_scale": scale,
                "metrics": [dict(zip(("metric", "real", "sim", "error", "ok", "error_as_profiled"), (*r, a[3])))
                            for r, a in zip(rows, as_profiled)]}
            print(f"\n{n} requests at {qps} QPS, {policy} ({args.runs} real runs; machine speed beside them "
                  f"{', '.join(f'{x:.3f}' for x in speed)}x of the profile's, simulated at {scale:.3f}x):")
            for (name, med, s, err, ok), a in zip(rows, as_profiled):
                spread = _spread([METRICS[name](x) for x in real])
                print(f"  {name:>9}: real {med:9.4g} (spread {100 * spread:5.1f}%)  sim {s:9.4g}  "
                      f"error {100 * err:+6.1f}%  {'ok' if ok else 'MISS'}  (at the profile's speed: "
                      f"{100 * a[3]:+6.1f}% {'ok' if a[4] else 'MISS'})")
        print(f"({time.perf_counter() - t0:.0f} s for this workload)", flush=True)
    with open(os.path.join(args.out, "fidelity.json"), "w") as f:
        json.dump(report, f, indent=1)


def _workload(args: argparse.Namespace, qps: float, max_total_tokens: int | None):
    from sarathi_rt.commands._serving import workload_config

    return workload_config(args, qps, max_total_tokens)


def _spread(values: list[float]) -> float:
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med else 0.0


if __name__ == "__main__":
    main()

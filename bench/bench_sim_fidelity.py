"""Does the simulator predict this machine? For each workload: profile the CPU engine by
step shape (`sarathi-rt profile`, just before), run the real engine `--runs` times per
policy, simulate the same seeded workload with the profile, and print each metric's
simulated error against the real median next to the real runs' own spread
((max - min) / median). A metric passes when its error is within the spread or 10%.

A shared machine's speed drifts by tens of percent within minutes, so the simulation
runs at the machine's speed, measured two ways against the profile's model: steps of the
simulated run (every n/32-th of its n: 32 to 63) are re-timed on the engine beside every real run
(`speed_factor`, before each and after the last: a prediction made before the run), and
each real run's own steps are read as they run (`run_speed`: the speed that run had).
The simulation at the median probe is the headline; the errors at each run's own speed
(one simulation per real run, their median) and at the profile's speed are printed
beside it. One timing of a batch on a 2-core VM jitters by ~25% (p10 to p90 of
back-to-back repeats), hence 9 rounds.

    python bench/bench_sim_fidelity.py [--workloads 12@0.75,24@1.5] [--policies sarathi,vllm]
                                       [--runs 3] [--repeats 9] [--threads 1]

Workloads are NUM_REQUESTS@QPS of `sarathi-rt bench`'s engine defaults (cpu-small,
ShareGPT lengths / 8, token budget 32, max_num_seqs 32).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from sarathi_rt.commands._serving import EngineBackend, SimBackend, add_common_args, fill_defaults, scheduler_config
from sarathi_rt.engine import LLMEngine
from sarathi_rt.measure.metrics import MetricsSummary, summarize
from sarathi_rt.harness.replay import replay, warm_up
from sarathi_rt.scheduler import BatchPlan
from sarathi_rt.step_time.shape import StepShape
from sarathi_rt.harness.shape_profiling import run_speed, speed_factor
from sarathi_rt.sim.shape_model import ShapeCostModel
from sarathi_rt.sim.simulator import simulate
from sarathi_rt.workloads import RequestSpec, make_workload

METRICS = {"TTFT P50": lambda s: s.ttft.p50, "TTFT P99": lambda s: s.ttft.p99, "TBT P50": lambda s: s.tbt.p50,
           "TBT P99": lambda s: s.tbt.p99, "steps": lambda s: s.num_steps, "stalls": lambda s: s.stalls,
           "tokens/s": lambda s: s.tokens_per_s}
PROBE_STEPS = 32  # every n/32-th of a simulated run's n steps is re-timed per probe: ~5 s on the CPU engine


def serving_args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_common_args(p, policies="sarathi,vllm")
    args = p.parse_args(extra)
    fill_defaults(args, num_requests=(12, 1000), length_scale=(1 / 8, 1.0))
    return args


def compare(real: list[MetricsSummary], sims: list[MetricsSummary]) -> list[tuple[str, float, float, float, bool]]:
    """Per metric: the real median, the simulated one (the median over `sims`), the
    error and whether it is within the real runs' spread or 10%."""
    rows = []
    for name, get in METRICS.items():
        values = [get(s) for s in real]
        med, sim = statistics.median(values), statistics.median(get(s) for s in sims)
        err = sim / med - 1 if med else (0.0 if sim == 0 else float("inf"))
        rows.append((name, med, sim, err, abs(err) <= max(_spread(values), 0.10)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="12@0.75,24@1.5")
    p.add_argument("--policies", default="sarathi,vllm")
    p.add_argument("--runs", type=int, default=3, help="real runs per policy and workload")
    p.add_argument("--repeats", type=int, default=9, help="timed repeats (shuffled rounds) of each profiled batch")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default="cpu-small", help="the engine's model (smoke: the tiny preset)")
    p.add_argument("--out", default="bench_out/sim_fidelity")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = p.parse_args()
    if args.smoke:
        args.workloads, args.policies, args.runs, args.repeats, args.model = "3@2", "sarathi", 1, 1, "tiny"
    os.makedirs(args.out, exist_ok=True)
    report = {}
    for spec in args.workloads.split(","):
        n, qps = spec.split("@")
        # The engine these runs were tuned on: 32-token steps of at most 32 requests.
        common = ["--num-requests", n, "--policy", args.policies, "--token-budget", "32", "--max-num-seqs", "32"]
        engine = [*common, "--threads", str(args.threads), "--model", args.model]
        t0 = time.perf_counter()
        prof_dir = os.path.join(args.out, f"profile_{n}at{qps}")
        from sarathi_rt.cli import main as cli

        cli(["profile", *engine, "--qps", qps, "--repeats", str(args.repeats), "--out", prof_dir])
        profile = os.path.join(prof_dir, "step_profile.json")
        eng = EngineBackend(serving_args(engine))
        sim = SimBackend(serving_args([*common, "--simulate", "--step-profile", profile, "--length-scale", "0.125",
                                       "--token-budget", "32", "--max-num-seqs", "32"]))
        workload = make_workload(_workload(eng.args, float(qps), eng.max_total_tokens))
        assert workload == make_workload(_workload(sim.args, float(qps), sim.max_total_tokens))
        report[spec] = {}
        as_measured = sim.cost_model  # a ShapeCostModel of the profile, at its own speed
        for policy in args.policies.split(","):
            plans: list[BatchPlan] = []
            at_profile = _simulate(sim, as_measured, 1.0, policy, workload, plans)
            probe = plans[::max(1, len(plans) // PROBE_STEPS)]
            real, speed, own = [], [speed_factor(eng.engine(policy, workload), as_measured, probe)], []
            for _ in range(args.runs):
                summary, run_steps = _real_run(eng.engine(policy, workload), workload, eng.args.seed)
                real.append(summary)
                own.append(run_speed(as_measured, run_steps))
                speed.append(speed_factor(eng.engine(policy, workload), as_measured, probe))
            scale = statistics.median(speed)
            at = {"probed": compare(real, [_simulate(sim, as_measured, scale, policy, workload)]),
                  "own": compare(real, [_simulate(sim, as_measured, x, policy, workload) for x in own]),
                  "profile": compare(real, [at_profile])}
            report[spec][policy] = {
                "probed_speed": speed, "time_scale": scale, "own_speed": own,
                "metrics": [{"metric": r[0], "real": r[1], **{f"sim_{k}": at[k][i][2] for k in at},
                             **{f"error_{k}": at[k][i][3] for k in at}, **{f"ok_{k}": at[k][i][4] for k in at}}
                            for i, r in enumerate(at["probed"])]}
            print(f"\n{n} requests at {qps} QPS, {policy} ({args.runs} real runs; speed probed beside them "
                  f"{', '.join(f'{x:.3f}' for x in speed)}x of the profile's, simulated at {scale:.3f}x; "
                  f"the runs' own speed {', '.join(f'{x:.3f}' for x in own)}x):")
            for i, (name, med, s, err, ok) in enumerate(at["probed"]):
                spread = _spread([METRICS[name](x) for x in real])
                print(f"  {name:>9}: real {med:9.4g} (spread {100 * spread:5.1f}%)  sim {s:9.4g}  "
                      f"error {100 * err:+6.1f}% {'ok' if ok else 'MISS'}  (at the runs' own speed "
                      f"{_cell(at['own'][i])}, at the profile's {_cell(at['profile'][i])})")
            for k, rows in at.items():
                print(f"  in target at the {k} speed: {sum(r[4] for r in rows)} of {len(rows)}", flush=True)
        print(f"({time.perf_counter() - t0:.0f} s for this workload)", flush=True)
    with open(os.path.join(args.out, "fidelity.json"), "w") as f:
        json.dump(report, f, indent=1)


def _real_run(engine: LLMEngine, workload: list[RequestSpec], seed: int
              ) -> tuple[MetricsSummary, list[tuple[StepShape, float]]]:
    """One real run, with each step's shape and measured time (warm-up steps excluded)."""
    warm_up(engine)
    steps: list[tuple[StepShape, float]] = []
    engine.step_observer = lambda plan, seconds: steps.append((StepShape.of_plan(plan), seconds))
    summary = summarize(*replay(engine, workload, seed=seed))
    engine.step_observer = None
    return summary, steps


def _simulate(sim: SimBackend, model: ShapeCostModel, scale: float, policy: str, workload: list[RequestSpec],
              plans: list[BatchPlan] | None = None) -> MetricsSummary:
    """The simulated run at `scale` x the profile's time; its plans appended to `plans`."""
    cost = model if scale == 1.0 else ShapeCostModel(model.profile, time_scale=scale)
    res = simulate(workload, scheduler_config(sim.args, policy, workload, sim.num_blocks), cost,
                   step_observer=None if plans is None else lambda plan, _: plans.append(plan))
    return summarize(res.requests, res.steps)


def _cell(row: tuple[str, float, float, float, bool]) -> str:
    return f"{100 * row[3]:+6.1f}% {'ok' if row[4] else 'MISS'}"


def _workload(args: argparse.Namespace, qps: float, max_total_tokens: int | None):
    from sarathi_rt.commands._serving import workload_config

    return workload_config(args, qps, max_total_tokens)


def _spread(values: list[float]) -> float:
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med else 0.0


if __name__ == "__main__":
    main()

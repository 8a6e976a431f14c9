"""Per-step overhead of the engine: ms per step on the `tiny` preset with 64 running
decodes, where the model's compute is a small part of the step and the rest is Python
(scheduling, step input, preparing the context, per-layer op calls, sampling, outputs).

    python bench/bench_step_overhead.py [--decodes 64] [--steps 300] [--repeats 5]
    python bench/bench_step_overhead.py --baseline OLD/python [--pairs 5]
    python bench/bench_step_overhead.py --compile-pairs 5

Prints the median wall ms per step over `repeats` runs of `steps` decode steps each,
the process CPU ms per step, and the ratio to the targets (0.8 ms on a quiet machine,
1.5 ms with other work running). After each bare run the same number of steps runs again
with timers on every phase (`harness.step_split`): schedule, step input, prepare, the
forward's linear layers, attention (rotary, KV write, kernel) and other ops, the LM head,
sampling, processing the outputs and the scheduler's update, and the engine's glue
(`python`). The breakdown is each phase's mean ms per step over the faster half of a
timed run's steps (the slower ones caught the process waiting for a core), the median
over the repeats, beside those steps' own wall ms (against the bare median: the timers'
cost, ~1 us each).

With --baseline (the `python/` directory of another checkout, built in place) it runs
this script in `pairs` pairs of fresh processes, the baseline's package against this one,
alternating which goes first, and prints both medians and the median of the pairs' ratios:
this VM's speed drifts by up to 2x within minutes, so only a comparison made in the same
minutes means anything (`git worktree add /tmp/base <commit>` and build it in place for
the baseline). A baseline without `harness.step_split` prints no breakdown.

--compile on|off|auto sets the engine's `compile` option (engine/compiled_forward.py).
Only the eager layers (`--compile off`) have per-op timers: the default, the layer loop
(models/layer_loop.py), and a compiled forward print no breakdown. --compile-pairs N
runs N pairs of fresh processes of this package, eager (--compile off) against compiled
(--compile on), alternating which goes first, and prints the same medians and ratios,
and the median seconds the compiled side's `LLM()` took (it compiles the warm-up step's
bucket; the 64-decode steps compile theirs during the untimed warm-up).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

# The native kernels size their OpenMP team when the library loads: give them the same
# thread count as torch (--threads) before anything imports it.
_threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "1"
os.environ.setdefault("OMP_NUM_THREADS", _threads)

import torch  # noqa: E402

from sarathi_rt import LLM, SamplingParams  # noqa: E402
from ab_pairs import run_pairs, run_sides, this_package  # noqa: E402

QUIET_TARGET_MS, LOADED_TARGET_MS = 0.8, 1.5


def run_once(llm: LLM, decodes: int, steps: int, split: Any = None) -> tuple[float, float, dict[str, float]]:
    """Median wall seconds per pure-decode step with `decodes` requests running and the
    mean process CPU seconds per step (steadier than wall time on a shared machine).
    With `split` (a StepSplit) the steps run timed, and the third item is the breakdown
    in ms per step (with `timed`, the wall ms) over the faster half of the steps: on a
    shared machine the slower ones include the time the process waited for a core,
    which would land on whichever phase it happened in."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 500 for j in range(16)], params)
    while True:  # prefill every prompt first
        engine.step()
        if all(len(s.output) > 0 for s in engine._seqs.values()):
            break
    times, phases = [], []
    cpu = time.process_time()
    with split if split is not None else contextlib.nullcontext():
        for _ in range(steps):
            before = dict(split.seconds) if split is not None else None
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            if split is not None:
                phases.append({k: v - before[k] for k, v in split.seconds.items()})
    cpu = (time.process_time() - cpu) / steps
    for request_id in list(engine._seqs):
        engine.abort(request_id)
    engine.step()
    breakdown: dict[str, float] = {}
    if split is not None:
        fast = [i for i in range(steps) if times[i] <= statistics.median(times)]
        split.seconds = {k: sum(phases[i][k] for i in fast) for k in phases[0]}
        wall = sum(times[i] for i in fast)
        breakdown = {k: v / len(fast) for k, v in split.ms(wall).items()}
        breakdown["timed"] = 1e3 * wall / len(fast)
    return statistics.median(times), cpu, breakdown


def measure(decodes: int, steps: int, repeats: int, threads: int, compile_mode: str | None) -> dict[str, Any]:
    """Bare runs for the headline; after each, a timed run for the breakdown (absent
    when the package measured has no step_split, or its layers run in the layer loop or
    compiled)."""
    torch.set_num_threads(threads)
    options = {} if compile_mode is None else {"compile": compile_mode}
    start = time.perf_counter()
    llm = LLM("tiny", token_budget=max(decodes, 64), max_num_seqs=decodes, num_kv_blocks=1024, **options)
    startup = time.perf_counter() - start
    try:
        from sarathi_rt.harness.step_split import StepSplit
    except ImportError:  # a baseline from before the breakdown
        StepSplit = None
    worker = getattr(llm.engine.executor, "worker", None)
    compiled = getattr(worker, "run_stage", None) if worker is not None else None
    if compiled is not None and compiled is not worker.model:
        StepSplit = None
    run_once(llm, decodes, 20)  # warm-up
    runs, splits = [], []
    for _ in range(repeats):
        runs.append(run_once(llm, decodes, steps))
        if StepSplit is not None and worker is not None:
            splits.append(run_once(llm, decodes, steps, StepSplit(worker, llm.engine))[2])
    result: dict[str, Any] = {"wall_ms": statistics.median(r[0] for r in runs) * 1e3,
                              "cpu_ms": statistics.median(r[1] for r in runs) * 1e3,
                              "runs_ms": [r[0] * 1e3 for r in runs], "startup_s": startup,
                              "compile_s": getattr(compiled, "compile_seconds", {})}
    if splits:
        result["split_ms"] = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    return result


def print_split(label: str, split: dict[str, float]) -> None:
    """One line: each phase's ms per step, then the timed steps' own wall ms."""
    print(f"  {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items() if k != "timed")
          + f" ms/step (timed steps: {split['timed']:.3f} ms, the faster half of each timed run)")


def child_args(args: argparse.Namespace) -> list[str]:
    return ["--json", "--decodes", str(args.decodes), "--steps", str(args.steps), "--repeats", str(args.repeats),
            "--threads", str(args.threads)]


def compare(args: argparse.Namespace) -> None:
    """Pairs of fresh processes, the baseline's package and this one's, in alternating
    order; each prints its measure() as JSON."""
    results = run_pairs(__file__, child_args(args), args.baseline, args.pairs)
    print_pairs(args, results, ("baseline", f"baseline {args.baseline}"), ("this", f"this     {this_package()}"))


def compare_compiled(args: argparse.Namespace) -> None:
    """Pairs of fresh processes of this package, eager and compiled."""
    here = this_package()
    results = run_sides(__file__, {"eager": (here, child_args(args) + ["--compile", "off"]),
                                   "compiled": (here, child_args(args) + ["--compile", "on"])}, args.compile_pairs)
    print_pairs(args, results, ("eager", "eager   "), ("compiled", "compiled"))
    startup = {side: statistics.median(r["startup_s"] for r in results[side]) for side in results}
    print(f"  LLM() start-up, median: eager {startup['eager']:.2f} s, compiled {startup['compiled']:.2f} s")
    for bucket in sorted({b for r in results["compiled"] for b in r["compile_s"]}, key=int):
        seconds = [r["compile_s"][bucket] for r in results["compiled"] if bucket in r["compile_s"]]
        print(f"  bucket {bucket}: compiled in {len(seconds)} of the processes, median {statistics.median(seconds):.2f} s "
              f"(the step that compiled it)")


def print_pairs(args: argparse.Namespace, results: dict[str, list[dict]], base_side: tuple[str, str],
                this_side: tuple[str, str]) -> None:
    """Both sides' medians, the median of the pairs' ratios (second side / first) and the
    fastest runs, the targets and each side's breakdown where it has one."""
    (base_key, base_label), (this_key, this_label) = base_side, this_side
    base = [r["wall_ms"] for r in results[base_key]]
    this = [r["wall_ms"] for r in results[this_key]]
    ratios = [t / b for t, b in zip(this, base)]
    print(f"tiny, {args.decodes} decodes, {args.threads} thread(s), {len(ratios)} pairs of processes:")
    for label, values in ((base_label, base), (this_label, this)):
        print(f"  {label}: median {statistics.median(values):.3f} ms/step "
              f"(pairs: {', '.join(f'{x:.3f}' for x in values)})")
    print(f"  {this_key} / {base_key}: median {statistics.median(ratios):.2f}x "
          f"(pairs {min(ratios):.2f}-{max(ratios):.2f}x)")
    # The VM alternates between a fast and a slow state (up to 2x) within minutes: the
    # fastest run of each side is its time in the fast state.
    print(f"  fastest run: {base_key} {min(base):.3f} ms, {this_key} {min(this):.3f} ms "
          f"({min(this) / min(base):.2f}x)")
    print_targets(statistics.median(this), min(this))
    for side in (base_key, this_key):
        splits = [r["split_ms"] for r in results[side] if "split_ms" in r]
        if splits:
            print_split(f"{side} split", {k: statistics.median(s[k] for s in splits) for k in splits[0]})


def print_targets(median: float, fastest: float) -> None:
    """This code's median and fastest run against the two targets."""
    print(f"  targets: median {median:.3f} ms vs {LOADED_TARGET_MS} ms with other work "
          f"({median / LOADED_TARGET_MS:.2f}x), vs {QUIET_TARGET_MS} ms quiet ({median / QUIET_TARGET_MS:.2f}x); "
          f"fastest run {fastest:.3f} ms ({fastest / QUIET_TARGET_MS:.2f}x of the quiet target); "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads (1: overhead, not compute)")
    ap.add_argument("--baseline", default=None, help="another checkout's python/ directory to compare with")
    ap.add_argument("--pairs", type=int, default=5, help="with --baseline: pairs of processes")
    ap.add_argument("--compile", default=None, choices=("auto", "on", "off"),
                    help="the engine's compile option (default: the engine's default)")
    ap.add_argument("--compile-pairs", type=int, default=0,
                    help="pairs of processes of this package, eager against compiled")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = ap.parse_args()
    if args.smoke:
        args.decodes, args.steps, args.repeats, args.pairs = 8, 10, 1, 1
        args.compile_pairs = min(args.compile_pairs, 1)
    if args.baseline is not None:
        if not os.path.isdir(os.path.join(args.baseline, "sarathi_rt")):
            raise SystemExit(f"--baseline must be a directory holding the sarathi_rt package, got {args.baseline!r}")
        compare(args)
        return
    if args.compile_pairs:
        compare_compiled(args)
        return
    r = measure(args.decodes, args.steps, args.repeats, args.threads, args.compile)
    if args.json:
        print(json.dumps(r))
        return
    print(f"tiny, {args.decodes} decodes, {args.threads} thread(s): median {r['wall_ms']:.3f} ms/step wall, "
          f"{r['cpu_ms']:.3f} ms/step CPU (runs: {', '.join(f'{x:.3f}' for x in r['runs_ms'])} ms wall)")
    print_targets(r["wall_ms"], min(r["runs_ms"]))
    if "split_ms" in r:
        print_split("split", r["split_ms"])


if __name__ == "__main__":
    main()

"""Per-step overhead of the engine: ms per step on the `tiny` preset with 64 running
decodes, where the model's compute is a small part of the step and the rest is Python
(scheduling, step input, preparing the context, per-layer op calls, sampling, outputs).

    python bench/bench_step_overhead.py [--decodes 64] [--steps 300] [--repeats 5]

Prints the median wall ms per step over `repeats` runs of `steps` decode steps each,
the process CPU ms per step (steadier on a loaded machine), and the ratio to the 1.5 ms
target. The baseline is the same script at an earlier commit, run back to back
(`git worktree add /tmp/base <commit>`, build it, then alternate the two).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# The native kernels size their OpenMP team when the library loads: give them the same
# thread count as torch (--threads) before anything imports it.
_threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "1"
os.environ.setdefault("OMP_NUM_THREADS", _threads)

import torch  # noqa: E402

from sarathi_rt import LLM, SamplingParams  # noqa: E402

TARGET_MS = 1.5


def run_once(llm: LLM, decodes: int, steps: int) -> tuple[float, float]:
    """Median wall seconds per pure-decode step with `decodes` requests running, and the
    mean process CPU seconds per step (steadier than wall time on a shared machine)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 500 for j in range(16)], params)
    while True:  # prefill every prompt first
        engine.step()
        if all(len(s.output) > 0 for s in engine._seqs.values()):
            break
    times = []
    cpu = time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu) / steps
    for request_id in list(engine._seqs):
        engine.abort(request_id)
    engine.step()
    return statistics.median(times), cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads (1: overhead, not compute)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("tiny", token_budget=max(args.decodes, 64), max_num_seqs=args.decodes, num_kv_blocks=1024)
    run_once(llm, args.decodes, 20)  # warm-up
    runs = [run_once(llm, args.decodes, args.steps) for _ in range(args.repeats)]
    wall = statistics.median(r[0] for r in runs) * 1e3
    cpu = statistics.median(r[1] for r in runs) * 1e3
    print(f"tiny, {args.decodes} decodes, {args.threads} thread(s): median {wall:.3f} ms/step wall, "
          f"{cpu:.3f} ms/step CPU (runs: {', '.join(f'{r[0] * 1e3:.3f}' for r in runs)} ms wall); "
          f"target {TARGET_MS} ms -> {wall / TARGET_MS:.2f}x of target")


if __name__ == "__main__":
    main()

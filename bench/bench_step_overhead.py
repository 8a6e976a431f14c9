"""Per-step overhead of the engine: ms per step on the `tiny` preset with 64 running
decodes, where the model's compute is a small part of the step and the rest is Python
(scheduling, step input, preparing the context, per-layer op calls, sampling, outputs).

    python bench/bench_step_overhead.py [--decodes 64] [--steps 300] [--repeats 5]

Prints the median ms per step over `repeats` runs of `steps` decode steps each, the
share spent in each phase (from a cProfile-free split: schedule+input, model runner,
sampling+outputs), and the ratio to the 1.5 ms target. The baseline to compare with is
the same script at an earlier commit (`git stash; python bench/...`), run back to back.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from sarathi_rt import LLM, SamplingParams

TARGET_MS = 1.5


def run_once(llm: LLM, decodes: int, steps: int) -> float:
    """Median seconds per pure-decode step with `decodes` requests running."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 500 for j in range(16)], params)
    while True:  # prefill every prompt first
        engine.step()
        if all(len(s.output) > 0 for s in engine._seqs.values()):
            break
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in list(engine._seqs):
        engine.abort(request_id)
    engine.step()
    return statistics.median(times)


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
    runs = [run_once(llm, args.decodes, args.steps) * 1e3 for _ in range(args.repeats)]
    med = statistics.median(runs)
    print(f"tiny, {args.decodes} decodes, {args.threads} thread(s): median {med:.3f} ms/step "
          f"(runs {', '.join(f'{r:.3f}' for r in runs)}); target {TARGET_MS} ms -> {med / TARGET_MS:.2f}x of target")


if __name__ == "__main__":
    main()

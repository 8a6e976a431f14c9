"""Where the CPU's static token budget comes from: the time of a prefill step of n tokens
on the real model, per token, for n from 16 to 1024, and the smallest n whose time per
token is within 20% of the best (the rule behind DEFAULT_TOKEN_BUDGET["cpu"]: a step as
short as it can be without giving up prefill throughput).

    python bench/bench_token_budget.py [--model smollm2-135m-instruct] [--threads 2] [--repeats 7]
    python bench/bench_token_budget.py --smoke      # the tiny preset, three sizes

Each size runs `repeats` times, interleaved with the other sizes (the machine's speed
drifts), on fresh prompts (no prefix cache hit); the figure is the median. It prints the
size the rule picks on this host and the default beside it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.scheduler.config import DEFAULT_TOKEN_BUDGET

NEAR_BEST = 1.2  # the rule: within 20% of the best time per token


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="the tiny preset, sizes 16, 64 and 128, 2 repeats")
    args = p.parse_args()
    sizes = [16, 32, 64, 128, 256, 512, 1024]
    if args.smoke:
        args.model, args.repeats, sizes = "tiny", 2, [16, 64, 128]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, token_budget=max(sizes), num_kv_blocks=max(sizes) // 16 + 8, max_num_seqs=4,
              enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([[1] * max(sizes)], params, use_tqdm=False)  # warm up the largest step's buffers
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(args.repeats):
        for n in sizes:
            prompt = [(7 * i + 131 * r + n) % (vocab - 2) + 1 for i in range(n)]
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times[n].append(time.perf_counter() - start)
    per_token = {n: statistics.median(ts) / n for n, ts in times.items()}
    best = min(per_token.values())
    print(f"{args.model} on the CPU, {torch.get_num_threads()} thread(s), {args.repeats} interleaved repeats "
          f"(load {os.getloadavg()[0]:.1f})")
    print("tokens | step ms | us/token | x best")
    for n in sizes:
        print(f"{n:6d} | {statistics.median(times[n]) * 1e3:7.1f} | {per_token[n] * 1e6:8.0f} | "
              f"{per_token[n] / best:6.2f}")
    pick = min(n for n in sizes if per_token[n] <= NEAR_BEST * best)
    print(f"rule (smallest step within {NEAR_BEST:g}x the best time per token) picks {pick}; "
          f"the CPU default is {DEFAULT_TOKEN_BUDGET['cpu']}")


if __name__ == "__main__":
    main()

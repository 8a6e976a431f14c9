"""Speculative decoding with a draft model against plain decoding, interleaved in one run.

Random-weight presets: cpu-small (8 layers) as the target, cpu-small-draft (2 layers,
the same vocabulary) as its draft, and, to show the draft path at full acceptance, the
target drafting for itself (same preset and seed: the same weights). Random prompts at 1
and 4 requests at once; for each concurrency the runs alternate plain, draft, self-draft
(`--repeats` rounds). Reported: medians of output tokens/s and their ratio to plain (each
round's pair), whether the greedy outputs are identical, and the accepted-length
distribution: per verification (a decode verifying d proposals), how many were accepted.
Speed is reported, not targeted: a random draft agrees with a random target by chance.

    python bench/bench_spec_draft.py [--concurrency 1,4] [--repeats 3] [--max-tokens 64] [--k 4]
    python bench/bench_spec_draft.py --smoke   # tiny-deep drafted by tiny, seconds
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
from collections import Counter

from bench_spec import run
from sarathi_rt import LLM
from sarathi_rt.engine import RequestOutput


class AcceptedLengths:
    """The accepted count of every verification, read from each step's outputs: a
    request whose proposal count grew in a step verified proposals in it, and accepted
    what its accepted count grew by."""

    def __init__(self) -> None:
        self.histogram: Counter[int] = Counter()
        self._seen: dict[str, tuple[int, int]] = {}

    def __call__(self, out: RequestOutput) -> None:
        drafted, kept = self._seen.get(out.request_id, (0, 0))
        if out.num_draft_tokens > drafted:
            self.histogram[out.num_accepted_tokens - kept] += 1
        self._seen[out.request_id] = (out.num_draft_tokens, out.num_accepted_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cpu-small")
    ap.add_argument("--draft", default="cpu-small-draft")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved plain/draft/self-draft rounds")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny-deep drafted by tiny, one round, 16 tokens")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.draft, args.repeats, args.max_tokens, args.prompt_tokens = "tiny-deep", "tiny", 1, 16, 24
    levels = [int(c) for c in args.concurrency.split(",")]
    options = {"max_num_seqs": max(levels), "num_kv_blocks": max(levels) * 24, "block_size": 16}
    engines = {"plain": LLM(args.model, **options),
               "draft": LLM(args.model, speculative={"method": "draft", "model": args.draft, "k": args.k}, **options),
               "self": LLM(args.model, speculative={"method": "draft", "model": args.model, "k": args.k}, **options)}
    vocab = engines["plain"].engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens + 8 * i)] for i in range(4)]
    print(f"{args.model} drafted by {args.draft} (and by itself), k={args.k}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}: random prompts of {args.prompt_tokens}..{args.prompt_tokens + 24} tokens, "
          f"{args.max_tokens} output tokens each, greedy; {args.repeats} interleaved rounds per concurrency")
    for llm in engines.values():  # one-off costs out of the first timed run
        run(llm, prompts, 1, 4)
    identical = True
    histograms: dict[str, Counter[int]] = {"draft": Counter(), "self": Counter()}
    kept = {"draft": [0, 0], "self": [0, 0]}  # accepted, drafted
    print(f"{'requests':>8} | {'plain tok/s':>11} | {'draft tok/s':>11} | {'ratio':>6} | {'self tok/s':>10} | "
          f"{'ratio':>6}")
    for c in levels:
        res: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                lengths = AcceptedLengths()
                res[name].append(run(llm, prompts, c, args.max_tokens, lengths) | {"lengths": lengths.histogram})
        for name in histograms:
            identical &= all(a["outputs"] == b["outputs"] for a, b in zip(res["plain"], res[name]))
            for r in res[name]:
                histograms[name] += r["lengths"]
                kept[name][0] += r["accepted"]
                kept[name][1] += r["drafted"]
        med = {name: statistics.median(r["tokens_per_s"] for r in runs) for name, runs in res.items()}
        ratio = {name: statistics.median(b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(res["plain"], res[name]))
                 for name in histograms}
        print(f"{c:>8} | {med['plain']:>11.1f} | {med['draft']:>11.1f} | {ratio['draft']:>5.2f}x | "
              f"{med['self']:>10.1f} | {ratio['self']:>5.2f}x")
    print(f"greedy outputs identical: {identical}")
    for name, label in (("draft", f"{args.draft} draft"), ("self", "self-draft")):
        histogram = histograms[name]
        accepted, drafted = kept[name]
        counts = ", ".join(f"{a}: {histogram[a]}" for a in range(args.k + 1))
        print(f"{label} accepted per verification ({sum(histogram.values())} verifications) {counts}; "
              f"acceptance {accepted / drafted if drafted else 0.0:.0%}")
    print(f"load after {os.getloadavg()[0]:.1f}")
    if not identical:
        raise SystemExit("greedy outputs differ with a draft model")


if __name__ == "__main__":
    main()

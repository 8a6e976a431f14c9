"""Speculative decoding (n-gram proposals) against plain decoding, interleaved in one run.

The real SmolLM2-135M-Instruct on the CPU, an input-grounded workload (bench/data/
spec_prompts.json: 32 prompts, 8 of each kind: summarize, edit or rewrite a given text,
complete or refactor a given Python file, answer questions over a given document; their
token counts are recorded there) at 1, 4, 16 and 64 requests at once. For each
concurrency c the runs alternate plain, speculative, plain, ... (pairs); pair r's requests
take the prompts round-robin from offset r * c, and there are at least `--repeats` pairs and
enough for every prompt to run once at each concurrency, so the 1-request figure is a
median over every prompt, not over a few. Every prompt's prefix is cached in both engines
before timing, so each run times decoding from the same cache state. Reported: medians of
output tokens/s, TTFT and TBT (each request's mean gap between tokens, as a client sees its
rate), the speculative / plain ratio of tokens/s (median of the pairs' ratios), the
acceptance rate, per kind at 1 request as well, and whether the greedy outputs are
identical on every prompt. Targets
(issue 40, on a quiet machine): >= 1.5x at 1 request, >= 0.97x at 64.

    python bench/bench_spec.py [--concurrency 1,4,16,64] [--repeats 3] [--max-tokens 128] [--k 4] [--prompts 32]
    python bench/bench_spec.py --smoke   # the `tiny` preset, synthetic repeating prompts, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import RequestOutput

DATA = Path(__file__).resolve().parent / "data" / "spec_prompts.json"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    kinds: list[str]  # each prompt's kind, the per-kind figures' key
    lengths: list[int]  # each prompt's tokens, known before any tokenizer loads (the KV cache is sized by them)
    texts: list[str] | None = None  # chat messages to tokenize, or None where `ids` are given
    ids: list[list[int]] | None = None

    def tokenized(self, llm: LLM) -> list[list[int]]:
        """The prompts' token ids; a text whose count under `llm`'s chat template differs
        from the one recorded stops the run, since the cache was sized by the record."""
        if self.ids is not None:
            return self.ids
        assert llm.tokenizer is not None and self.texts is not None
        ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in self.texts]
        wrong = [(i, len(p), n) for i, (p, n) in enumerate(zip(ids, self.lengths)) if len(p) != n]
        if wrong:
            raise SystemExit(f"{DATA}: recorded token counts differ from the tokenizer's "
                             f"(prompt, counted, recorded): {wrong[:4]}")
        return ids


def real_workload(count: int | None) -> Workload:
    """The first `count` prompts of the data file, or all (its kinds are interleaved, so a
    prefix keeps them balanced)."""
    prompts = json.loads(DATA.read_text())["prompts"][:count]
    return Workload([p["kind"] for p in prompts], [p["tokens"] for p in prompts], texts=[p["text"] for p in prompts])


def smoke_workload() -> Workload:
    """Token ids that repeat a phrase, so prompt lookup finds matches in a random model."""
    ids = [[(7 * i + j) % 50 + 3 for j in range(9)] * 4 for i in range(4)]
    return Workload(["synthetic"] * len(ids), [len(p) for p in ids], ids=ids)


def run(llm: LLM, prompts: list[list[int]], concurrency: int, max_tokens: int,
        observe: Callable[[RequestOutput], None] | None = None, *, schema: str | None = None) -> dict:
    """`concurrency` requests at once (the prompts cycled), greedy, to max_tokens each
    (with a json `schema`: to the value's end, at most max_tokens); `observe` sees every
    step's every output."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=schema is None, json_schema=schema)
    start = time.perf_counter()
    ids = [f"r{engine.num_steps}-{i}" for i in range(concurrency)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, prompts[i % len(prompts)], params, arrival_time=start)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if observe is not None:
                observe(out)
            if out.finished:
                done[out.request_id] = out
    seconds = time.perf_counter() - start
    outs = [done[i] for i in ids]
    tokens = sum(len(o.token_ids) for o in outs)
    tbts = [(o.metrics.token_times[-1] - o.metrics.token_times[0]) / (len(o.token_ids) - 1) for o in outs
            if len(o.token_ids) > 1]
    return {"tokens_per_s": tokens / seconds, "ttft": statistics.median(o.metrics.ttft for o in outs),
            "tbt": statistics.median(tbts), "outputs": [list(o.token_ids) for o in outs],
            "drafted": sum(o.num_draft_tokens for o in outs), "accepted": sum(o.num_accepted_tokens for o in outs)}


def pair_count(repeats: int, prompts: int, concurrency: int) -> int:
    """`repeats` pairs, or more where one pass over the prompts at this concurrency needs more."""
    return max(repeats, -(-prompts // concurrency))


def rotated(prompts: list[list[int]], offset: int) -> list[list[int]]:
    """The prompts from `offset` on, wrapping: the round-robin order of one pair's requests."""
    offset %= len(prompts)
    return prompts[offset:] + prompts[:offset]


def acceptance(runs: list[dict]) -> float:
    drafted = sum(r["drafted"] for r in runs)
    return sum(r["accepted"] for r in runs) / drafted if drafted else 0.0


def print_kinds(workload: Workload, pairs: list[tuple[dict, dict]]) -> None:
    """Per kind at 1 request, where pair r ran prompt r (mod the prompt count) alone."""
    print(f"at 1 request, per kind: {'kind':>9} | {'pairs':>5} | {'plain tok/s':>11} | {'spec tok/s':>10} | "
          f"{'ratio':>6} | {'accepted':>8}")
    groups = {kind: [pair for r, pair in enumerate(pairs) if workload.kinds[r % len(workload.kinds)] == kind]
              for kind in dict.fromkeys(workload.kinds)}
    for kind, mine in (groups | {"all": pairs}).items():
        print(f"{'':>23} {kind:>9} | {len(mine):>5} | {statistics.median(a['tokens_per_s'] for a, _ in mine):>11.1f} | "
              f"{statistics.median(b['tokens_per_s'] for _, b in mine):>10.1f} | "
              f"{statistics.median(b['tokens_per_s'] / a['tokens_per_s'] for a, b in mine):>5.2f}x | "
              f"{acceptance([b for _, b in mine]):>7.0%}")


def parser(doc: str, concurrency: str, max_tokens: int, smoke: str) -> argparse.ArgumentParser:
    """The flags of the benches that compare speculative with plain decoding."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", default=concurrency)
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved plain/speculative pairs per concurrency, at least; more where one pass over "
                         "the prompts needs more (ceil(prompts / concurrency))")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help=smoke)
    return ap


def compare(plain: LLM, spec: LLM, prompts: list[list[int]], levels: list[int], repeats: int, max_tokens: int,
            schema: str | None = None) -> tuple[dict[int, float], list[tuple[dict, dict]]]:
    """Per concurrency c, pair_count interleaved plain/speculative pairs, pair r on the
    prompts from offset r * c (see run): prints a row of medians per concurrency and whether
    the greedy outputs were identical (exits if not); returns each concurrency's median
    ratio of tokens/s, speculative / plain, and the pairs at 1 request (empty without)."""
    # Every prompt's prefix into both engines' caches first (a document or file already asked
    # about once), so every timed run, at every concurrency, starts from the same cache state and
    # times decoding, what speculation changes, rather than a first prefill on some runs only
    # (~0.3 s for one prompt, beside ~2 s of decoding at 1 request). This is also the warm-up
    # (a schema's compile among its one-off costs).
    for llm in (plain, spec):
        run(llm, prompts, len(prompts), 2, schema=schema)
    identical = True
    ratios = {}
    alone: list[tuple[dict, dict]] = []
    print(f"{'requests':>8} | {'pairs':>5} | {'plain tok/s':>11} | {'spec tok/s':>10} | {'ratio':>6} | "
          f"{'TTFT plain/spec ms':>18} | {'TBT plain/spec ms':>17} | {'accepted':>8}")
    for c in levels:
        pairs = []
        for r in range(pair_count(repeats, len(prompts), c)):
            mine = rotated(prompts, r * c)
            pairs.append((run(plain, mine, c, max_tokens, schema=schema), run(spec, mine, c, max_tokens, schema=schema)))
        identical &= all(a["outputs"] == b["outputs"] for a, b in pairs)
        med = {m: {k: statistics.median(pair[side][k] for pair in pairs) for k in ("tokens_per_s", "ttft", "tbt")}
               for side, m in enumerate(("plain", "spec"))}
        ratios[c] = statistics.median(b["tokens_per_s"] / a["tokens_per_s"] for a, b in pairs)
        print(f"{c:>8} | {len(pairs):>5} | {med['plain']['tokens_per_s']:>11.1f} | "
              f"{med['spec']['tokens_per_s']:>10.1f} | {ratios[c]:>5.2f}x | "
              f"{med['plain']['ttft'] * 1e3:>8.0f} / {med['spec']['ttft'] * 1e3:<7.0f} | "
              f"{med['plain']['tbt'] * 1e3:>7.1f} / {med['spec']['tbt'] * 1e3:<7.1f} | "
              f"{acceptance([b for _, b in pairs]):>7.0%}")
        if c == 1:
            alone = pairs
    print(f"greedy outputs identical: {identical}")
    if not identical:
        raise SystemExit("greedy outputs differ with speculation")
    return ratios, alone


def main() -> None:
    ap = parser(__doc__, "1,4,16,64", 128, "the tiny preset, 1 and 4 requests, one pass, 16 tokens")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts of the data file (default all)")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.concurrency, args.repeats, args.max_tokens = "tiny", "1,4", 1, 16
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.prompts is not None and args.prompts < 1:
        ap.error(f"--prompts must be at least 1, got {args.prompts}")
    workload = smoke_workload() if args.smoke else real_workload(args.prompts)
    # Room for each running request (the longest prompt, its output and one verification's
    # k + 1 rows) and, beside them, for every prompt with its greedy answer (the same in every
    # run), which the prefix cache keeps: an evicted prompt would be prefilled cold again.
    per_request = -(-(max(workload.lengths) + args.max_tokens + args.k + 1) // BLOCK_SIZE)
    cached = sum(-(-(n + args.max_tokens) // BLOCK_SIZE) for n in workload.lengths)
    options = {"max_num_seqs": max(levels), "num_kv_blocks": max(levels) * per_request + cached,
               "block_size": BLOCK_SIZE, "enable_prefix_caching": True}
    plain = LLM(args.model, **options)
    spec = LLM(args.model, speculative={"method": "ngram", "k": args.k, "ngram_min": 1 if args.smoke else 2,
                                         "ngram_max": 4}, **options)
    prompts = workload.tokenized(plain)
    kinds = {k: workload.kinds.count(k) for k in workload.kinds}
    print(f"{args.model}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}: {len(prompts)} prompts "
          f"({', '.join(f'{n} {k}' for k, n in kinds.items())}) of {min(workload.lengths)}..{max(workload.lengths)} "
          f"tokens ({sum(workload.lengths)} in all), {args.max_tokens} output tokens each, greedy; n-gram k={args.k}; "
          f"per concurrency c, max({args.repeats}, ceil({len(prompts)} / c)) interleaved pairs")
    ratios, alone = compare(plain, spec, prompts, levels, args.repeats, args.max_tokens)
    if alone:
        print_kinds(workload, alone)
    low, high = min(levels), max(levels)
    print(f"speculative / plain tokens/s ratio: {ratios[low]:.2f}x at {low} request(s) (target >= 1.5x at 1; median "
          f"of pairs on successive prompts), {ratios[high]:.2f}x at {high} (target >= 0.97x at 64); load after "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

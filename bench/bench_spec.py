"""Speculative decoding (n-gram proposals) against plain decoding, interleaved in one run.

The real SmolLM2-135M-Instruct on the CPU, an input-grounded workload (bench/data/
spec_prompts.json: repeat, edit or summarize a given text, complete given code; tokens
counted below) at 1, 4, 16 and 64 requests at once. For each concurrency the runs
alternate plain, speculative, plain, ... (`--repeats` pairs); reported are medians of
output tokens/s, TTFT and TBT (each request's mean gap between tokens, as a client sees
its rate), the speculative / plain ratio of tokens/s, the acceptance rate, and whether
the greedy outputs are identical. Targets (issue 40, on a quiet machine): >= 1.5x at 1
request, >= 0.97x at 64.

    python bench/bench_spec.py [--concurrency 1,4,16,64] [--repeats 3] [--max-tokens 128] [--k 4]
    python bench/bench_spec.py --smoke   # the `tiny` preset, synthetic repeating prompts, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import RequestOutput

DATA = Path(__file__).resolve().parent / "data" / "spec_prompts.json"


def real_prompts(llm: LLM) -> list[list[int]]:
    assert llm.tokenizer is not None
    prompts = json.loads(DATA.read_text())["prompts"]
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}], add_generation_prompt=True)
            for p in prompts]


def smoke_prompts() -> list[list[int]]:
    """Token ids that repeat a phrase, so prompt lookup finds matches in a random model."""
    return [[(7 * i + j) % 50 + 3 for j in range(9)] * 4 for i in range(4)]


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


def parser(doc: str, concurrency: str, max_tokens: int, smoke: str) -> argparse.ArgumentParser:
    """The flags of the benches that compare speculative with plain decoding."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", default=concurrency)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved plain/speculative pairs per concurrency")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help=smoke)
    return ap


def compare(plain: LLM, spec: LLM, prompts: list[list[int]], levels: list[int], repeats: int, max_tokens: int,
            schema: str | None = None) -> dict[int, float]:
    """Per concurrency, `repeats` interleaved plain/speculative pairs (see run): prints a
    row of medians per concurrency and whether the greedy outputs were identical (exits
    if not); returns each concurrency's median ratio of tokens/s, speculative / plain."""
    for llm in (plain, spec):  # one-off costs (a schema's compile among them) out of the first timed run
        run(llm, prompts, 1, 4, schema=schema)
    identical = True
    ratios = {}
    print(f"{'requests':>8} | {'plain tok/s':>11} | {'spec tok/s':>10} | {'ratio':>6} | {'TTFT plain/spec ms':>18} | "
          f"{'TBT plain/spec ms':>17} | {'accepted':>8}")
    for c in levels:
        res: dict[str, list[dict]] = {"plain": [], "spec": []}
        for _ in range(repeats):
            res["plain"].append(run(plain, prompts, c, max_tokens, schema=schema))
            res["spec"].append(run(spec, prompts, c, max_tokens, schema=schema))
        identical &= all(a["outputs"] == b["outputs"] for a, b in zip(res["plain"], res["spec"]))
        med = {m: {k: statistics.median(r[k] for r in runs) for k in ("tokens_per_s", "ttft", "tbt")}
               for m, runs in res.items()}
        ratios[c] = statistics.median(b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(res["plain"], res["spec"]))
        drafted = sum(r["drafted"] for r in res["spec"])
        rate = sum(r["accepted"] for r in res["spec"]) / drafted if drafted else 0.0
        print(f"{c:>8} | {med['plain']['tokens_per_s']:>11.1f} | {med['spec']['tokens_per_s']:>10.1f} | "
              f"{ratios[c]:>5.2f}x | {med['plain']['ttft'] * 1e3:>8.0f} / {med['spec']['ttft'] * 1e3:<7.0f} | "
              f"{med['plain']['tbt'] * 1e3:>7.1f} / {med['spec']['tbt'] * 1e3:<7.1f} | {rate:>7.0%}")
    print(f"greedy outputs identical: {identical}")
    if not identical:
        raise SystemExit("greedy outputs differ with speculation")
    return ratios


def main() -> None:
    args = parser(__doc__, "1,4,16,64", 128, "the tiny preset, 1 and 4 requests, one pair, 16 tokens").parse_args()
    if args.smoke:
        args.model, args.concurrency, args.repeats, args.max_tokens = "tiny", "1,4", 1, 16
    levels = [int(c) for c in args.concurrency.split(",")]
    options = {"max_num_seqs": max(levels), "num_kv_blocks": max(levels) * 40, "block_size": 16}
    plain = LLM(args.model, **options)
    spec = LLM(args.model, speculative={"method": "ngram", "k": args.k, "ngram_min": 1 if args.smoke else 2,
                                         "ngram_max": 4}, **options)
    prompts = smoke_prompts() if args.smoke else real_prompts(plain)
    lengths = [len(p) for p in prompts]
    print(f"{args.model}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}: {len(prompts)} prompts of "
          f"{min(lengths)}..{max(lengths)} tokens ({sum(lengths)} in all), {args.max_tokens} output tokens each, "
          f"greedy; n-gram k={args.k}; {args.repeats} interleaved pairs per concurrency")
    ratios = compare(plain, spec, prompts, levels, args.repeats, args.max_tokens)
    low, high = min(levels), max(levels)
    print(f"speculative / plain tokens/s ratio: {ratios[low]:.2f}x at {low} request(s) (target >= 1.5x at 1), "
          f"{ratios[high]:.2f}x at {high} (target >= 0.97x at 64); load after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

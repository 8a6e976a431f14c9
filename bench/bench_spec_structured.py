"""Speculative decoding (n-gram proposals) of structured-output requests (a JSON schema)
against plain decoding of the same requests, interleaved in one run.

The real SmolLM2-135M-Instruct on the CPU; each prompt gives a JSON record and asks for
it back (copy, extract, reformat: the workloads where prompt lookup proposes well), and
the schema is the record's. The grammar cuts each proposal at the first token it refuses
and masks each verification row as of its own position, so the outputs stay plain
decoding's, token for token. Every prompt's prefix is cached in both engines first; per
concurrency c, at least `--repeats` pairs (one pass over the prompts at least) alternate
plain, speculative, ..., pair r on the prompts from offset r * c; reported are medians of output tokens/s, TTFT and TBT, the speculative
/ plain tokens/s ratio (median of the pairs' ratios), the acceptance rate, and whether
the greedy outputs are identical.

    python bench/bench_spec_structured.py [--concurrency 1,4] [--repeats 3] [--max-tokens 160] [--k 4]
    python bench/bench_spec_structured.py --smoke   # `tiny` with its test tokenizer, seconds
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from bench_spec import compare, parser
from sarathi_rt import LLM

RECORD = {"name": "math_utils", "language": "python", "version": "1.4.2",
          "functions": [{"name": "fibonacci", "args": ["n"], "pure": True},
                        {"name": "factorial", "args": ["n"], "pure": True},
                        {"name": "gcd", "args": ["a", "b"], "pure": True},
                        {"name": "read_table", "args": ["path", "sep"], "pure": False}]}
SCHEMA = {"type": "object", "required": ["name", "language", "version", "functions"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "language": {"type": "string", "maxLength": 20},
                         "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
                         "functions": {"type": "array", "maxItems": 6, "items": {
                             "type": "object", "required": ["name", "args", "pure"],
                             "properties": {"name": {"type": "string", "maxLength": 30},
                                            "args": {"type": "array", "maxItems": 4,
                                                     "items": {"type": "string", "maxLength": 20}},
                                            "pure": {"type": "boolean"}}}}}}
ASKS = ["Repeat this JSON exactly:", "Return this record as JSON, unchanged:", "Extract the module description "
        "below as JSON with the same fields:", "Reformat this JSON compactly:"]


def _models(args: argparse.Namespace, options: dict) -> tuple[LLM, LLM, list[list[int]]]:
    """The plain and the speculative engine, and the prompts' token ids."""
    spec = {"method": "ngram", "k": args.k, "ngram_min": 1 if args.smoke else 2, "ngram_max": 4}
    if args.smoke:  # a random model: prompts of JSON text, so that prompt lookup finds the grammar's tokens
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from text_models import tiny_tokenizer  # the test tokenizer that covers tiny's vocabulary

        tokenizer = tiny_tokenizer()
        plain, fast = (LLM("tiny", tokenizer=tokenizer, speculative=s, **options) for s in (None, spec))
        return plain, fast, [tokenizer.encode(json.dumps(RECORD) + " " * i) for i in range(len(ASKS))]
    plain, fast = (LLM(args.model, speculative=s, **options) for s in (None, spec))
    assert plain.tokenizer is not None
    prompts = [plain.tokenizer.apply_chat_template([{"role": "user", "content": f"{a}\n\n{json.dumps(RECORD)}"}],
                                                   add_generation_prompt=True) for a in ASKS]
    return plain, fast, prompts


def main() -> None:
    args = parser(__doc__, "1,4", 160, "tiny model, 1 and 4 requests, one pair, 48 tokens").parse_args()
    if args.smoke:
        args.model, args.concurrency, args.repeats, args.max_tokens = "tiny", "1,4", 1, 48
    if importlib.util.find_spec("xgrammar") is None:
        print("skipped, xgrammar is not installed (pip install 'sarathi_rt[structured]')")
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    options = {"max_num_seqs": max(levels), "num_kv_blocks": max(levels) * 40, "block_size": 16}
    plain, spec, prompts = _models(args, options)
    lengths = [len(p) for p in prompts]
    print(f"{args.model}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}: {len(prompts)} prompts of "
          f"{min(lengths)}..{max(lengths)} tokens, a JSON schema, at most {args.max_tokens} output tokens each, "
          f"greedy; n-gram k={args.k}; per concurrency c, max({args.repeats}, ceil({len(prompts)} / c)) interleaved pairs")
    ratios, _ = compare(plain, spec, prompts, levels, args.repeats, args.max_tokens, json.dumps(SCHEMA))
    low = min(levels)
    print(f"structured speculative / plain tokens/s ratio: {ratios[low]:.2f}x at {low} request(s), "
          + ", ".join(f"{ratios[c]:.2f}x at {c}" for c in levels if c != low)
          + f"; load after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""What structured output costs per step: decode steps of B requests with a JSON schema
against B free ones, on the real model (SmolLM2-135M-Instruct on the CPU) by default.

Every request decodes max_tokens tokens (the free ones ignore EOS; the schema asks for
an array of at least 64 integers, so no structured request completes early), so both
runs have the same shapes and the difference is the grammar: on the driver, each row's
matcher writes its bitmask and accepts its token; in the sampler, the masked rows are
unpacked and filled. Prints per batch size the median decode-step time free and
structured, their ratio, and the grammar's own share measured apart (matcher fill +
accept for B rows, and the sampler's masking of B rows of the model's vocabulary), plus
the one-off cost of the first structured request (vocabulary setup + compile).

    python bench/bench_structured.py [--model smollm2-135m-instruct] [--batch 1 8 32] [--max-tokens 48]
    python bench/bench_structured.py --smoke   # `tiny` with its test tokenizer, 8 tokens
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine.sampler import Sampler
from sarathi_rt.engine.step_io import RowSampling
from sarathi_rt.engine.structured import GrammarCompiler

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 64}
PROMPT = "Write a JSON array of many small numbers."


def _llm(args: argparse.Namespace) -> LLM:
    kw = dict(num_kv_blocks=args.kv_blocks, block_size=16, token_budget=512, max_num_seqs=max(args.batch))
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from text_models import tiny_tokenizer  # the test tokenizer that covers tiny's vocabulary

        return LLM("tiny", tokenizer=tiny_tokenizer(), **kw)
    return LLM(args.model, **kw)


def decode_step_ms(llm: LLM, batch: int, params: SamplingParams) -> float:
    """Median time of the steps where all `batch` requests decode (no prefill in them)."""
    before = llm.engine.num_steps
    llm.generate([PROMPT] * batch, [params] * batch, use_tqdm=False)
    steps = [s for s in llm.engine.steps_since(before) if s.num_prefill_tokens == 0 and s.batch_size == batch]
    return statistics.median(s.duration for s in steps) * 1e3


def grammar_ms(llm: LLM, batch: int, steps: int) -> tuple[float, float]:
    """Per step, for `batch` rows: the matchers' fill + accept on the driver, and the
    sampler's masking (the same sampler call with and without the masks)."""
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size,
                               tuple(llm.engine.model_config.eos_token_ids))
    schema = SamplingParams(json_schema=SCHEMA).json_schema
    grammars = [compiler.grammar(schema, frozenset(llm.engine.model_config.eos_token_ids)) for _ in range(batch)]
    tokens = llm.tokenizer.encode("[" + "1, " * steps, add_special_tokens=False)[:steps]
    start = time.perf_counter()
    masks = []
    for token in tokens:
        masks = [g.allowed() for g in grammars]
        for g in grammars:
            g.accept(token)
    driver = (time.perf_counter() - start) / len(tokens)
    vocab = llm.engine.model_config.vocab_size
    logits = torch.randn(batch, vocab)
    free = [RowSampling(0.0, None, 1.0, 0, 0) for _ in range(batch)]
    masked = [RowSampling(0.0, None, 1.0, 0, 0, None, m) for m in masks]
    sampler, times = Sampler(), {}
    for name, rows in (("free", free), ("masked", masked)):
        sampler(logits, rows)
        start = time.perf_counter()
        for _ in range(steps):
            sampler(logits, rows)
        times[name] = (time.perf_counter() - start) / steps
    return driver * 1e3, (times["masked"] - times["free"]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--kv-blocks", type=int, default=1024)
    p.add_argument("--smoke", action="store_true", help="tiny model, batches 1 and 4, 8 tokens")
    args = p.parse_args()
    if args.smoke:
        args.model, args.batch, args.max_tokens, args.kv_blocks = "tiny", [1, 4], 8, 128
    if importlib.util.find_spec("xgrammar") is None:
        print("skipped, xgrammar is not installed (pip install 'sarathi_rt[structured]')")
        return
    llm = _llm(args)
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    structured = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, json_schema=SCHEMA)
    start = time.perf_counter()
    llm.generate([PROMPT], SamplingParams(max_tokens=1, json_schema=SCHEMA), use_tqdm=False)
    first = time.perf_counter() - start
    decode_step_ms(llm, max(args.batch), free)  # warm-up at the largest shape
    print(f"{args.model} on the CPU, greedy, {args.max_tokens} tokens per request; first structured request "
          f"(vocabulary + compile + 1 token): {first * 1e3:.0f} ms")
    print(f"{'batch':>5} {'free ms/step':>13} {'schema ms/step':>15} {'ratio':>6} {'matchers ms':>12} "
          f"{'sampler mask ms':>16}")
    for batch in args.batch:
        t_free, t_schema = decode_step_ms(llm, batch, free), decode_step_ms(llm, batch, structured)
        driver, sampler = grammar_ms(llm, batch, args.max_tokens)
        print(f"{batch:>5} {t_free:>13.2f} {t_schema:>15.2f} {t_schema / t_free:>5.2f}x {driver:>12.3f} "
              f"{sampler:>16.3f}")
    llm.shutdown()


if __name__ == "__main__":
    main()

"""`sarathi-rt generate`: complete prompts with a model and print what was generated,
streaming tokens as they come. A text prompt is the user's message in the model's chat
template when the model has one (the default model is an instruct model: fed raw text it
often answers with an end of turn at once); `--raw` sends the text as it is."""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from sarathi_rt.config.flags import add_config_flags, given_options
from sarathi_rt.config.tree import DEFAULT_MODEL
from sarathi_rt.sampling import SamplingParams

if TYPE_CHECKING:
    from sarathi_rt.llm import LLM, Prompt


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate tokens for one or more prompts")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-ids", type=int, nargs="+", metavar="ID", help="one prompt as token ids")
    src.add_argument("--prompt", action="append", help="a text prompt (needs the model's tokenizer); repeat for "
                                                       "several")
    p.add_argument("--raw", action="store_true", help="send --prompt text as it is, not as a user message in the "
                                                      "model's chat template")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--ignore-eos", action="store_true")
    add_config_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sarathi_rt.llm import LLM  # torch: only for the commands that run a model

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, ignore_eos=args.ignore_eos)
        llm = LLM(**{"model": DEFAULT_MODEL} | given_options(args))
        prompts = _prompts(args, llm)
        start = time.perf_counter()
        if len(prompts) == 1:  # stream the tokens as they come
            outs = []
            for out in llm.stream(prompts, params):
                piece = out.new_text if out.new_text is not None else "".join(f"{t} " for t in out.new_token_ids)
                print(piece, end="", flush=True)
                outs.append(out)
            print()
            outs = outs[-1:]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    for i, out in enumerate(outs):
        text = f"\n    text: {out.text!r}" if out.text is not None else ""
        print(f"[{i}] {len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
              f"ttft={out.metrics.ttft * 1e3:.1f} ms\n    ids: {' '.join(map(str, out.token_ids))}{text}")
    steps = llm.engine.step_metrics  # the latest METRICS_WINDOW steps
    print(f"{len(steps)} steps, {sum(s.num_tokens for s in steps)} tokens through the model in {elapsed:.2f} s")
    return 0



def _prompts(args: argparse.Namespace, llm: LLM) -> list[Prompt]:
    """The prompts to run: token ids as given, text wrapped in the chat template unless
    --raw or the model has none."""
    if not args.prompt:
        return [args.prompt_ids or [1]]
    tokenizer = llm.tokenizer
    if args.raw or tokenizer is None or tokenizer.chat_template is None:
        return args.prompt
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in args.prompt]

"""`sarathi-rt generate`: complete prompts with a model directory or a preset and print
what was generated, streaming tokens as they come."""
from __future__ import annotations

import argparse
import sys
import time

from sarathi_rt.sampling import SamplingParams
from sarathi_rt.utils.cpu import DTYPE_HELP


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate tokens for one or more prompts")
    p.add_argument("--model", default="tiny", help="Hugging Face model directory or preset (tiny, cpu-small, "
                                                   "llama3-8b); default tiny")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-ids", type=int, nargs="+", metavar="ID", help="one prompt as token ids")
    src.add_argument("--prompt", action="append", help="a text prompt (needs a tokenizer in the model "
                                                       "directory); repeat for several")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed of each request")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
    p.add_argument("--policy", default="sarathi")
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from free memory")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--worker-timeout", type=float, default=300.0, help="seconds a worker may keep a step")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sarathi_rt.llm import LLM  # torch: only for the commands that run a model

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
        prompts = args.prompt if args.prompt else [args.prompt_ids or [1]]
        # KV blocks sized from free memory are capped at what these prompts can use.
        llm = LLM(args.model, device=args.device, dtype=args.dtype, policy=args.policy,
                  token_budget=args.token_budget, chunk_size=args.chunk_size, num_kv_blocks=args.num_kv_blocks,
                  max_model_len=args.max_model_len, max_num_seqs=min(len(prompts), args.token_budget),
                  tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size, worker_timeout=args.worker_timeout)
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


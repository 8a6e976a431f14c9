"""`sarathi-rt serve`: an OpenAI-compatible HTTP server (POST /v1/completions,
/v1/chat/completions; GET /v1/models, /health, /metrics) on one engine. Needs the
optional extra: pip install 'sarathi_rt[serve]'."""
from __future__ import annotations

import argparse
import signal
import sys

from sarathi_rt.sim.budget import ENGINE_ADAPTIVE_CAP

DEFAULT_MODEL = "smollm2-135m-instruct"
STATIC_BUDGET = 256


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name, GGUF file, Hugging Face directory or "
                                                          f"preset (default {DEFAULT_MODEL})")
    p.add_argument("--tokenizer", default=None, help="GGUF file or directory with tokenizer.json (default: the "
                                                     "model's own)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients name (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting", type=int, default=256,
                   help="answer 503 while this many requests wait for their first step")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="answer 413 to a larger request body (default 4 MiB)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="answer 400 to a longer prompt (default: max_model_len - 1)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds running requests get to finish before their streams are "
                        "ended with an error event (default 30)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share the KV blocks of common prompt prefixes")
    p.add_argument("--docs", action="store_true", help="serve the OpenAPI schema at /docs and /openapi.json")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--policy", default="sarathi")
    p.add_argument("--token-budget", type=int, default=None,
                   help=f"tokens per step (default {STATIC_BUDGET}); with --tbt-slo, the cap of each step "
                        f"(default {ENGINE_ADAPTIVE_CAP})")
    p.add_argument("--tbt-slo", type=float, default=None,
                   help="time-between-tokens target (s): size each step to it (the adaptive budget, "
                        "learned online from the engine's own steps)")
    p.add_argument("--ttft-slo", type=float, default=None,
                   help="time-to-first-token target (s) of the goodput /metrics reports (its TBT target: --tbt-slo)")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from free memory")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="worker processes per pipeline stage (across machines: python -m sarathi_rt.launch)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--worker-timeout", type=float, default=300.0, help="seconds a worker may keep a step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        from sarathi_rt.server import DrainingServer, Limits, OpenAIServer
    except ImportError as exc:
        print(f"error: sarathi-rt serve needs FastAPI and uvicorn ({exc}); pip install 'sarathi_rt[serve]'",
              file=sys.stderr)
        return 2
    import torch

    from sarathi_rt.llm import LLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    llm = None
    try:
        limits = Limits(max_request_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, policy=args.policy,
                  token_budget=args.token_budget or (ENGINE_ADAPTIVE_CAP if args.tbt_slo else STATIC_BUDGET),
                  tbt_slo=args.tbt_slo, chunk_size=args.chunk_size, max_num_seqs=args.max_num_seqs,
                  num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len, seed=args.seed,
                  tokenizer=args.tokenizer, tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size, worker_timeout=args.worker_timeout,
                  enable_prefix_caching=args.prefix_caching)
        server = OpenAIServer(llm, args.served_model_name or str(args.model), max_waiting=args.max_waiting,
                              limits=limits, docs=args.docs, ttft_slo=args.ttft_slo)
        http = DrainingServer(server, args.host, args.port, args.shutdown_timeout, args.log_level)
    except (ValueError, TypeError) as exc:
        if llm is not None:
            llm.shutdown()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"sarathi-rt serve: {server.model_name} on http://{args.host}:{args.port}/v1", flush=True)
    # uvicorn stops on SIGINT/SIGTERM (draining, see DrainingServer), then raises the
    # signal again: _stop turns that into a normal end, so the engine's workers (on other
    # machines too) are shut down and the command exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
    try:
        with llm:
            http.run()
    except _Stopped:
        pass
    return 0


class _Stopped(Exception):
    """A stop signal arrived."""


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)

"""`sarathi-rt serve`: an OpenAI-compatible HTTP server (POST /v1/completions,
/v1/chat/completions; GET /v1/models, /health, /metrics) on one engine. Needs the
optional extra: pip install 'sarathi_rt[serve]'."""
from __future__ import annotations

import argparse
import signal
import sys

from sarathi_rt.scheduler import QoSClass, get_policy
from sarathi_rt.scheduler.qos import QOS_POLICIES
from sarathi_rt.sim.budget import ENGINE_ADAPTIVE_CAP
from sarathi_rt.utils.cpu import DTYPE_HELP

from ._serving import BUDGET_RULES, check_budget_flags, load_qos_classes

DEFAULT_MODEL = "smollm2-135m-instruct"
STATIC_BUDGET = 256
# The service tiers (OpenAI's names, chosen by a request's service_tier) without
# --qos-classes; seconds: "priority" for interactive use that must feel instant,
# "default" for a chat user, "flex" for work that can wait minutes.
DEFAULT_SERVICE_TIERS = {"priority": QoSClass(ttft=1.0, tbt=0.1, priority=2),
                         "default": QoSClass(ttft=5.0, tbt=0.25, priority=1),
                         "flex": QoSClass(ttft=120.0, tbt=1.0, priority=0)}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=DEFAULT_MODEL, help=f"model name, GGUF file, Hugging Face directory or "
                                                          f"preset (default {DEFAULT_MODEL})")
    m.add_argument("--tokenizer", default=None, help="GGUF file or directory with tokenizer.json (default: the "
                                                     "model's own)")
    m.add_argument("--served-model-name", default=None, help="the `model` clients name (default: --model)")
    m.add_argument("--device", default="cpu")
    m.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help=DTYPE_HELP)
    m.add_argument("--max-model-len", type=int, default=None)
    m.add_argument("--seed", type=int, default=0, help="seeds the weights of presets and the sampling seeds of "
                                                       "requests that give none")
    m.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    s = p.add_argument_group("scheduler and KV cache")
    s.add_argument("--policy", default="sarathi")
    s.add_argument("--token-budget", type=int, default=None,
                   help=f"tokens per step (default {STATIC_BUDGET}); with --tbt-slo, the cap of each step "
                        f"(default {ENGINE_ADAPTIVE_CAP})")
    s.add_argument("--chunk-size", type=int, default=None, help="largest prefill chunk (default: the budget)")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    s.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from free memory")
    s.add_argument("--tile-size", default=None,
                   help="GEMM tile rows to align steps to: an int, or 'auto' (this device's GEMM tile); "
                        "default: no alignment")
    s.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV blocks of common prompt prefixes (default on)")
    b = p.add_argument_group("SLO and budget rule")
    b.add_argument("--tbt-slo", type=float, default=None,
                   help="time-between-tokens target (s): sizes the steps (see --budget-rule) and is the TBT "
                        "target of the goodput /metrics reports")
    b.add_argument("--budget-rule", choices=BUDGET_RULES, default=None,
                   help="with --tbt-slo and no --token-budget: adaptive (the default: each step sized to the "
                        "SLO by a step-time model learned online) or slo-static (one budget: the largest "
                        "tile-aligned step within the SLO, measured on this engine at start-up)")
    b.add_argument("--budget-tile", type=int, default=None,
                   help="tile the slo-static budget is a multiple of (default 128)")
    b.add_argument("--ttft-slo", type=float, default=None,
                   help="time-to-first-token target (s) of the goodput /metrics reports")
    b.add_argument("--qos-classes", metavar="FILE.json", default=None,
                   help='the service tiers a request\'s service_tier selects, e.g. {"chat": {"ttft": 2.0, "tbt": 0.1, '
                        '"priority": 1}, "default": {"ttft": 30, "tbt": 0.5}} (seconds; auto or no service_tier: '
                        '"default" if there is one, else the first). Default: ' + ", ".join(
                            f"{n} (ttft {c.ttft:g} s, tbt {c.tbt:g} s)" for n, c in DEFAULT_SERVICE_TIERS.items()))
    b.add_argument("--qos-policy", choices=QOS_POLICIES, default="deadline",
                   help="deadline: schedule by the tiers' deadlines (policy sarathi); fcfs: only measure them")
    d = p.add_argument_group("parallelism")
    d.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="worker processes per pipeline stage (across machines: python -m sarathi_rt.launch)")
    d.add_argument("--pipeline-parallel-size", type=int, default=1)
    d.add_argument("--worker-timeout", type=float, default=300.0, help="seconds a worker may keep a step")
    h = p.add_argument_group("HTTP and limits")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--max-waiting", type=int, default=256,
                   help="answer 503 while this many requests wait for their first step")
    h.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="answer 413 to a larger request body (default 4 MiB)")
    h.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="answer 400 to a longer prompt (default: max_model_len - 1)")
    h.add_argument("--max-schema-complexity", type=int, default=None,
                   help="answer 400 to a response_format json_schema more complex than this (about one per JSON "
                        "value, more for long enums and many optional properties; default 20000, compiles of "
                        "about 2 s)")
    h.add_argument("--compile-timeout", type=float, default=10.0,
                   help="answer 400 to a json_schema whose grammar takes longer to compile (default 10 s)")
    h.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds running requests get to finish before their streams are "
                        "ended with an error event (default 30)")
    h.add_argument("--docs", action="store_true", help="serve the OpenAPI schema at /docs and /openapi.json")
    h.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def _budget(args: argparse.Namespace) -> tuple[int, float | None]:
    """(token_budget, the engine's tbt_slo) by the budget rule: a given budget (adaptive
    under it with --tbt-slo), the adaptive rule's cap, or the slo-static budget."""
    check_budget_flags(args.budget_rule, args.budget_tile, args.tbt_slo is not None and args.token_budget is None)
    if args.token_budget is not None:
        return args.token_budget, args.tbt_slo
    if args.tbt_slo is None:
        return STATIC_BUDGET, None
    if args.budget_rule != "slo-static":
        return ENGINE_ADAPTIVE_CAP, args.tbt_slo
    return _slo_static_budget(args), None


def _slo_static_budget(args: argparse.Namespace) -> int:
    """The largest tile-aligned step within --tbt-slo, timed on an engine of the same
    model (32 decodes over 1024-token contexts, less if the cache is smaller); that
    engine is closed before the serving one loads, so the weights load twice."""
    from sarathi_rt.llm import LLM
    from sarathi_rt.harness.step_timing import engine_slo_budget

    tile = args.budget_tile or 128
    with LLM(args.model, **_engine_options(args), token_budget=tile * 8, tbt_slo=None) as probe:
        _, choice = engine_slo_budget(probe.engine, args.tbt_slo, tile_size=tile, num_decodes=min(32, args.max_num_seqs))
    print(f"sarathi-rt serve: token budget from the {args.tbt_slo * 1e3:g} ms SLO: {choice.token_budget} "
          f"(T = {choice.step_time * 1e3:.1f} ms)", flush=True)
    return choice.token_budget


def _engine_options(args: argparse.Namespace) -> dict[str, object]:
    tile = args.tile_size
    if tile is not None and tile != "auto":
        try:
            tile = int(tile)
        except ValueError:
            raise ValueError(f"--tile-size must be an int or 'auto', got {tile!r}") from None
    return dict(device=args.device, dtype=args.dtype, policy=args.policy, chunk_size=args.chunk_size,
                max_num_seqs=args.max_num_seqs, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                max_model_len=args.max_model_len, seed=args.seed, tokenizer=args.tokenizer,
                tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                worker_timeout=args.worker_timeout, enable_prefix_caching=args.prefix_caching,
                tile_size=tile)


def run(args: argparse.Namespace) -> int:
    try:
        from sarathi_rt.server import DrainingServer, Limits, OpenAIServer
    except ImportError as exc:
        print(f"error: sarathi-rt serve needs FastAPI, uvicorn and prometheus_client ({exc}); "
              "pip install 'sarathi_rt[serve]'", file=sys.stderr)
        return 2
    import torch

    from sarathi_rt.llm import LLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    llm = None
    try:
        # No default of its own here: Limits' (importing it needs torch, which --help should not).
        complexity = {} if args.max_schema_complexity is None else {"max_schema_complexity": args.max_schema_complexity}
        limits = Limits(max_request_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        compile_timeout=args.compile_timeout, **complexity)
        token_budget, engine_slo = _budget(args)
        classes = DEFAULT_SERVICE_TIERS if args.qos_classes is None else load_qos_classes(args.qos_classes)
        llm = LLM(args.model, **_engine_options(args), token_budget=token_budget, tbt_slo=engine_slo,
                  qos_classes=classes, default_qos="default" if "default" in classes else next(iter(classes)),
                  qos_policy=args.qos_policy if get_policy(args.policy).adaptive else "fcfs")
        server = OpenAIServer(llm, args.served_model_name or str(args.model), max_waiting=args.max_waiting,
                              limits=limits, docs=args.docs, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo)
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
    if http.engine_failed:
        print(f"error: the engine failed: {llm.engine.failure}", file=sys.stderr)
        return 1
    return 0


class _Stopped(Exception):
    """A stop signal arrived."""


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)

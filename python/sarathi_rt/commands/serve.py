"""`sarathi-rt serve`: an OpenAI-compatible HTTP server (POST /v1/completions,
/v1/chat/completions; GET /v1/models, /health, /metrics) on one engine. Needs the
optional extra: pip install 'sarathi_rt[serve]'."""
from __future__ import annotations

import argparse
import signal
import sys

from sarathi_rt.config.budget import DEFAULT_BUDGET_TILE, add_budget_flags, check_budget_flags, resolve_budget
from sarathi_rt.config.flags import add_config_flags, given_options
from sarathi_rt.config.tree import DEFAULT_MODEL
from sarathi_rt.scheduler import QoSClass

from ._serving import probe_slo_budget

# The service tiers (OpenAI's names, chosen by a request's service_tier) without
# --qos-classes; seconds: "priority" for interactive use that must feel instant,
# "default" for a chat user, "flex" for work that can wait minutes. They are fixed
# targets, not measured ones: on a machine whose steps take longer than a tier's TBT,
# running decodes that miss it never block admission (the sarathi policy's rule), so
# new requests are admitted as FCFS would admit them.
DEFAULT_SERVICE_TIERS = {"priority": QoSClass(ttft=1.0, tbt=0.1, priority=2),
                         "default": QoSClass(ttft=5.0, tbt=0.25, priority=1),
                         "flex": QoSClass(ttft=120.0, tbt=1.0, priority=0)}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p)
    add_budget_flags(p)
    t = p.add_argument_group("API")
    t.add_argument("--tokenizer", default=None, help="GGUF file or directory with tokenizer.json (default: the "
                                                     "model's own)")
    t.add_argument("--served-model-name", default=None, help="the `model` clients name (default: --model)")
    t.add_argument("--ttft-slo", type=float, default=None,
                   help="time-to-first-token target (s) of the goodput /metrics reports (--tbt-slo is its TBT "
                        "target)")
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


def engine_options(args: argparse.Namespace) -> tuple[dict[str, object], float | None]:
    """The engine's config fields from the flags: the token budget by the budget rule
    (slo-static measured on a probe engine of the same model, closed before the serving
    one loads, so the weights load twice), and the service tiers unless --qos-classes
    names others. Returns the options and the TBT target of goodput (--tbt-slo)."""
    options = given_options(args)
    goodput_tbt = options.get("tbt_slo")
    options.setdefault("model", DEFAULT_MODEL)
    rule = check_budget_flags(args, options.get("token_budget"), options.get("tbt_slo"))
    policy = options.get("policy", "sarathi")

    def slo_static() -> int:
        return probe_slo_budget(options, options["tbt_slo"], args.budget_tile or DEFAULT_BUDGET_TILE)

    budget = resolve_budget(rule, options.get("token_budget"), options.get("tbt_slo"), policy,
                            gpu=str(options.get("device", "cpu")).startswith("cuda"), slo_static=slo_static,
                            explicit_rule=args.budget_rule is not None)
    options |= {"token_budget": budget.token_budget, "tbt_slo": budget.tbt_slo}
    if "qos_classes" not in options:
        options |= {"qos_classes": DEFAULT_SERVICE_TIERS, "default_qos": options.get("default_qos", "default")}
    elif "default_qos" not in options:
        options["default_qos"] = "default" if "default" in options["qos_classes"] else next(iter(options["qos_classes"]))
    return options, goodput_tbt


def run(args: argparse.Namespace) -> int:
    try:
        from sarathi_rt.server import DrainingServer, Limits, OpenAIServer
    except ImportError as exc:
        print(f"error: sarathi-rt serve needs FastAPI, uvicorn and prometheus_client ({exc}); "
              "pip install 'sarathi_rt[serve]'", file=sys.stderr)
        return 2
    from sarathi_rt.llm import LLM

    llm = None
    try:
        # No default of its own here: Limits' (importing it needs torch, which --help should not).
        complexity = {} if args.max_schema_complexity is None else {"max_schema_complexity": args.max_schema_complexity}
        limits = Limits(max_request_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        compile_timeout=args.compile_timeout, **complexity)
        options, goodput_tbt = engine_options(args)
        llm = LLM(tokenizer=args.tokenizer, **options)
        server = OpenAIServer(llm, args.served_model_name or str(options["model"]), max_waiting=args.max_waiting,
                              limits=limits, docs=args.docs, ttft_slo=args.ttft_slo, tbt_slo=goodput_tbt)
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

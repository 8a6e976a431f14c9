"""What `sarathi-rt bench` and `sarathi-rt capacity` share: workload, scheduler and
simulator flags, and one serving run of a policy (real engine or simulator)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterable, Sequence

from sarathi_rt.measure.metrics import RequestMetrics, StepMetrics
from sarathi_rt.harness.step_timing import engine_slo_budget
from sarathi_rt.scheduler import QoSClass, SchedulerConfig, available_policies, get_policy
from sarathi_rt.scheduler.qos import QOS_POLICIES, qos_classes_from
from sarathi_rt.sim import HARDWARE, VidurCostModel, simulate
from sarathi_rt.sim.budget import ENGINE_ADAPTIVE_CAP, SIMULATOR_ADAPTIVE_CAP, choose_token_budget, loaded_curve
from sarathi_rt.sim.shape_model import ShapeCostModel
from sarathi_rt.utils.cpu import DTYPE_HELP
from sarathi_rt.workloads import (ARRIVALS, BUILTIN_TRACES, RequestSpec, WorkloadConfig, check_qos_mix, data_path,
                                  make_workload)

DEFAULT_PROFILE = "a100_llama-2-7b_mlp.csv.gz"
REAL_MODEL = "smollm2-135m-instruct"


def optional_plots() -> ModuleType | None:
    """sarathi_rt.measure.plots when matplotlib is installed (the `plot` extra); otherwise None,
    after saying how to get the plots. The numbers never depend on it."""
    if importlib.util.find_spec("matplotlib") is None:
        print("plots skipped: matplotlib is not installed (pip install 'sarathi_rt[plot]' to get them)")
        return None
    from sarathi_rt.measure import plots

    return plots


# Flags by the backend that reads them, with the default each gets when that backend
# runs. A flag is None (False for switches) until given, so a flag the chosen backend
# would ignore is an error naming it, never silently dropped.
SCHEDULER_FLAGS = {"token_budget": None, "chunk_size": None, "tile_size": None, "max_num_seqs": None,
                   "block_size": 16, "num_blocks": None, "adaptive_budget": False, "budget_rule": None,
                   "budget_tile": None, "qos_classes": None, "qos_mix": None, "qos_policy": None}
ENGINE_FLAGS = {"model": None, "device": "cpu", "dtype": None, "threads": 1, "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1, "worker_timeout": 300.0}
SIMULATOR_FLAGS = {"vidur_profile": None, "step_profile": None, "hardware": None, "num_layers": 32, "tp": 1,
                   "pipeline_stages": 1}
BUDGET_RULES = ("adaptive", "slo-static")
VIDUR_ONLY = ("hardware", "num_layers", "tp")  # a step profile fixes the engine it measured
ENDPOINT_FLAGS = {"vocab_size": 32000}


def add_common_args(p: argparse.ArgumentParser, policies: str, model: str = "cpu-small", *,
                    simulator: bool = True) -> None:
    """The workload, scheduler and engine flags, and (`simulator`) the simulator's."""
    p.set_defaults(default_policies=policies, default_model=model)
    w = p.add_argument_group("workload (every backend)")
    w.add_argument("--trace", default="sharegpt",
                   help=f"request lengths: {', '.join(BUILTIN_TRACES)}, a CSV path "
                        "(num_prefill_tokens,num_decode_tokens[,arrived_at]), fixed or uniform")
    w.add_argument("--length-scale", type=float, default=None,
                   help="multiply trace lengths by this (default: 1/8 on the engine, 1 simulated)")
    w.add_argument("--num-requests", type=int, default=None)
    w.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--stall-factor", type=float, default=5.0,
                   help="a TBT gap above this many median step times is a stall")
    p.add_argument("--out", default="bench_out", help="output directory")
    s = p.add_argument_group("scheduler (engine and simulator)")
    s.add_argument("--policy", default=None,
                   help=f"comma-separated, of {', '.join(available_policies())} (default {policies})")
    s.add_argument("--token-budget", type=int, help="tokens per step of the chunked policies")
    s.add_argument("--chunk-size", type=int, help="largest prefill chunk (default: the budget)")
    s.add_argument("--tile-size", type=int, help="GEMM tile rows to align steps to")
    s.add_argument("--max-num-seqs", type=int)
    s.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    s.add_argument("--num-blocks", type=int, help="KV cache blocks (default: sized from memory)")
    s.add_argument("--adaptive-budget", action="store_true",
                   help="size each sarathi step to --tbt-slo with a step-time model (the simulator's cost "
                        "model, or one the engine learns online); --token-budget becomes the cap")
    s.add_argument("--budget-rule", choices=BUDGET_RULES,
                   help="with --tbt-slo and no --token-budget: adaptive (the default: --adaptive-budget with "
                        f"a cap of {SIMULATOR_ADAPTIVE_CAP} simulated, {ENGINE_ADAPTIVE_CAP} on the engine) or "
                        "slo-static (one budget, the largest tile-aligned step measured or modelled within "
                        "the SLO)")
    s.add_argument("--budget-tile", type=int, help="tile the slo-static budget is a multiple of (default 128)")
    s.add_argument("--qos-classes", metavar="FILE.json",
                   help='QoS classes with deadlines, e.g. {"chat": {"ttft": 2.0, "tbt": 0.08}, "batch": '
                        '{"ttft": 60, "tbt": 0.5}} (seconds; needs --qos-mix)')
    s.add_argument("--qos-mix", metavar="NAME=FRACTION,...",
                   help="the share of requests in each class, e.g. chat=0.35,batch=0.65 (seeded)")
    s.add_argument("--qos-policy", choices=QOS_POLICIES,
                   help="with --qos-classes: deadline (the default; policy sarathi, the others always fcfs) "
                        "or fcfs (classes measured, not scheduled by)")
    e = p.add_argument_group("engine (without --simulate)")
    e.add_argument("--model", help=f"named model ({REAL_MODEL}), GGUF file, Hugging Face "
                                    f"directory or preset (tiny, cpu-small; default {model})")
    e.add_argument("--device", help="default cpu")
    e.add_argument("--dtype", help=DTYPE_HELP)
    e.add_argument("--threads", type=int,
                   help="CPU threads for torch and the kernels (default 1: timings stay steady on a shared machine)")
    e.add_argument("--tensor-parallel-size", type=int,
                   help="worker processes per pipeline stage (under torchrun: see python -m sarathi_rt.launch)")
    e.add_argument("--pipeline-parallel-size", type=int, help="default 1")
    e.add_argument("--worker-timeout", type=float, help="seconds a worker may keep a step (default 300)")
    if not simulator:
        return
    m = p.add_argument_group("simulator (with --simulate)")
    m.add_argument("--simulate", action="store_true", help="use the simulator instead of the engine")
    m.add_argument("--vidur-profile", metavar="CSV",
                   help=f"per-operation GPU times, vidur's mlp.csv (default: the bundled {DEFAULT_PROFILE})")
    m.add_argument("--step-profile", metavar="JSON",
                   help="a step profile from `sarathi-rt profile`: simulates that engine, its KV cache and "
                        "context limit")
    m.add_argument("--profile", help=argparse.SUPPRESS)  # deprecated: one flag for both formats
    m.add_argument("--hardware", choices=sorted(HARDWARE),
                   help="GPU of a vidur profile (default: the one its file name names, else a100)")
    m.add_argument("--num-layers", type=int, help="layers of the vidur-profiled model (default 32)")
    m.add_argument("--tp", type=int, help="tensor-parallel degree (a vidur profile column; default 1)")
    m.add_argument("--pipeline-stages", type=int, help="default 1")


class DeprecatedAlias(argparse.Action):
    """An old spelling of a renamed flag: stores into the new flag's dest, with a warning
    naming the new spelling (kept for one release)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        new = _flag(self.dest)
        warnings.warn(f"{option_string} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
        print(f"warning: {option_string} is deprecated; use {new}")
        setattr(namespace, self.dest, values)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(args: argparse.Namespace, names: Iterable[str]) -> list[str]:
    return [_flag(n) for n in names if getattr(args, n, None) not in (None, False)]


def resolve_flags(args: argparse.Namespace) -> str:
    """Check the flags against the backend they select and fill in the defaults of the
    ones it reads. Returns the backend: "engine", "simulator" or "endpoint"."""
    backend = "endpoint" if getattr(args, "endpoint", None) else \
        "simulator" if getattr(args, "simulate", False) else "engine"
    if getattr(args, "profile", None) is not None:
        new = "step_profile" if args.profile.endswith(".json") else "vidur_profile"
        warnings.warn(f"--profile is deprecated: use {_flag(new)}", DeprecationWarning, stacklevel=2)
        print(f"warning: --profile is deprecated; use {_flag(new)} {args.profile}")
        if getattr(args, new) is not None:
            raise ValueError(f"--profile and {_flag(new)} both given")
        setattr(args, new, args.profile)
    reads = {"engine": [SCHEDULER_FLAGS, ENGINE_FLAGS], "simulator": [SCHEDULER_FLAGS, SIMULATOR_FLAGS],
             "endpoint": [ENDPOINT_FLAGS]}[backend]
    unread = [flags for flags in (SCHEDULER_FLAGS, ENGINE_FLAGS, SIMULATOR_FLAGS, ENDPOINT_FLAGS)
              if not any(flags is r for r in reads)]
    ignored = _given(args, [n for flags in unread for n in flags]) + (_given(args, ["policy"]) if backend == "endpoint" else [])
    if backend == "simulator" and args.step_profile is not None:
        if args.vidur_profile is not None:
            raise ValueError("--step-profile and --vidur-profile exclude each other")
        ignored += _given(args, VIDUR_ONLY)
    if ignored:
        what = {"engine": "the engine (they need --simulate or --endpoint)",
                "simulator": "the simulator" + (" with a --step-profile" if args.step_profile else ""),
                "endpoint": "--endpoint (the server schedules and runs the model)"}[backend]
        raise ValueError(f"{', '.join(ignored)} not used by {what}")
    for flags in reads:
        for name, default in flags.items():
            if getattr(args, name, None) is None:
                setattr(args, name, default)
    if backend == "engine" and args.model is None:
        args.model = args.default_model
    if backend != "endpoint" and args.policy is None:
        args.policy = args.default_policies
    return backend


def parse_policies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = available_policies()
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise ValueError(f"--policy must be a comma-separated list of {known}, got {text!r}")
    return names


def load_qos_classes(path: str) -> dict[str, QoSClass]:
    """--qos-classes FILE.json: {name: {"ttft": s, "tbt": s[, "priority": int]}}."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"--qos-classes {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--qos-classes {path!r} is not valid JSON: {exc}") from None
    return dict(qos_classes_from(data, "--qos-classes"))


def parse_qos_mix(text: str) -> dict[str, float]:
    """--qos-mix chat=0.35,batch=0.65."""
    mix = {}
    for part in text.split(","):
        name, sep, frac = part.partition("=")
        try:
            mix[name.strip()] = float(frac)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--qos-mix must be NAME=FRACTION,... (e.g. chat=0.35,batch=0.65), got {text!r}")
    try:
        return check_qos_mix(mix)
    except ValueError as exc:
        raise ValueError(f"--qos-mix: {exc}") from None


def _resolve_qos(args: argparse.Namespace) -> None:
    """Parse --qos-classes and --qos-mix in place; they come together, and every class
    of the mix must be defined."""
    if getattr(args, "qos_classes", None) is None:
        given = _given(args, ["qos_mix", "qos_policy", "attainment"])
        if given:
            raise ValueError(f"{', '.join(given)} needs --qos-classes")
        return
    args.qos_classes = load_qos_classes(args.qos_classes)
    if args.qos_mix is None:
        raise ValueError("--qos-classes needs --qos-mix (the share of requests in each class)")
    args.qos_mix = parse_qos_mix(args.qos_mix)
    unknown = sorted(set(args.qos_mix) - set(args.qos_classes))
    if unknown:
        raise ValueError(f"--qos-mix names {unknown}, not classes of --qos-classes ({sorted(args.qos_classes)})")
    args.qos_policy = args.qos_policy or "deadline"


def workload_config(args: argparse.Namespace, qps: float, max_total_tokens: int | None) -> WorkloadConfig:
    return WorkloadConfig(num_requests=args.num_requests, qps=qps, arrival=args.arrival, lengths=args.trace,
                          length_scale=args.length_scale, max_total_tokens=max_total_tokens, seed=args.seed,
                          qos_mix=getattr(args, "qos_mix", None))


def scheduler_config(args: argparse.Namespace, policy: str, workload: Sequence[RequestSpec],
                     num_blocks: int) -> SchedulerConfig:
    """The chunked policies get --token-budget; the unchunked ones (vllm, orca) batch
    whole prompts, so their cap is the longest request (vLLM's max_num_batched_tokens
    defaults to the model length in the same way)."""
    budget, chunk = args.token_budget, args.chunk_size
    adaptive = args.adaptive_budget and get_policy(policy).adaptive
    # The deadline policy needs an adaptive one; the others are measured per class under FCFS.
    qos_policy = args.qos_policy if get_policy(policy).adaptive else "fcfs"
    if not get_policy(policy).chunked:
        budget = max(budget, max(r.num_prompt_tokens + r.num_decode_tokens for r in workload))
        chunk = None
    # A prompt's next chunk waits for its previous one to leave the pipeline, so each
    # micro-batch in flight needs its own partial prompt to keep the stages fed.
    return SchedulerConfig(policy=policy, token_budget=budget, chunk_size=chunk,
                           max_num_seqs=min(args.max_num_seqs, budget), block_size=args.block_size,
                           num_blocks=num_blocks, tile_size=args.tile_size,
                           max_partial_prefills=getattr(args, "pipeline_stages", None) or 1,
                           tbt_slo=args.tbt_slo if adaptive else None, qos_classes=args.qos_classes,
                           qos_policy=qos_policy or "deadline")


@dataclass
class SimBackend:
    """Runs a policy on the simulator with a vidur cost model."""

    args: argparse.Namespace

    def __post_init__(self) -> None:
        self.max_total_tokens: int | None = None
        self.cost_model: VidurCostModel | ShapeCostModel
        if self.args.step_profile is not None:
            self.cost_model = ShapeCostModel.load(self.args.step_profile)
            engine = self.cost_model.profile.engine
            self.num_blocks = self.args.num_blocks or engine["num_kv_blocks"]
            self.max_total_tokens = engine.get("max_total_tokens")
            return
        path = self.args.vidur_profile or data_path(DEFAULT_PROFILE)
        self.cost_model = VidurCostModel(path, num_layers=self.args.num_layers, tp=self.args.tp,
                                         hardware=self.args.hardware)
        self.num_blocks = self.args.num_blocks or self.cost_model.kv_cache_blocks(
            self.args.block_size, pipeline_stages=self.args.pipeline_stages)

    def close(self) -> None:
        """Nothing runs between calls (every backend has close())."""

    def run(self, policy: str, workload: Sequence[RequestSpec], progress: Callable[[int], None] | None
            ) -> tuple[list[RequestMetrics], list[StepMetrics]]:
        cfg = scheduler_config(self.args, policy, workload, self.num_blocks)
        res = simulate(workload, cfg, self.cost_model, pipeline_stages=self.args.pipeline_stages,
                       progress=progress)
        return res.requests, res.steps


@dataclass
class EngineBackend:
    """Runs each policy on a fresh engine over one model (loaded once: every policy
    serves the same weights and KV cache), replaying arrivals in wall-clock time."""

    args: argparse.Namespace

    def __post_init__(self) -> None:
        from sarathi_rt.models import resolve_config

        import torch

        if self.args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.args.threads}")
        torch.set_num_threads(self.args.threads)
        self.max_total_tokens = resolve_config(self.args.model)[0].max_position_embeddings
        self.num_blocks = self.args.num_blocks
        self._executor = None
        self.tokenizer = None

    def engine(self, policy: str, workload: Sequence[RequestSpec]):  # -> LLMEngine
        from sarathi_rt.engine import EngineConfig, LLMEngine
        from sarathi_rt.llm import load_tokenizer

        cfg = scheduler_config(self.args, policy, workload, 1)
        config = EngineConfig(model=self.args.model, device=self.args.device, dtype=self.args.dtype, policy=policy,
                              token_budget=cfg.token_budget, chunk_size=cfg.chunk_size,
                              max_num_seqs=cfg.max_num_seqs, block_size=self.args.block_size,
                              num_kv_blocks=self.num_blocks, tile_size=self.args.tile_size, seed=self.args.seed,
                              tbt_slo=cfg.tbt_slo, qos_classes=cfg.qos_classes, qos_policy=cfg.qos_policy,
                              tensor_parallel_size=self.args.tensor_parallel_size,
                              pipeline_parallel_size=self.args.pipeline_parallel_size,
                              worker_timeout=self.args.worker_timeout)
        if self._executor is None:  # the first engine starts the workers (in-process, spawned or torchrun)
            self.tokenizer = load_tokenizer(self.args.model)
            engine = LLMEngine(config, tokenizer=self.tokenizer)
            self._executor = engine.executor
            return engine
        return LLMEngine(config, executor=self._executor, tokenizer=self.tokenizer)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._executor is not None:
            self._executor.shutdown()

    def run(self, policy: str, workload: Sequence[RequestSpec], progress: Callable[[int], None] | None
            ) -> tuple[list[RequestMetrics], list[StepMetrics]]:
        from sarathi_rt.harness.replay import replay, warm_up

        engine = self.engine(policy, workload)
        warm_up(engine)
        return replay(engine, workload, seed=self.args.seed, progress=progress)


@dataclass
class EndpointBackend:
    """Sends the workload to an OpenAI-compatible server (`--endpoint`), whatever it runs;
    the scheduling flags are the server's business."""

    args: argparse.Namespace

    def __post_init__(self) -> None:
        from sarathi_rt.harness.http_replay import server_model

        if getattr(self.args, "simulate", False):
            raise ValueError("--endpoint and --simulate exclude each other")
        self.endpoint = self.args.endpoint.rstrip("/")
        info = server_model(self.endpoint)
        self.model = str(info["id"])
        self.max_total_tokens: int | None = info.get("max_model_len")

    def close(self) -> None:
        """The server is not ours to stop."""

    def run(self, policy: str, workload: Sequence[RequestSpec], progress: Callable[[int], None] | None
            ) -> tuple[list[RequestMetrics], list[StepMetrics]]:
        from sarathi_rt.harness.http_replay import replay_endpoint

        return replay_endpoint(self.endpoint, self.model, workload, vocab_size=self.args.vocab_size,
                               seed=self.args.seed, progress=progress), []


def make_backend(args: argparse.Namespace) -> SimBackend | EngineBackend | EndpointBackend:
    if getattr(args, "endpoint", None):
        return EndpointBackend(args)
    return SimBackend(args) if getattr(args, "simulate", False) else EngineBackend(args)


def fill_defaults(args: argparse.Namespace, **by_mode: tuple[object, object]) -> None:
    """Check the flags against the backend (`resolve_flags`), then set each flag left at
    None to its (engine, simulator) default. With --adaptive-budget the token budget is
    only a cap: 512 on the engine, 4096 simulated."""
    backend = resolve_flags(args)
    simulate = backend == "simulator"
    _resolve_qos(args)
    if backend != "endpoint":
        _choose_budget_rule(args)
        if args.budget_rule == "slo-static":
            by_mode.pop("token_budget", None)  # derived from the SLO once the backend is up
    if args.adaptive_budget:
        if args.tbt_slo is None:
            raise ValueError("--adaptive-budget needs --tbt-slo")
        if args.token_budget is None:
            args.token_budget = SIMULATOR_ADAPTIVE_CAP if simulate else ENGINE_ADAPTIVE_CAP
    for name, (engine_default, sim_default) in by_mode.items():
        if getattr(args, name) is None:
            setattr(args, name, sim_default if simulate else engine_default)


def _choose_budget_rule(args: argparse.Namespace) -> None:
    """The default budget rule (sarathi_rt.sim.budget): with a TBT SLO and no token
    budget, the adaptive budget unless --budget-rule says slo-static."""
    chosen = getattr(args, "tbt_slo", None) is not None and args.token_budget is None and not args.adaptive_budget
    check_budget_flags(args.budget_rule, args.budget_tile, chosen)
    if chosen:
        args.budget_rule = args.budget_rule or "adaptive"
        args.adaptive_budget = args.budget_rule == "adaptive"
    args.budget_tile = args.budget_tile or 128


def check_budget_flags(budget_rule: str | None, budget_tile: int | None, rule_chooses: bool) -> None:
    """--budget-rule only where the rule chooses the budget (a TBT SLO and no explicit
    budget), --budget-tile only for the slo-static rule (bench, capacity and serve)."""
    if budget_rule is not None and not rule_chooses:
        raise ValueError("--budget-rule applies only with --tbt-slo and no explicit budget (--token-budget, "
                         "--adaptive-budget)")
    if budget_tile is not None and not (rule_chooses and budget_rule == "slo-static"):
        raise ValueError("--budget-tile not used: it sizes the --budget-rule slo-static budget")


def slo_derived_budget(args: argparse.Namespace, backend: SimBackend | EngineBackend) -> int:
    """The --budget-rule slo-static budget: T(n) for a loaded hybrid batch of 32 decodes
    (fewer if max_num_seqs is lower) over contexts of the workload's mean request length,
    or less when the KV cache cannot hold that many; the largest tile-aligned n within
    the SLO."""
    tile = args.budget_tile
    num_decodes = min(32, args.max_num_seqs)
    workload = make_workload(workload_config(args, 1.0, backend.max_total_tokens))
    if isinstance(backend, SimBackend):
        profile = loaded_curve(backend.cost_model, workload, backend.num_blocks, args.block_size,
                               num_decodes=num_decodes)
        choice = choose_token_budget(profile, args.tbt_slo, tile)
    else:
        args.token_budget = tile * 8  # the profiling engine must fit the largest batch
        mean_len = sum(r.num_prompt_tokens + r.num_decode_tokens for r in workload) // len(workload)
        profile, choice = engine_slo_budget(backend.engine("sarathi", workload), args.tbt_slo, tile_size=tile,
                                            num_decodes=num_decodes, context_len=mean_len)
    print(f"token budget from the {args.tbt_slo * 1e3:g} ms SLO: {choice.token_budget} "
          f"(T = {choice.step_time * 1e3:.1f} ms with {num_decodes} decodes over {profile.context_len} tokens each)")
    plots = optional_plots()
    if plots is not None:
        plots.plot_step_time(profile, choice, os.path.join(args.out, "step_time.png"))
    return choice.token_budget

"""What `sarathi-rt bench`, `capacity` and `profile` share: the workload flags, the
config tree's flags (`sarathi_rt.config.flags`, the same as `serve`'s), the simulator's,
and one serving run of a policy (real engine, simulator or an HTTP endpoint)."""
from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

from sarathi_rt.config import SECTIONS, CacheOptions, SchedulerConfig, SchedulingOptions
from sarathi_rt.config.speculative import SpeculativeOptions
from sarathi_rt.config.budget import (DEFAULT_BUDGET_TILE, Budget, add_budget_flags, check_budget_flags,
                                      resolve_budget)
from sarathi_rt.config.flags import add_config_flags, flag_name, given_flags, given_options
from sarathi_rt.config.tree import DEFAULT_MODEL, field_names
from sarathi_rt.harness.step_timing import engine_slo_budget
from sarathi_rt.measure.metrics import RequestMetrics, StepMetrics
from sarathi_rt.scheduler import available_policies, get_policy
from sarathi_rt.scheduler.config import READ_ONLY_BY
from sarathi_rt.scheduler.qos import qos_classes_from
from sarathi_rt.sim import HARDWARE, AcceptanceDistribution, SimSpeculation, VidurCostModel, simulate
from sarathi_rt.sim.budget import choose_token_budget, loaded_curve
from sarathi_rt.sim.shape_model import ShapeCostModel
from sarathi_rt.workloads import (ARRIVALS, BUILTIN_TRACES, RequestSpec, WorkloadConfig, check_qos_mix, data_path,
                                  make_workload)

DEFAULT_PROFILE = "a100_llama-2-7b_mlp.csv.gz"
# The config fields the simulator reads: the scheduler's and the cache's, the cache's
# size and the parallel degrees (columns of a vidur profile). Every other field is
# the engine's, and an error with --simulate.
SIMULATOR_FIELDS = field_names(SchedulingOptions, CacheOptions) | {"num_kv_blocks", "tensor_parallel_size",
                                                                     "pipeline_parallel_size", "seed",
                                                                     "speculative_method", "speculative_k"}
SIMULATOR_FLAGS = ("vidur_profile", "step_profile", "hardware", "num_layers", "acceptance")
VIDUR_ONLY = ("hardware", "num_layers", "tensor_parallel_size")  # a step profile fixes the engine it measured
ENDPOINT_FLAGS = ("vocab_size",)


def optional_plots() -> ModuleType | None:
    """sarathi_rt.measure.plots when matplotlib is installed (the `plot` extra); otherwise None,
    after saying how to get the plots. The numbers never depend on it."""
    if importlib.util.find_spec("matplotlib") is None:
        print("plots skipped: matplotlib is not installed (pip install 'sarathi_rt[plot]' to get them)")
        return None
    from sarathi_rt.measure import plots

    return plots


def add_common_args(p: argparse.ArgumentParser, policies: str, *, simulator: bool = True) -> None:
    """The workload flags, the config tree's (with --policy taking a comma-separated list
    of policies to compare, `policies` by default), the budget rule's and (`simulator`)
    the simulator's."""
    p.set_defaults(default_policies=policies)
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default="sharegpt",
                   help=f"request lengths: {', '.join(BUILTIN_TRACES)}, a CSV path "
                        "(num_prefill_tokens,num_decode_tokens[,arrived_at]), fixed or uniform")
    w.add_argument("--length-scale", type=float, default=None,
                   help="multiply trace lengths by this (default: 1/8 on the engine, 1 simulated)")
    w.add_argument("--num-requests", type=int, default=None)
    w.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    w.add_argument("--qos-mix", metavar="NAME=FRACTION,...",
                   help="with --qos-classes: the share of requests in each class, e.g. chat=0.35,batch=0.65 "
                        "(seeded by --seed)")
    p.add_argument("--stall-factor", type=float, default=5.0,
                   help="a TBT gap above this many median step times is a stall")
    p.add_argument("--out", default="bench_out", help="output directory")
    add_config_flags(p)
    add_budget_flags(p)
    if not simulator:
        return
    m = p.add_argument_group("simulator (with --simulate)")
    m.add_argument("--simulate", action="store_true", help="use the simulator instead of the engine")
    m.add_argument("--vidur-profile", metavar="CSV",
                   help=f"per-operation GPU times, vidur's mlp.csv (default: the bundled {DEFAULT_PROFILE})")
    m.add_argument("--step-profile", metavar="JSON",
                   help="a step profile from `sarathi-rt profile`: simulates that engine, its KV cache and "
                        "context limit")
    m.add_argument("--hardware", choices=sorted(HARDWARE),
                   help="GPU of a vidur profile (default: the one its file name names, else a100)")
    m.add_argument("--num-layers", type=int, help="layers of the vidur-profiled model (default 32)")
    add_acceptance_flag(m)


def add_acceptance_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The simulator's --acceptance (`capacity`, `bench` and `deploy`)."""
    p.add_argument("--acceptance", metavar="MEAN[,SPREAD]",
                   help="with --speculative-method: each request's chance that a draft token is accepted, drawn "
                        "around MEAN with standard deviation SPREAD across requests (default 0); a trace's "
                        "acceptance column gives each request its own")


def resolve_flags(args: argparse.Namespace) -> str:
    """Check the flags against the backend they select, set `args.options` (the config
    fields given, by name) and the backend's defaults. Returns the backend: "engine",
    "simulator" or "endpoint"."""
    backend = "endpoint" if getattr(args, "endpoint", None) else \
        "simulator" if getattr(args, "simulate", False) else "engine"
    options = given_options(args)
    args.policy = options.pop("policy", None) or args.default_policies
    if backend == "engine":
        unread = [flag_name(n) for n in (*SIMULATOR_FLAGS, *ENDPOINT_FLAGS) if getattr(args, n, None) is not None]
    elif backend == "simulator":
        unread = given_flags(options, sorted(field_names(*SECTIONS) - SIMULATOR_FIELDS))
        unread += [flag_name(n) for n in ENDPOINT_FLAGS if getattr(args, n, None) is not None]
        if args.step_profile is not None:
            if args.vidur_profile is not None:
                raise ValueError("--step-profile and --vidur-profile exclude each other")
            unread += [flag_name(n) for n in VIDUR_ONLY if n in options or getattr(args, n, None) is not None]
    else:
        unread = given_flags(options, sorted(field_names(*SECTIONS) - {"seed"}))  # --seed seeds the workload
        unread += [flag_name(n) for n in (*SIMULATOR_FLAGS, "qos_mix") if getattr(args, n, None) is not None]
        if args.policy != args.default_policies:
            unread.append("--policy")
    if unread:
        what = {"engine": "the engine (they need --simulate or --endpoint)",
                "simulator": "the simulator" + (" with a --step-profile" if getattr(args, "step_profile", None) else ""),
                "endpoint": "--endpoint (the server schedules and runs the model)"}[backend]
        raise ValueError(f"{', '.join(unread)} not used by {what}")
    if backend == "engine":
        options.setdefault("model", DEFAULT_MODEL)
    args.options = options
    args.seed = options.get("seed", 0)
    args.model = options.get("model")
    args.device = options.get("device", "cpu")
    args.tbt_slo = options.get("tbt_slo")
    args.qos_classes = options.get("qos_classes")
    return backend


def parse_policies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = available_policies()
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise ValueError(f"--policy must be a comma-separated list of {known}, got {text!r}")
    return names


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
    """--qos-classes and --qos-mix come together, and every class of the mix must be defined."""
    if args.qos_classes is None:
        given = [flag_name(n) for n in ("qos_mix", "attainment") if getattr(args, n, None) is not None]
        given += given_flags(args.options, ["qos_policy", "default_qos"])
        if given:
            raise ValueError(f"{', '.join(given)} needs --qos-classes")
        return
    args.qos_classes = dict(qos_classes_from(args.qos_classes, "--qos-classes"))
    if args.qos_mix is None:
        raise ValueError("--qos-classes needs --qos-mix (the share of requests in each class)")
    args.qos_mix = parse_qos_mix(args.qos_mix)
    unknown = sorted(set(args.qos_mix) - set(args.qos_classes))
    if unknown:
        raise ValueError(f"--qos-mix names {unknown}, not classes of --qos-classes ({sorted(args.qos_classes)})")


def workload_config(args: argparse.Namespace, qps: float, max_total_tokens: int | None) -> WorkloadConfig:
    return WorkloadConfig(num_requests=args.num_requests, qps=qps, arrival=args.arrival, lengths=args.trace,
                          length_scale=args.length_scale, max_total_tokens=max_total_tokens, seed=args.seed,
                          qos_mix=getattr(args, "qos_mix", None))


def sim_speculation(options: Mapping[str, Any], acceptance: str | None, policies: Sequence[str],
                    seed: int) -> SimSpeculation | None:
    """The simulator's speculative decoding from the config fields --speculative-method
    and -k (`options`) and --acceptance (the method itself is the engine's business: the
    simulator draws acceptances; the n-gram sizes are not read)."""
    unread = given_flags(options, ("speculative_ngram_min", "speculative_ngram_max"))
    if unread:
        raise ValueError(f"{', '.join(unread)} not used by the simulator (it draws acceptances: give --acceptance)")
    if options.get("speculative_method", "none") == "none":
        if acceptance is not None or "speculative_k" in options:
            raise ValueError("--acceptance and --speculative-k are used only with --speculative-method")
        return None
    dist = None if acceptance is None else AcceptanceDistribution.parse(acceptance)
    speculation = SimSpeculation(options.get("speculative_k", SpeculativeOptions.speculative_k), dist, seed)
    for policy in policies:
        speculation.check_policy(policy)
    return speculation


def policy_options(args: argparse.Namespace, policy: str, workload: Sequence[RequestSpec]) -> dict[str, Any]:
    """The config fields one policy of the comparison runs with: the flags, the budget
    by the budget rule, and what the other policies of the run read but this one cannot.
    The unchunked policies (vllm, orca) batch whole prompts, so their cap is at least the
    longest request (vLLM's max_num_batched_tokens defaults to the model length in the
    same way); they take no chunk size and measure QoS classes under fcfs."""
    options = dict(args.options)
    policy_cls = get_policy(policy)
    budget = policy_budget(args, policy)
    options |= {"policy": policy, "token_budget": budget.token_budget, "tbt_slo": budget.tbt_slo}
    for name, reads in READ_ONLY_BY.items():
        if not getattr(policy_cls, reads):
            options.pop(name, None)
    if not policy_cls.chunked:
        options["token_budget"] = max(budget.token_budget,
                                      max(r.num_prompt_tokens + r.num_decode_tokens for r in workload))
    if not policy_cls.adaptive and args.qos_classes is not None:
        options["qos_policy"] = "fcfs"
    if args.qos_classes is not None:
        options["qos_classes"] = args.qos_classes
    return options


def policy_budget(args: argparse.Namespace, policy: str) -> Budget:
    return resolve_budget(args.budget_rule_chosen, args.options.get("token_budget"), args.tbt_slo, policy,
                          gpu=args.backend == "simulator" or str(args.device).startswith("cuda"),
                          slo_static=lambda: args.slo_static_budget)


def scheduler_config(args: argparse.Namespace, policy: str, workload: Sequence[RequestSpec],
                     num_blocks: int) -> SchedulerConfig:
    """The simulator's scheduler config for `policy` (a pipeline keeps one partial
    prompt per micro-batch in flight)."""
    options = policy_options(args, policy, workload)
    shared = {n: v for n, v in options.items() if n in field_names(SchedulingOptions, CacheOptions)}
    if shared.get("tile_size") == "auto":
        raise ValueError("--tile-size auto needs an engine (it is the device's GEMM tile); give an int")
    return SchedulerConfig(**shared, num_blocks=num_blocks,
                           max_partial_prefills=options.get("pipeline_parallel_size", 1))


@dataclass
class SimBackend:
    """Runs a policy on the simulator with a vidur cost model (or a step profile's)."""

    args: argparse.Namespace

    def __post_init__(self) -> None:
        self.max_total_tokens: int | None = None
        self.cost_model: VidurCostModel | ShapeCostModel
        given_blocks = self.args.options.get("num_kv_blocks")
        self.pipeline_stages = self.args.options.get("pipeline_parallel_size", 1)
        if self.args.step_profile is not None:
            self.cost_model = ShapeCostModel.load(self.args.step_profile)
            engine = self.cost_model.profile.engine
            self.num_blocks = given_blocks or engine["num_kv_blocks"]
            self.max_total_tokens = engine.get("max_total_tokens")
            self.speculation = sim_speculation(self.args.options, self.args.acceptance, parse_policies(self.args.policy),
                                           self.args.seed)
            return
        path = self.args.vidur_profile or data_path(DEFAULT_PROFILE)
        self.cost_model = VidurCostModel(path, num_layers=self.args.num_layers or 32,
                                         tp=self.args.options.get("tensor_parallel_size", 1),
                                         hardware=self.args.hardware)
        self.num_blocks = given_blocks or self.cost_model.kv_cache_blocks(
            self.args.options.get("block_size", CacheOptions.block_size), pipeline_stages=self.pipeline_stages)
        self.speculation = sim_speculation(self.args.options, self.args.acceptance, parse_policies(self.args.policy),
                                           self.args.seed)

    def close(self) -> None:
        """Nothing runs between calls (every backend has close())."""

    def run(self, policy: str, workload: Sequence[RequestSpec], progress: Callable[[int], None] | None
            ) -> tuple[list[RequestMetrics], list[StepMetrics]]:
        cfg = scheduler_config(self.args, policy, workload, self.num_blocks)
        res = simulate(workload, cfg, self.cost_model, pipeline_stages=self.pipeline_stages, progress=progress,
                       speculation=self.speculation)
        return res.requests, res.steps


@dataclass
class EngineBackend:
    """Runs each policy on a fresh engine over one model (loaded once: every policy
    serves the same weights and KV cache), replaying arrivals in wall-clock time."""

    args: argparse.Namespace

    def __post_init__(self) -> None:
        from sarathi_rt.models import resolve_model

        # Once for every engine this backend starts.
        self.resolved_model = resolve_model(self.args.model, model_impl=self.args.options.get("model_impl", "auto"),
                                            trust_remote_code=self.args.options.get("trust_remote_code", False))
        self.max_total_tokens = self.resolved_model.config.max_position_embeddings
        self._executor = None
        self.tokenizer = None

    def engine(self, policy: str, workload: Sequence[RequestSpec], **overrides: Any):  # -> LLMEngine
        from sarathi_rt.engine import EngineConfig, LLMEngine
        from sarathi_rt.llm import load_tokenizer

        config = EngineConfig(**policy_options(self.args, policy, workload) | overrides)
        if self._executor is None:  # the first engine starts the workers (in-process, spawned or torchrun)
            self.tokenizer = load_tokenizer(self.args.model)
            engine = LLMEngine(config, tokenizer=self.tokenizer, model=self.resolved_model)
            self._executor = engine.executor
            return engine
        return LLMEngine(config, executor=self._executor, tokenizer=self.tokenizer, model=self.resolved_model)

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
    """Check the flags against the backend (`resolve_flags`), the QoS and budget flags,
    then set each workload flag left at None to its (engine, simulator) default."""
    args.backend = resolve_flags(args)
    _resolve_qos(args)
    if args.backend != "endpoint":
        policies = parse_policies(args.policy)
        args.budget_rule_chosen = check_budget_flags(args, args.options.get("token_budget"), args.tbt_slo)
        if args.budget_rule is not None and not any(get_policy(p).adaptive for p in policies):
            raise ValueError(f"--budget-rule {args.budget_rule} is not supported by policy {args.policy!r}")
        for name, reads in READ_ONLY_BY.items():
            if name in args.options and not any(getattr(get_policy(p), reads) for p in policies):
                raise ValueError(f"{flag_name(name)} is not used by policy {args.policy!r}")
    args.slo_static_budget = None
    for name, (engine_default, sim_default) in by_mode.items():
        if getattr(args, name) is None:
            setattr(args, name, sim_default if args.backend == "simulator" else engine_default)


def slo_derived_budget(args: argparse.Namespace, backend: SimBackend | EngineBackend) -> None:
    """With --budget-rule slo-static: T(n) for a loaded hybrid batch of 32 decodes (fewer
    if max_num_seqs is lower) over contexts of the workload's mean request length, or less
    when the KV cache cannot hold that many; the budget is the largest tile-aligned n
    within the SLO (`args.slo_static_budget`)."""
    if args.budget_rule_chosen != "slo-static":
        return
    tile = args.budget_tile or DEFAULT_BUDGET_TILE
    num_decodes = min(32, args.options.get("max_num_seqs", 32))
    workload = make_workload(workload_config(args, 1.0, backend.max_total_tokens))
    if isinstance(backend, SimBackend):
        profile = loaded_curve(backend.cost_model, workload, backend.num_blocks,
                               args.options.get("block_size", CacheOptions.block_size), num_decodes=num_decodes)
        choice = choose_token_budget(profile, args.tbt_slo, tile)
    else:
        mean_len = sum(r.num_prompt_tokens + r.num_decode_tokens for r in workload) // len(workload)
        # The probing engine must fit the largest batch it times.
        probe = backend.engine("sarathi", workload, token_budget=tile * 8, tbt_slo=None)
        profile, choice = engine_slo_budget(probe, args.tbt_slo, tile_size=tile, num_decodes=num_decodes,
                                            context_len=mean_len)
    print(f"token budget from the {args.tbt_slo * 1e3:g} ms SLO: {choice.token_budget} "
          f"(T = {choice.step_time * 1e3:.1f} ms with {num_decodes} decodes over {profile.context_len} tokens each)")
    plots = optional_plots()
    if plots is not None:
        plots.plot_step_time(profile, choice, os.path.join(args.out, "step_time.png"))
    args.slo_static_budget = choice.token_budget


def probe_slo_budget(options: dict[str, Any], tbt_slo: float, tile: int) -> int:
    """`serve`'s slo-static budget: the largest tile-aligned step within the SLO, timed
    on an engine of the same model (32 decodes over 1024-token contexts, less if the
    cache is smaller); that engine is closed before the serving one loads."""
    from sarathi_rt.llm import LLM

    probe_options = {n: v for n, v in options.items() if n not in ("qos_classes", "default_qos", "qos_policy")}
    with LLM(**probe_options | {"token_budget": tile * 8, "tbt_slo": None}) as probe:
        _, choice = engine_slo_budget(probe.engine, tbt_slo, tile_size=tile,
                                      num_decodes=min(32, probe.engine.config.max_num_seqs))
    print(f"token budget from the {tbt_slo * 1e3:g} ms SLO: {choice.token_budget} "
          f"(T = {choice.step_time * 1e3:.1f} ms)", flush=True)
    return choice.token_budget

"""What `sarathi-rt bench` and `sarathi-rt capacity` share: workload, scheduler and
simulator flags, and one serving run of a policy (real engine or simulator)."""
from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Sequence

from sarathi_rt.measure.metrics import RequestMetrics, StepMetrics
from sarathi_rt.scheduler import SchedulerConfig, available_policies, get_policy
from sarathi_rt.sim import HARDWARE, VidurCostModel, simulate
from sarathi_rt.sim.shape_model import ShapeCostModel
from sarathi_rt.workloads import ARRIVALS, BUILTIN_TRACES, RequestSpec, WorkloadConfig, data_path

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


def add_common_args(p: argparse.ArgumentParser, policies: str, model: str = "cpu-small") -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default="sharegpt",
                   help=f"request lengths: {', '.join(BUILTIN_TRACES)}, a CSV path "
                        "(num_prefill_tokens,num_decode_tokens[,arrived_at]), fixed or uniform")
    w.add_argument("--length-scale", type=float, default=None,
                   help="multiply trace lengths by this (default: 1/8 on the engine, 1 simulated)")
    w.add_argument("--num-requests", type=int, default=None)
    w.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("scheduler")
    s.add_argument("--policy", default=policies, help=f"comma-separated, of {', '.join(available_policies())}")
    s.add_argument("--token-budget", type=int, default=None, help="tokens per step of the chunked policies")
    s.add_argument("--chunk-size", type=int, default=None, help="largest prefill chunk (default: the budget)")
    s.add_argument("--tile-size", type=int, default=None, help="GEMM tile rows to align steps to")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: sized from memory)")
    s.add_argument("--adaptive-budget", action="store_true",
                   help="size each sarathi step to --tbt-slo with a step-time model (the simulator's cost "
                        "model, or one the engine learns online); --token-budget becomes the cap")
    e = p.add_argument_group("engine")
    e.add_argument("--model", default=model, help=f"named model ({REAL_MODEL}), GGUF file, Hugging Face "
                                                  f"directory or preset (tiny, cpu-small; default {model})")
    e.add_argument("--device", default="cpu")
    e.add_argument("--dtype", default="float32")
    e.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch and the kernels (1 keeps timings steady on a shared machine)")
    e.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="worker processes per pipeline stage (under torchrun: see python -m sarathi_rt.launch)")
    e.add_argument("--pipeline-parallel-size", type=int, default=1)
    e.add_argument("--worker-timeout", type=float, default=300.0, help="seconds a worker may keep a step")
    m = p.add_argument_group("simulator")
    m.add_argument("--simulate", action="store_true", help="use the simulator instead of the engine")
    m.add_argument("--profile", default=None,
                   help="for --simulate: a step profile from `sarathi-rt profile` (.json: simulates that engine, "
                        f"its KV cache and context limit), or a vidur mlp.csv (default: the bundled {DEFAULT_PROFILE})")
    m.add_argument("--hardware", default=None, choices=sorted(HARDWARE),
                   help="GPU of the simulation (default: the one the profile's file name names, else a100)")
    m.add_argument("--num-layers", type=int, default=32, help="layers of the profiled model")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (a profile column)")
    m.add_argument("--pipeline-stages", type=int, default=1)
    p.add_argument("--stall-factor", type=float, default=5.0,
                   help="a TBT gap above this many median step times is a stall")
    p.add_argument("--out", default="bench_out", help="output directory")


def parse_policies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = available_policies()
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise ValueError(f"--policy must be a comma-separated list of {known}, got {text!r}")
    return names


def workload_config(args: argparse.Namespace, qps: float, max_total_tokens: int | None) -> WorkloadConfig:
    return WorkloadConfig(num_requests=args.num_requests, qps=qps, arrival=args.arrival, lengths=args.trace,
                          length_scale=args.length_scale, max_total_tokens=max_total_tokens, seed=args.seed)


def scheduler_config(args: argparse.Namespace, policy: str, workload: Sequence[RequestSpec],
                     num_blocks: int) -> SchedulerConfig:
    """The chunked policies get --token-budget; the unchunked ones (vllm, orca) batch
    whole prompts, so their cap is the longest request (vLLM's max_num_batched_tokens
    defaults to the model length in the same way)."""
    budget, chunk = args.token_budget, args.chunk_size
    adaptive = args.adaptive_budget and get_policy(policy).adaptive
    if not get_policy(policy).chunked:
        budget = max(budget, max(r.num_prompt_tokens + r.num_decode_tokens for r in workload))
        chunk = None
    # A prompt's next chunk waits for its previous one to leave the pipeline, so each
    # micro-batch in flight needs its own partial prompt to keep the stages fed.
    return SchedulerConfig(policy=policy, token_budget=budget, chunk_size=chunk,
                           max_num_seqs=min(args.max_num_seqs, budget), block_size=args.block_size,
                           num_blocks=num_blocks, tile_size=args.tile_size,
                           max_partial_prefills=args.pipeline_stages, tbt_slo=args.tbt_slo if adaptive else None)


@dataclass
class SimBackend:
    """Runs a policy on the simulator with a vidur cost model."""

    args: argparse.Namespace

    def __post_init__(self) -> None:
        if self.args.tensor_parallel_size != 1 or self.args.pipeline_parallel_size != 1:
            raise ValueError("--tensor-parallel-size and --pipeline-parallel-size run the engine; the simulator "
                             "takes --tp and --pipeline-stages")
        path = self.args.profile or data_path(DEFAULT_PROFILE)
        self.max_total_tokens: int | None = None
        self.cost_model: VidurCostModel | ShapeCostModel
        if path.endswith(".json"):
            self.cost_model = ShapeCostModel.load(path)
            engine = self.cost_model.profile.engine
            self.num_blocks = self.args.num_blocks or engine["num_kv_blocks"]
            self.max_total_tokens = engine.get("max_total_tokens")
            return
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

        if self.args.pipeline_stages != 1 or self.args.tp != 1:
            raise ValueError("--pipeline-stages and --tp apply to --simulate only")
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
                              tbt_slo=cfg.tbt_slo, tensor_parallel_size=self.args.tensor_parallel_size,
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
        from sarathi_rt.measure.replay import replay, warm_up

        engine = self.engine(policy, workload)
        warm_up(engine)
        return replay(engine, workload, seed=self.args.seed, progress=progress)


@dataclass
class EndpointBackend:
    """Sends the workload to an OpenAI-compatible server (`--endpoint`), whatever it runs;
    the scheduling flags are the server's business."""

    args: argparse.Namespace

    def __post_init__(self) -> None:
        from sarathi_rt.measure.http_replay import server_model

        if self.args.simulate:
            raise ValueError("--endpoint and --simulate exclude each other")
        self.endpoint = self.args.endpoint.rstrip("/")
        info = server_model(self.endpoint)
        self.model = str(info["id"])
        self.max_total_tokens: int | None = info.get("max_model_len")

    def close(self) -> None:
        """The server is not ours to stop."""

    def run(self, policy: str, workload: Sequence[RequestSpec], progress: Callable[[int], None] | None
            ) -> tuple[list[RequestMetrics], list[StepMetrics]]:
        from sarathi_rt.measure.http_replay import replay_endpoint

        return replay_endpoint(self.endpoint, self.model, workload, vocab_size=self.args.vocab_size,
                               seed=self.args.seed, progress=progress), []


def make_backend(args: argparse.Namespace) -> SimBackend | EngineBackend | EndpointBackend:
    if getattr(args, "endpoint", None):
        return EndpointBackend(args)
    return SimBackend(args) if args.simulate else EngineBackend(args)


def fill_defaults(args: argparse.Namespace, **by_mode: tuple[object, object]) -> None:
    """Set each flag left at None to its (engine, simulator) default. With
    --adaptive-budget the token budget is only a cap: 512 on the engine, 4096 simulated."""
    if args.adaptive_budget:
        if args.tbt_slo is None:
            raise ValueError("--adaptive-budget needs --tbt-slo")
        if args.token_budget is None:
            args.token_budget = 4096 if args.simulate else 512
    for name, (engine_default, sim_default) in by_mode.items():
        if getattr(args, name) is None:
            setattr(args, name, sim_default if args.simulate else engine_default)

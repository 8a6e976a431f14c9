"""Scheduler configuration, declared once. `SchedulingOptions` and `CacheOptions` are
the sections a user sets (the engine's config tree, `sarathi_rt.config.EngineConfig`,
composes the same sections, and every command's flags are built from their fields);
`SchedulerConfig` is what a scheduler runs with: those sections plus the KV cache's
size and the partial-prefill count, which whoever builds the scheduler knows (the
engine from its memory and pipeline, the simulator from its cost model).

The token budget rule (`resolve_token_budget`) is the one every entry point uses."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sarathi_rt.utils.checks import boolean, fraction, positive_int, positive_number
from sarathi_rt.utils.options import int_or_auto, option, read_json_file

from .qos import QoSClass, check_qos_settings, qos_classes_from
from .registry import get_policy

# The token budget when none is given and no TBT SLO sizes the steps: the smallest step
# whose time per token is near the device's best, so that a step is as short as it can
# be without giving up prefill throughput. On a CPU the GEMMs reach their rate early:
# SmolLM2-135M on 2 threads takes 1303, 410, 319, 273 and 289 us a token at 16, 64, 128,
# 256 and 512 tokens, so 128 is within 20% of the best at half the step time of 256. A
# GPU's tensor cores need a few waves of 128-row tiles: 512 (Sarathi-Serve's smallest
# budget on an A100).
DEFAULT_TOKEN_BUDGET = {"cpu": 128, "gpu": 512}
# With a TBT SLO and no token budget, each step is sized to the SLO (the adaptive
# budget) and capped here. A static budget is right for one load and one mix of lengths;
# the adaptive one follows both, which is what a default must do on traces and devices
# nobody tuned it for (bench/bench_adaptive_budget.py checks it against the best static
# budget of a sweep on every shipped profile x hardware x trace x SLO x seed). The caps
# only bound a step: a CPU's steps reach any SLO worth serving well below 512 tokens
# (and the engine sizes its step buffers for the cap); a GPU's, and the simulator's,
# which models one, reach thousands.
ADAPTIVE_CAP = {"cpu": 512, "gpu": 4096}
# The deadline policy's ordering knob when none is given (SchedulingOptions.qos_srpf_weight).
DEFAULT_SRPF_WEIGHT = 1.0
# Requests running at once when max_num_seqs is not given, at most the budget (a
# hybrid step carries every running decode, one token each).
DEFAULT_MAX_NUM_SEQS = 128


# The settings only some policies read, by the policy-class flag that says which:
# SchedulingOptions refuses them for any other policy, and a run comparing several
# policies (bench, capacity) gives each policy only the ones it reads.
READ_ONLY_BY = {"chunk_size": "chunked", "long_prefill_threshold": "adaptive", "slo_margin": "adaptive",
                "qos_srpf_weight": "adaptive"}


def resolve_token_budget(token_budget: int | None, tbt_slo: float | None, policy: str, *, gpu: bool) -> int:
    """The one token budget rule, for every entry point: a given budget is the budget
    (the cap, under a TBT SLO); without one, a policy that sizes steps to the SLO
    (sarathi) gets ADAPTIVE_CAP for the device, and every other case the device's
    DEFAULT_TOKEN_BUDGET.
    (sarathi_rt.config.budget adds the slo-static rule, which needs a measured engine.)"""
    if token_budget is not None:
        return positive_int("token_budget", token_budget)
    if tbt_slo is not None and get_policy(policy).adaptive:
        return ADAPTIVE_CAP["gpu" if gpu else "cpu"]
    return DEFAULT_TOKEN_BUDGET["gpu" if gpu else "cpu"]


def _load_qos_file(path: str) -> Mapping[str, QoSClass]:
    """--qos-classes FILE.json: {name: {"ttft": s, "tbt": s[, "priority": int]}}."""
    return qos_classes_from(read_json_file("qos_classes", path), "qos_classes")


@dataclass(frozen=True, kw_only=True)
class SchedulingOptions:
    """Which requests run how many tokens in each step."""

    SECTION = "scheduler"

    policy: str = option("sarathi", "scheduling policy: sarathi (chunked prefills, stall-free hybrid batches), "
                                    "vllm, orca, request_level, decode_maximal")
    token_budget: int | None = option(None, "most tokens in one step; default "
                                            f"{DEFAULT_TOKEN_BUDGET['cpu']} on a CPU, {DEFAULT_TOKEN_BUDGET['gpu']} "
                                            f"on a GPU, or with tbt_slo the cap of each step: {ADAPTIVE_CAP['cpu']} "
                                            f"on a CPU, {ADAPTIVE_CAP['gpu']} on a GPU. "
                                            "For the unchunked policies it is the largest batch, so it "
                                            "also bounds a prompt")
    chunk_size: int | None = option(None, "largest prefill chunk per request per step (default: the token "
                                          "budget); only the chunking policies take it")
    max_num_seqs: int | None = option(None, "most requests running at once (default: "
                                            f"min({DEFAULT_MAX_NUM_SEQS}, token budget))")
    tile_size: int | str | None = option(None, "GEMM tile rows: chunks cut short are trimmed so a step's "
                                               "token count is a multiple of it; 'auto': the device's GEMM tile "
                                               "(engine only; none on a CPU)", parse=int_or_auto)
    long_prefill_threshold: int | None = option(None, "a prompt longer than this gets at most this many "
                                                      "tokens per step, leaving budget for the prompts "
                                                      "behind it (sarathi)")
    tbt_slo: float | None = option(None, "time-between-tokens target (s): each step's prefill is sized so "
                                         "the step, as the online step-time model predicts it, stays within "
                                         "it (sarathi); the token budget is then the cap", parse=float)
    slo_margin: float | None = option(None, "share of tbt_slo held back for the step-time model's error "
                                            "(default: the model's own, 0.1 for the engine's)", parse=float)
    qos_classes: Mapping[str, QoSClass] | None = option(
        None, 'QoS classes with deadlines, from a JSON file: {"chat": {"ttft": 2.0, "tbt": 0.1, "priority": 1}, '
              '...} (seconds)', parse=_load_qos_file, metavar="FILE.json")
    default_qos: str | None = option(None, "the class of a request that names none (default: none, so "
                                           "requests must name one when there are classes)")
    qos_policy: str | None = option(None, "deadline: schedule by the classes' deadlines (policy sarathi); "
                                          "fcfs: only measure them (default: deadline where the policy can, "
                                          "else fcfs)", choices=("deadline", "fcfs"))
    qos_srpf_weight: float | None = option(None, "the deadline policy's ordering: prefills go by first-token "
                                                "deadline plus this many times their remaining prefill seconds (0: "
                                                "earliest deadline first; larger leans to shortest remaining first; "
                                                f"default {DEFAULT_SRPF_WEIGHT})", parse=float)

    def _check_scheduling(self, gpu: bool) -> None:
        """Resolve the defaults that depend on other fields, then reject impossible and
        contradictory settings, naming the field."""
        policy_cls = get_policy(self.policy)
        budget = resolve_token_budget(self.token_budget, self.tbt_slo, self.policy, gpu=gpu)
        object.__setattr__(self, "token_budget", budget)
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", min(DEFAULT_MAX_NUM_SEQS, budget))
        positive_int("max_num_seqs", self.max_num_seqs)
        if self.chunk_size is not None:
            positive_int("chunk_size", self.chunk_size)
            if not policy_cls.chunked:
                raise ValueError(f"chunk_size is not used by policy {self.policy!r}, which prefills whole prompts")
            if self.chunk_size > budget:
                raise ValueError(f"chunk_size ({self.chunk_size}) must not exceed token_budget ({budget})")
        elif policy_cls.chunked:
            object.__setattr__(self, "chunk_size", budget)
        if self.tile_size is not None and self.tile_size != "auto":
            positive_int("tile_size", self.tile_size)
            if self.tile_size > budget:
                raise ValueError(f"token_budget ({budget}) is below one tile (tile_size {self.tile_size})")
        if self.long_prefill_threshold is not None:
            positive_int("long_prefill_threshold", self.long_prefill_threshold)
            if not policy_cls.adaptive:  # a sarathi knob: the other policies never cap one prompt's chunk
                raise ValueError(f"long_prefill_threshold is not used by policy {self.policy!r}")
        if self.tbt_slo is not None:
            positive_number("tbt_slo", self.tbt_slo, "seconds")
            if not policy_cls.adaptive:
                raise ValueError(f"tbt_slo (the adaptive token budget) is not supported by policy {self.policy!r}")
        if self.qos_policy is None:
            object.__setattr__(self, "qos_policy", "deadline" if policy_cls.adaptive else "fcfs")
        object.__setattr__(self, "qos_classes", check_qos_settings(self.qos_classes, self.default_qos,
                                                                   self.qos_policy))
        if self.qos_classes is not None and self.qos_policy == "deadline" and not policy_cls.adaptive:
            raise ValueError(f"qos_policy 'deadline' is not supported by policy {self.policy!r} "
                             "(use qos_policy='fcfs' or policy 'sarathi')")
        if self.slo_margin is not None:
            fraction("slo_margin", self.slo_margin)
            if not self.needs_step_time_model:
                raise ValueError("slo_margin is used only where steps are sized in seconds: give tbt_slo, or "
                                 "qos_classes under qos_policy 'deadline'")
        w = self.qos_srpf_weight
        if w is None:  # resolved only where it is read, so a copy of this config checks the same
            if self.deadline_aware:
                object.__setattr__(self, "qos_srpf_weight", DEFAULT_SRPF_WEIGHT)
        elif isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or w == float("inf"):
            raise ValueError(f"qos_srpf_weight must be a finite number >= 0, got {w!r}")
        elif not self.deadline_aware:
            raise ValueError("qos_srpf_weight orders the deadline policy: give qos_classes under qos_policy "
                             "'deadline'")

    @property
    def deadline_aware(self) -> bool:
        """True when steps are scheduled by the QoS classes' deadlines."""
        return self.qos_classes is not None and self.qos_policy == "deadline"

    @property
    def needs_step_time_model(self) -> bool:
        """The adaptive budget (tbt_slo) and the deadline policy both size steps in seconds."""
        return self.tbt_slo is not None or self.deadline_aware


@dataclass(frozen=True, kw_only=True)
class CacheOptions:
    """The paged KV cache's layout and sharing."""

    SECTION = "KV cache"

    block_size: int = option(16, "tokens per KV block")
    enable_prefix_caching: bool = option(True, "requests share the KV blocks of prompt prefixes computed before "
                                               "(outputs are the same with it on or off)")
    watermark: float = option(0.01, "share of the KV cache kept free when admitting a request, so running "
                                    "decodes rarely need preempting right after an admission")

    def _check_cache(self) -> None:
        positive_int("block_size", self.block_size)
        boolean("enable_prefix_caching", self.enable_prefix_caching)
        fraction("watermark", self.watermark)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulingOptions, CacheOptions):
    """What a scheduler runs with (the fields' help: the sections' option texts).
    num_blocks: the KV cache's blocks. max_partial_prefills: prompts that may be partly
    prefilled at the end of a step (a pipeline keeps one per micro-batch in flight).
    A bare config's defaults are a GPU's (resolve_token_budget): the scheduler is the
    simulator's too, which models one; the engine resolves its own device's first.
    tile_size "auto" is the engine's to resolve."""

    num_blocks: int = option(4096, "KV cache blocks", flag=False)
    max_partial_prefills: int = option(1, "prompts partly prefilled at the end of a step", flag=False)

    def __post_init__(self) -> None:
        self._check_scheduling(gpu=True)
        self._check_cache()
        positive_int("num_blocks", self.num_blocks)
        positive_int("max_partial_prefills", self.max_partial_prefills)
        if self.tile_size == "auto":
            raise ValueError("tile_size 'auto' needs an engine (it is the device's GEMM tile); give an int")
        get_policy(self.policy).check_config(self)

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

"""Scheduler configuration: one frozen dataclass that rejects impossible settings."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .qos import QoSClass, check_qos_settings
from .registry import get_policy


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Settings shared by every policy.

    token_budget: most tokens in one step (tau). For the unchunked policies
        (vllm, orca, request_level) it is the largest batch, so it also bounds a prompt.
    chunk_size: largest prefill chunk per request per step (defaults to token_budget).
    max_num_seqs: most requests running at once (decodes + prefills in progress).
    block_size / num_blocks: the paged KV cache.
    tile_size: GEMM tile rows; when set, chunks cut short are trimmed so that the
        step's token count is a multiple of it.
    max_partial_prefills: prompts that may be partly prefilled at the end of a step.
    long_prefill_threshold: a prompt longer than this is "long" and its chunk is capped
        at this many tokens per step, leaving budget for the prompts behind it.
    watermark: fraction of the cache kept free when admitting new requests, so that
        running decodes rarely need preempting right after an admission.
    tbt_slo: seconds; when set, the budget adapts per step (policies that support it:
        sarathi): prefill gets the most tile-aligned tokens whose step, as the
        scheduler's step-time model predicts it, stays within tbt_slo * (1 - slo_margin),
        never more than token_budget. Needs a step-time model (create_scheduler).
    slo_margin: the share of tbt_slo held back for the step-time model's error; None
        (the default): the model's own `margin` (0 for the simulator's cost model, which
        is the step's time by construction; 0.1 for the engine's learned model).
    enable_prefix_caching: reuse the KV blocks of prompt prefixes computed before (for
        requests added with prompt_token_ids). Off here so that a bare config schedules
        exactly as without a cache; the engine turns it on.
    qos_classes: {name: QoSClass}; a request then names its class in add_request (or
        gets default_qos). qos_policy "deadline" (policies that support it: sarathi)
        schedules by the classes' deadlines, sizing steps with the step-time model;
        "fcfs" records the classes (metrics per class) but schedules exactly as without
        them: the baseline.
    qos_srpf_weight: the deadline policy's one ordering knob. Prefills go in order of
        their first-token deadline plus this many times the seconds their remaining
        prompt takes to prefill: 0 is earliest-deadline-first, larger values lean to
        shortest-remaining-first. Any finite value keeps the order starvation-free: a
        request's key is fixed, while every later arrival's key is at least its arrival
        plus the tightest class's ttft, so its turn comes within a bounded time.
    """

    policy: str = "sarathi"
    token_budget: int = 512
    chunk_size: int | None = None
    max_num_seqs: int = 128
    block_size: int = 16
    num_blocks: int = 4096
    tile_size: int | None = None
    max_partial_prefills: int = 1
    long_prefill_threshold: int | None = None
    watermark: float = 0.01
    tbt_slo: float | None = None
    slo_margin: float | None = None
    enable_prefix_caching: bool = False
    qos_classes: Mapping[str, QoSClass] | None = None
    default_qos: str | None = None
    qos_policy: str = "deadline"
    qos_srpf_weight: float = 1.0

    def __post_init__(self) -> None:
        policy_cls = get_policy(self.policy)
        if self.chunk_size is None:
            object.__setattr__(self, "chunk_size", self.token_budget)
        for name in ("token_budget", "chunk_size", "max_num_seqs", "block_size",
                     "num_blocks", "max_partial_prefills"):
            _positive(name, getattr(self, name))
        for name in ("tile_size", "long_prefill_threshold"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if self.tbt_slo is not None and not (isinstance(self.tbt_slo, (int, float)) and
                                             self.tbt_slo > 0 and math.isfinite(self.tbt_slo)):
            raise ValueError(f"tbt_slo must be a positive finite number of seconds, got {self.tbt_slo!r}")
        if self.slo_margin is not None and not 0.0 <= self.slo_margin < 1.0:
            raise ValueError(f"slo_margin must be in [0, 1), got {self.slo_margin!r}")
        if self.tbt_slo is not None and not policy_cls.adaptive:
            raise ValueError(f"tbt_slo (the adaptive token budget) is not supported by policy "
                             f"{self.policy!r}")
        if self.chunk_size > self.token_budget:
            raise ValueError(f"chunk_size ({self.chunk_size}) must not exceed "
                             f"token_budget ({self.token_budget})")
        self._check_qos(policy_cls.adaptive)
        policy_cls.check_config(self)

    def _check_qos(self, adaptive: bool) -> None:
        w = self.qos_srpf_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w >= 0 and math.isfinite(w)):
            raise ValueError(f"qos_srpf_weight must be a finite number >= 0, got {w!r}")
        object.__setattr__(self, "qos_classes", check_qos_settings(self.qos_classes, self.default_qos,
                                                                   self.qos_policy))
        if self.qos_classes is not None and self.qos_policy == "deadline" and not adaptive:
            raise ValueError(f"qos_policy 'deadline' is not supported by policy {self.policy!r} "
                             "(use qos_policy='fcfs' or policy 'sarathi')")

    @property
    def deadline_aware(self) -> bool:
        """True when steps are scheduled by the QoS classes' deadlines."""
        return self.qos_classes is not None and self.qos_policy == "deadline"

    @property
    def needs_step_time_model(self) -> bool:
        """The adaptive budget (tbt_slo) and the deadline policy both size steps in seconds."""
        return self.tbt_slo is not None or self.deadline_aware

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

"""Scheduler configuration: one frozen dataclass that rejects impossible settings."""
from __future__ import annotations

import math
from dataclasses import dataclass

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
    enable_prefix_caching: reuse the KV blocks of prompt prefixes computed before (for
        requests added with prompt_token_ids). Off here so that a bare config schedules
        exactly as without a cache; the engine turns it on.
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
    slo_margin: float = 0.1
    enable_prefix_caching: bool = False

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
        if not 0.0 <= self.slo_margin < 1.0:
            raise ValueError(f"slo_margin must be in [0, 1), got {self.slo_margin!r}")
        if self.tbt_slo is not None and not policy_cls.adaptive:
            raise ValueError(f"tbt_slo (the adaptive token budget) is not supported by policy "
                             f"{self.policy!r}")
        if self.chunk_size > self.token_budget:
            raise ValueError(f"chunk_size ({self.chunk_size}) must not exceed "
                             f"token_budget ({self.token_budget})")
        policy_cls.check_config(self)

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

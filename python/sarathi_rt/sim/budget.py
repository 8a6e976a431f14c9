"""The token budget from a TBT SLO: step time T(n) for hybrid batches of n tokens (from
a cost model here, or measured on an engine by `sarathi_rt.harness.step_timing`), then
the largest tile-aligned n whose T(n) stays within the SLO.

A representative hybrid batch of n tokens carries min(num_decodes, n) decodes, each
over context_len cached tokens, and one prefill chunk of the remaining tokens that
starts at position context_len (a middle chunk of a long prompt)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

from sarathi_rt.scheduler import BatchPlan, PlanEntry
from sarathi_rt.sim.cost import CostModel, TableCostModel, interpolate_measured
from sarathi_rt.utils.checks import positive_int
from sarathi_rt.workloads import RequestSpec


@dataclass(frozen=True)
class StepTimeCurve:
    num_tokens: tuple[int, ...]
    seconds: tuple[float, ...]  # median step time at each count
    num_decodes: int
    context_len: int
    label: str = ""

    def __post_init__(self) -> None:
        if not self.num_tokens or len(self.num_tokens) != len(self.seconds):
            raise ValueError("num_tokens and seconds must be non-empty and of equal length")
        if list(self.num_tokens) != sorted(set(self.num_tokens)) or self.num_tokens[0] <= 0:
            raise ValueError(f"num_tokens must be increasing positive ints, got {self.num_tokens!r}")

    def step_time(self, num_tokens: int) -> float:
        return interpolate_measured(self.num_tokens, self.seconds, num_tokens)

    def cost_model(self) -> TableCostModel:
        """A simulator cost model from these measurements."""
        return TableCostModel(self.num_tokens, self.seconds)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> StepTimeCurve:
        with open(path) as f:
            d = json.load(f)
        return cls(tuple(d["num_tokens"]), tuple(d["seconds"]), d["num_decodes"], d["context_len"],
                   d.get("label", ""))


def check_counts(token_counts: Sequence[int], num_decodes: int, context_len: int) -> list[int]:
    counts = sorted(set(token_counts))
    if not counts or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in counts):
        raise ValueError(f"token_counts must be positive ints, got {list(token_counts)!r}")
    if not isinstance(num_decodes, int) or num_decodes < 0:
        raise ValueError(f"num_decodes must be an int >= 0, got {num_decodes!r}")
    if not isinstance(context_len, int) or context_len < 1:
        raise ValueError(f"context_len must be an int >= 1, got {context_len!r}")
    return counts


class SyntheticRow(NamedTuple):
    """One request of a synthetic step: `num_tokens` tokens from `start_pos`; `samples`:
    the step samples a token for it (every decode; a prefill chunk only when it completes
    its prompt)."""

    start_pos: int
    num_tokens: int
    is_prefill: bool
    samples: bool


def hybrid_batch(num_tokens: int, num_decodes: int, context_len: int) -> list[SyntheticRow]:
    """The representative batch of `num_tokens` tokens: its decodes, then one middle
    chunk of a long prompt (which does not sample)."""
    d = min(num_decodes, num_tokens)
    rows = [SyntheticRow(context_len, 1, False, True)] * d
    if num_tokens > d:
        rows.append(SyntheticRow(context_len, num_tokens - d, True, False))
    return rows


def cost_model_curve(cost_model: CostModel, token_counts: Sequence[int], *, num_decodes: int = 32,
                       context_len: int = 1024, label: str = "") -> StepTimeCurve:
    """T(n) as a cost model predicts it, for the same batches measure_step_curve runs."""
    counts = check_counts(token_counts, num_decodes, context_len)
    seconds = []
    for n in counts:
        plan = BatchPlan(0)
        for i, row in enumerate(hybrid_batch(n, num_decodes, context_len)):
            plan.entries.append(PlanEntry(i, row.start_pos, row.num_tokens, row.is_prefill, row.samples))
            if row.is_prefill:
                plan.num_prefill_tokens += row.num_tokens
            else:
                plan.num_decode_tokens += row.num_tokens
        seconds.append(cost_model.step_time(plan))
    return StepTimeCurve(tuple(counts), tuple(seconds), num_decodes, context_len, label)


@dataclass(frozen=True)
class BudgetChoice:
    token_budget: int
    step_time: float  # T(token_budget)
    tbt_slo: float
    margin: float
    tile_size: int


def choose_token_budget(profile: StepTimeCurve, tbt_slo: float, tile_size: int = 128, *,
                        margin: float = 0.1) -> BudgetChoice:
    """The largest multiple of tile_size (up to the largest profiled count) such that it
    and every smaller multiple take at most tbt_slo * (1 - margin); the margin absorbs longer contexts and
    noise (sarathi_rt.measure.plots.plot_step_time draws the profile with the choice). Raises
    ValueError when not even one tile meets the SLO."""
    if not (isinstance(tbt_slo, (int, float)) and tbt_slo > 0 and math.isfinite(tbt_slo)):
        raise ValueError(f"tbt_slo must be a positive finite number of seconds, got {tbt_slo!r}")
    positive_int("tile_size", tile_size)
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    limit = tbt_slo * (1 - margin)
    best = None
    for n in range(tile_size, profile.num_tokens[-1] + 1, tile_size):
        t = profile.step_time(n)
        if t > limit:  # stop at the first miss: a noisy dip beyond it is no promise
            break
        best = BudgetChoice(n, t, tbt_slo, margin, tile_size)
    if best is None:
        raise ValueError(f"tbt_slo={tbt_slo} s is out of reach: a {tile_size}-token step takes "
                         f"{profile.step_time(tile_size):.4g} s (limit {limit:.4g} s with margin {margin})")
    return best


def loaded_curve(cost_model: CostModel, requests: Sequence[RequestSpec], num_blocks: int, block_size: int, *,
                 num_decodes: int = 32) -> StepTimeCurve:
    """T(n) as the SLO-derived static budget (the rule before the adaptive one, still an
    option) reads it: `num_decodes` decodes over the requests' mean length, or less when
    the cache cannot hold that many; `choose_token_budget` then picks from it."""
    if not requests:
        raise ValueError("requests is empty: the SLO-derived budget needs the workload's mean length")
    mean_len = sum(r.num_prompt_tokens + r.num_decode_tokens for r in requests) // len(requests)
    context = max(1, min(mean_len, num_blocks * block_size // num_decodes))
    return cost_model_curve(cost_model, list(range(32, 8193, 32)), num_decodes=num_decodes, context_len=context,
                            label="(cost model)")

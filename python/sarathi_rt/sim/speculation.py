"""Speculative decoding without a model: how often drafts are accepted, and what
speculation sized by the rule (scheduler.speculation) or by a fixed k buys a batch of
decodes on a cost model.

Acceptance: each request has a per-token acceptance rate (its trace's `acceptance`
column, else one drawn from an `AcceptanceDistribution`); a step that verifies d drafts
accepts each in turn with that probability until the first rejection, so the accepted
count is min(d, X) with X geometric: P(X >= j) = a^j. That is the model the rule's gain
a^j assumes; a proposer whose acceptances cluster (n-gram lookup in a quoted passage) is
modelled per request by its rate, not within one."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Hashable, Literal, Sequence

import numpy as np

from sarathi_rt.scheduler import get_policy
from sarathi_rt.scheduler.speculation import AcceptanceEstimate, SpecCandidate, speculation_lengths
from sarathi_rt.step_time.shape import StepTimeModel, StepShape
from sarathi_rt.utils.checks import positive_int
from sarathi_rt.workloads import RequestSpec

SIZINGS = ("none", "fixed", "rule")
Sizing = Literal["none", "fixed", "rule"]


@dataclass(frozen=True)
class AcceptanceDistribution:
    """Per-request acceptance rates: Beta-distributed with this mean and standard
    deviation across requests (spread 0: every request has the mean)."""

    mean: float
    spread: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.mean <= 1.0:
            raise ValueError(f"acceptance mean must be in [0, 1], got {self.mean!r}")
        limit = math.sqrt(self.mean * (1.0 - self.mean))  # a Beta's standard deviation is below it
        if not (self.spread == 0.0 or 0.0 < self.spread < limit):
            raise ValueError(f"acceptance spread must be 0 or in (0, {limit:.4g}) for mean {self.mean}, "
                             f"got {self.spread!r}")

    @classmethod
    def parse(cls, text: str) -> AcceptanceDistribution:
        """MEAN or MEAN,SPREAD, as the --acceptance flag gives them."""
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            values = []
        if len(values) not in (1, 2):
            raise ValueError(f"--acceptance must be MEAN or MEAN,SPREAD (rates in [0, 1]), got {text!r}")
        try:
            return cls(*values)
        except ValueError as e:
            raise ValueError(f"--acceptance {text!r}: {e}") from None

    def draw(self, rng: np.random.Generator) -> float:
        if self.spread == 0.0:
            return self.mean
        # Beta(m c, (1 - m) c) has variance m (1 - m) / (c + 1).
        c = self.mean * (1.0 - self.mean) / self.spread ** 2 - 1.0
        return float(rng.beta(self.mean * c, (1.0 - self.mean) * c))


@dataclass(frozen=True)
class SimSpeculation:
    """Speculative decoding in the simulator: `k` proposals for every decode each step
    (the scheduler picks how many to verify), a request's acceptance rate from its
    RequestSpec or else drawn from `acceptance` (None: every request must carry one);
    `seed` seeds the draws."""

    k: int
    acceptance: AcceptanceDistribution | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        positive_int("k", self.k)

    @staticmethod
    def check_policy(policy: str) -> None:
        """Speculation needs a chunking policy, as the engine's config does: draft rows
        share the token budget, and a policy that prefills whole prompts could find no
        step with room for the prompt at the head of its queue."""
        if not get_policy(policy).chunked:
            raise ValueError(f"speculative decoding needs a chunking policy (sarathi, decode_maximal); policy "
                             f"{policy!r} prefills whole prompts")

    def rng(self, stream: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream])

    def rates(self, workload: Sequence[RequestSpec]) -> dict[Hashable, float]:
        """Each request's acceptance rate: its own, else one drawn (from a stream of its
        own: the same rates whatever the steps draw)."""
        rng, out = self.rng(1), {}
        for r in workload:
            if r.acceptance is not None:
                if not 0.0 <= r.acceptance <= 1.0:
                    raise ValueError(f"request {r.request_id!r}: acceptance must be in [0, 1], got {r.acceptance!r}")
                out[r.request_id] = r.acceptance
            elif self.acceptance is None:
                raise ValueError(f"request {r.request_id!r} has no acceptance rate (its trace has no acceptance "
                                 f"column) and the speculation has no acceptance distribution (--acceptance)")
            else:
                out[r.request_id] = self.acceptance.draw(rng)
        return out


def draw_accepted(rng: np.random.Generator, rate: float, proposed: int) -> int:
    """Drafts accepted of `proposed`, each with probability `rate` until the first rejection."""
    if proposed == 0 or rate <= 0.0:
        return 0
    if rate >= 1.0:
        return proposed
    return min(proposed, int(rng.geometric(1.0 - rate)) - 1)


@dataclass(frozen=True)
class DecodeRun:
    """A batch of decodes run for a number of steps: output tokens per second, the
    step times (each a gap between a request's tokens: a TBT sample) and the draft
    tokens verified per step."""

    tokens_per_s: float
    step_p99: float
    drafts_per_step: float


def run_decodes(model: StepTimeModel, num_decodes: int, acceptance: float, *, k: int, sizing: Sizing,
                context: int = 1024, budget: int = 4096, time_target: float | None = None,
                steps: int = 200, seed: int = 0) -> DecodeRun:
    """`num_decodes` decodes over `context` cached tokens each (held there: the steady
    state of long requests), every request with per-token acceptance `acceptance` and a
    proposer that always has `k` drafts, for `steps` steps of `model`'s time. sizing:
    "none" (no speculation), "fixed" (every decode verifies k, as far as the budget
    goes) or "rule" (speculation_lengths with each request's AcceptanceEstimate, the
    step-time model `model` and `time_target`)."""
    positive_int("num_decodes", num_decodes)
    positive_int("k", k)
    positive_int("steps", steps)
    if sizing not in SIZINGS:
        raise ValueError(f"sizing must be one of {SIZINGS}, got {sizing!r}")
    rng = np.random.default_rng(seed)
    estimates = [AcceptanceEstimate() for _ in range(num_decodes)]
    contexts = [context] * num_decodes
    base = StepShape.decodes(contexts, [0] * num_decodes)
    room = max(0, budget - num_decodes)
    tokens, elapsed, verified = 0, 0.0, 0
    times: list[float] = []
    for _ in range(steps):
        if sizing == "rule":
            drafts = speculation_lengths(
                [SpecCandidate(k, e.rate()) for e in estimates], room,
                step_time=lambda extra: model.predict_shape(base.with_drafts(extra, context)),
                time_target=time_target)
        elif sizing == "fixed":
            drafts = [min(k, max(0, room - k * i)) for i in range(num_decodes)]
        else:
            drafts = [0] * num_decodes
        seconds = model.predict_shape(StepShape.decodes(contexts, drafts))
        for e, d in zip(estimates, drafts):
            accepted = draw_accepted(rng, acceptance, d)
            if d:
                e.record(d, accepted)
            tokens += 1 + accepted
        verified += sum(drafts)
        elapsed += seconds
        times.append(seconds)
    p99 = statistics.quantiles(times, n=100, method="inclusive")[98] if len(times) > 1 else times[0]
    return DecodeRun(tokens / elapsed, p99, verified / steps)

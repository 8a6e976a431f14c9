"""How many draft tokens each decode verifies this step: speculation sized by the token
budget, the TBT target and the prefill waiting, from each request's acceptance estimate.

**Acceptance estimate.** Per request, a Beta-prior estimate of the chance that its next
draft token is accepted: (prior_rate * prior_weight + accepted) / (prior_weight +
accepted + rejected). A Beta prior rather than an EWMA because the evidence comes in
tokens, not steps: a step that verified 4 drafts says more than one that verified 1, and
the Beta counts weigh them so, while an EWMA over steps would need a per-step rate and
an arbitrary first value. The prior gives a new request a usable middle estimate and lets
its first few steps move it quickly. Verification stops at the first rejected draft, so a
step of d drafts with m accepted shows m acceptances and, when m < d, one rejection; the
drafts after that rejection were never judged and count for nothing (counting them as
rejections would bias the rate down by a factor of about k). Counts decay once they pass
`memory` tokens, so a request whose text changes character (a quoted passage ends)
re-learns within a few dozen tokens.

**Gain.** With per-token acceptance a, the j-th draft of a decode yields an output token
only if drafts 1..j are all accepted: expected gain a^j tokens, each a step the request
no longer needs. Gains fall with j, so allotting draft tokens in decreasing order of gain
(ties: every decode's j-th draft before anyone's (j+1)-th) maximises the expected tokens
for any number n of draft tokens; the rule then picks n, the largest count whose last
(smallest-gain) token still passes every bar below.

**Bars, in one unit: request-steps** (a step of one request's latency). The n-th draft
token is allotted while

1. it fits the budget: n <= budget_left, and n <= the drafts proposed;
2. the step stays within the TBT target: step_time(n) <= time_target (when both given);
3. its gain beats its cost. The cost is the sum of
   - **time**: the drafts add (step_time(n) - step_time(0)) / n seconds each (the mean,
     robust to a measured model's tile staircase) to a step that every running request
     waits on, the decodes and (when any is waiting) a prefill: that delay, as a share of
     the step, times those requests; with many decodes this alone fades speculation out;
   - **the prefill it displaces**: the budget room the waiting prefill cannot use
     (budget_left - prefill_waiting) is free; a draft beyond it takes a prompt token
     from this step. The prefill gets budget_left tokens a step at most, so the token
     delays the end of the backlog by 1 / budget_left steps, and every waiting prompt
     waits that much longer. The backlog holds about prefill_waiting / budget_left
     prompts (a prompt a step's worth of tokens: the rule does not see them one by one),
     so a displaced token costs prefill_waiting / budget_left**2 request-steps. A short
     backlog costs speculation little (its prompt still finishes within a step or two);
     one of many steps' worth, the regime where the prefill sets the throughput, costs
     more, so speculation yields to the prefill as the queue grows, capped at 1 (a
     prompt token is certain work a draft can never beat);
   - and at least MIN_GAIN: a draft that is almost surely rejected is work wasted
     even when the model sees no cost (no step-time model, an idle device).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

# The least expected gain (tokens) a draft token must bring: below it verification is
# work spent for nothing measurable, whatever the step-time model says it costs.
MIN_GAIN = 0.1


@dataclass
class AcceptanceEstimate:
    """A request's running estimate of the chance that its next proposed token is accepted.

    prior_rate / prior_weight: the Beta prior's mean and weight in tokens;
    memory: the evidence, in judged tokens, past which older counts decay."""

    prior_rate: float = 0.5
    prior_weight: float = 2.0
    memory: float = 64.0
    accepted: float = 0.0
    rejected: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior_rate <= 1.0:
            raise ValueError(f"prior_rate must be in [0, 1], got {self.prior_rate!r}")
        if not self.prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight!r}")
        if not self.memory >= 1:
            raise ValueError(f"memory must be >= 1, got {self.memory!r}")

    def rate(self) -> float:
        return ((self.prior_rate * self.prior_weight + self.accepted)
                / (self.prior_weight + self.accepted + self.rejected))

    def record(self, proposed: int, accepted: int) -> None:
        """A step verified `proposed` drafts of this request and accepted the first `accepted`."""
        if not isinstance(proposed, int) or proposed < 0:
            raise ValueError(f"proposed must be an int >= 0, got {proposed!r}")
        if not isinstance(accepted, int) or not 0 <= accepted <= proposed:
            raise ValueError(f"accepted must be an int in [0, proposed={proposed}], got {accepted!r}")
        self.accepted += accepted
        self.rejected += accepted < proposed
        seen = self.accepted + self.rejected
        if seen > self.memory:
            shrink = self.memory / seen
            self.accepted *= shrink
            self.rejected *= shrink


@dataclass(frozen=True)
class SpecCandidate:
    available: int      # proposals the proposer has for this decode now (0..k)
    acceptance: float   # its AcceptanceEstimate.rate()

    def __post_init__(self) -> None:
        if not isinstance(self.available, int) or self.available < 0:
            raise ValueError(f"available must be an int >= 0, got {self.available!r}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {self.acceptance!r}")


def speculation_lengths(candidates: Sequence[SpecCandidate], budget_left: int, *,
                        step_time: Callable[[int], float] | None = None,
                        time_target: float | None = None,
                        prefill_waiting: int = 0) -> list[int]:
    """Draft tokens each candidate verifies this step (0..available each, sum <= budget_left).
    budget_left: the step's token budget after every decode's own token;
    step_time(extra): predicted seconds of the step with `extra` verification tokens added
    (None: no step-time model); time_target: the TBT target the step must stay within;
    prefill_waiting: prompt tokens waiting or mid-prefill that could use the budget.
    The time cost counts one waiting request per candidate (plus one for a waiting
    prefill), so every decode of the step belongs in `candidates`, one without
    proposals with available 0."""
    if not isinstance(budget_left, int):
        raise ValueError(f"budget_left must be an int, got {budget_left!r}")
    if not isinstance(prefill_waiting, int) or prefill_waiting < 0:
        raise ValueError(f"prefill_waiting must be an int >= 0, got {prefill_waiting!r}")
    if time_target is not None and not time_target > 0:
        raise ValueError(f"time_target must be > 0 seconds, got {time_target!r}")
    lengths = [0] * len(candidates)
    # (gain, j, i) of every proposed draft, best first; a^j is 0 for a = 0, kept out early.
    drafts = sorted(((c.acceptance ** j, j, i) for i, c in enumerate(candidates)
                     for j in range(1, c.available + 1) if c.acceptance ** j >= MIN_GAIN),
                    key=lambda d: (-d[0], d[1], d[2]))
    cap = min(max(budget_left, 0), len(drafts))
    if cap == 0:
        return lengths
    price = _DraftPrice(len(candidates), budget_left, step_time, time_target, prefill_waiting)

    def passes(n: int) -> bool:
        """Does the n-th draft (the smallest gain of the first n) pass every bar?"""
        return drafts[n - 1][0] >= price(n)

    # Gains fall with n and, for a step time convex in its tokens, costs grow: the n that
    # pass form a prefix, found by binary search. A measured step time is a staircase
    # (tiles), not convex: hence the time a draft adds is priced as the drafts' mean
    # (not the last one's, which is a whole tile at a step's edge and nothing inside
    # it), and the search still ends on an n that passes, within the target.
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if passes(mid):
            lo = mid
        else:
            hi = mid - 1
    for _, _, i in drafts[:lo]:
        lengths[i] += 1
    return lengths


def draft_floor(num_decodes: int, budget_left: int, *, step_time: Callable[[int], float] | None = None,
                time_target: float | None = None, prefill_waiting: int = 0) -> float:
    """The least acceptance estimate a decode must have for `speculation_lengths`, given
    a step of `num_decodes` decodes and the same arguments, to allot it any draft; inf
    when no decode can get one. Cheap (one or two step-time forecasts), so the engine
    asks the proposer only for the decodes at or above it.

    Why it is a floor: a decode of acceptance a brings at most a per draft, and a draft
    is allotted only as part of the first n whose n-th, gaining no more than a, passes
    the price of n drafts. The displaced-prefill term only grows with n, and so does the
    time term (the mean time a draft adds) when the step time is convex in its draft
    rows: then no n prices below n = 1. The engine's online model is convex so (a
    non-negative linear fit of features linear or convex in the draft count), except
    where a forecast first passes the largest step it has seen and jumps to that step
    scaled up: there the floor can withhold drafts the rule would allot, which costs
    speed, never an output token. A staircase model (a measured tile profile) is not
    convex; the simulator, which uses those, proposes for every decode."""
    if budget_left < 1:
        return math.inf
    return _DraftPrice(num_decodes, budget_left, step_time, time_target, prefill_waiting)(1)


class _DraftPrice:
    """What the n-th draft of a step must gain, in request-steps, to be allotted (the
    bars of the module docstring; inf when n drafts break the TBT target)."""

    __slots__ = ("step_time", "time_target", "base", "waiters", "free_room", "displaced")

    def __init__(self, num_decodes: int, budget_left: int, step_time: Callable[[int], float] | None,
                 time_target: float | None, prefill_waiting: int) -> None:
        self.step_time, self.time_target = step_time, time_target
        self.base = step_time(0) if step_time is not None else 0.0
        self.waiters = num_decodes + (prefill_waiting > 0)
        self.free_room = budget_left - prefill_waiting
        self.displaced = min(1.0, prefill_waiting / budget_left ** 2)

    def __call__(self, n: int) -> float:
        cost = self.displaced if n > self.free_room else 0.0
        if self.step_time is not None:
            t = self.step_time(n)
            if self.time_target is not None and max(t, self.base) > self.time_target:
                return math.inf
            if self.base > 0:
                cost += self.waiters * max(t - self.base, 0.0) / (n * self.base)
        return max(cost, MIN_GAIN)


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Expected output tokens of a decode verifying `drafts` draft tokens at per-token
    acceptance `acceptance`: the target's own token plus a + a^2 + ... + a^drafts."""
    if acceptance >= 1.0:
        return 1.0 + drafts
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


__all__ = ["AcceptanceEstimate", "MIN_GAIN", "SpecCandidate", "draft_floor", "expected_tokens",
           "speculation_lengths"]

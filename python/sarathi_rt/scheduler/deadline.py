"""The deadline policy's per-step decisions (qos_policy "deadline"): the step's time
limit from the running decodes' deadlines, the order of the pending prefills, and which
requests can no longer make their first-token deadline (relegation)."""
from __future__ import annotations

import math
from collections.abc import Iterable

from .request import Request
from sarathi_rt.step_time.shape import StepShape, StepTimeModel


class DeadlineOrder:
    """Built once per step, at `now`, after the decodes are in the plan.

    `seconds_per_token`: what one prefill token costs when a full step (token_budget
    tokens, the decodes among them) runs: an optimistic rate, so a request is relegated
    only when even the best case misses its deadline. 0 while the model cannot price a
    step (an online model before its first step): the order is then earliest deadline
    first and nobody is relegated on no evidence."""

    __slots__ = ("now", "weight", "seconds_per_token")

    def __init__(self, model: StepTimeModel, now: float, weight: float, token_budget: int,
                 num_decodes: int, decode_kv: int) -> None:
        self.now, self.weight = now, weight
        prefill = max(1, token_budget - num_decodes)
        step = model.predict_shape(StepShape.hybrid(prefill, 0, num_decodes, decode_kv))
        self.seconds_per_token = step / prefill if math.isfinite(step) else 0.0

    def key(self, req: Request) -> tuple[float, int]:
        """The next token's deadline plus `weight` times the remaining prefill's seconds
        (EDF at 0, leaning to shortest-remaining-first as it grows); then arrival.

        A relegated request waiting for its first token ranks by a fresh deadline: its
        class's ttft from when it was relegated. Its own deadline has passed, so ranking by
        it would put it first and make every request behind it late too; ranking it after
        every other request would invert the tiers (a priority request that the machine is
        too slow to serve in 1 s would wait behind all of the flex tier's work). With a
        fresh deadline it competes as its class does, and its key is still fixed (no
        starvation)."""
        left = req.prefill_target - req.num_computed
        due = req.relegated_at + req.qos_class.ttft if req.relegated and req.num_generated == 0 \
            else req.next_deadline()  # type: ignore[union-attr]
        return (due + self.weight * left * self.seconds_per_token, req.arrival)

    def relegate(self, ordered: Iterable[Request]) -> list[Request]:
        """Walk `ordered` (by key) and relegate each request still waiting for its
        first token that cannot get it in time even if the prefill work ranked ahead
        of it and its own ran back to back from now at the full-step rate. It is then
        ranked by a fresh deadline (`key`), not by the one it missed, which is what stops
        one late request from making every later one late too. A request of a higher priority class is saved, when
        it can be, by relegating instead lower-priority requests ranked ahead of it
        that are still waiting for their first token (the latest-ranked first): when
        not everyone can make it, the tight classes do. Returns the newly relegated."""
        kept: list[tuple[Request, int]] = []  # not relegated, in order, with their prefill left
        ahead, out = 0, []
        for req in ordered:
            left = req.prefill_target - req.num_computed
            if req.relegated:  # it runs in its place in the order, never relegated again
                ahead += left
                continue
            if req.num_generated == 0 and not self._in_time(req, ahead + left):
                displaced, freed = self._displace(req, kept, ahead + left)
                if not displaced:
                    req.relegated, req.relegated_at = True, self.now
                    out.append(req)
                    continue
                for victim in displaced:
                    victim.relegated, victim.relegated_at = True, self.now
                kept = [(r, n) for r, n in kept if not r.relegated]
                ahead -= freed
                out += displaced
            kept.append((req, left))
            ahead += left
        return out

    def _in_time(self, req: Request, tokens: int) -> bool:
        return self.now + tokens * self.seconds_per_token <= req.next_deadline()

    def _displace(self, req: Request, kept: list[tuple[Request, int]], tokens: int) -> tuple[list[Request], int]:
        """Lower-priority requests of `kept` whose relegation would let `req` make its
        first token in time ([] if none would), and their prefill tokens."""
        priority = req.qos_class.priority  # type: ignore[union-attr]
        victims, freed = [], 0
        for r, n in reversed(kept):
            if r.num_generated == 0 and r.qos_class.priority < priority:  # type: ignore[union-attr]
                victims.append(r)
                freed += n
                if self._in_time(req, tokens - freed):
                    return victims, freed
        return [], 0


def two_step_bound(model: StepTimeModel, token_budget: int, running: Iterable[Request]) -> float:
    """Predicted seconds that bound this step and the next, for deciding whether a
    decode may step aside: the largest step the policy can build in either, token_budget
    tokens (the most a step holds), every running request among them decoding (only
    those can decode next step) over their KV grown by two full steps' tokens, the rest
    one prefill chunk from the deepest running prefill's context grown as much. A bound
    under models whose time grows with the tokens and the KV read; inf while the model
    cannot price a step (nobody steps aside on no evidence)."""
    num = kv = deepest = 0
    for req in running:
        num += 1
        kv += req.num_computed + 1
        if req.is_prefill:
            deepest = max(deepest, req.num_computed)
    grow = 2 * token_budget
    step = model.predict_shape(StepShape.hybrid(max(0, token_budget - num), deepest + grow, num, kv + grow))
    return step if math.isfinite(step) else math.inf


def may_step_aside(req: Request, now: float, bound: float) -> bool:
    """A running decode may be left out of the step starting at `now` only while its
    next token's cumulative deadline is at least two steps of `bound` seconds away: it
    then still makes it in the next step, and it steps aside again only under the same
    test, so leaving it out never makes it late while steps take at most `bound`."""
    return req.qos_class is not None and not req.relegated and now + 2 * bound <= req.next_deadline()


def step_limit(decodes: Iterable[Request], now: float) -> float:
    """Seconds the step may take so that every decode in it that is not relegated gets
    its next token by its cumulative deadline: the tightest of (deadline - now). A decode
    already behind gets its class's tbt instead (it can only keep pace now; a limit
    below one decode step would starve every prefill). inf without such decodes."""
    limit = math.inf
    for req in decodes:
        if req.qos_class is not None and not req.relegated:
            limit = min(limit, max(req.next_deadline() - now, req.qos_class.tbt))
    return limit

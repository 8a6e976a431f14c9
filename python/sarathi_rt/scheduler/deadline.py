"""The deadline policy's per-step decisions (qos_policy "deadline"): the order of the
pending prefills, which requests can no longer make their first-token deadline
(relegation), which slack decodes step aside for a tighter prompt, and which idle
requests are preempted to make room for one (the step's time limit from the running
decodes' deadlines is the adaptive budget's: adaptive.step_limit)."""
from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable

from .adaptive import AdaptiveBudget
from .base import Scheduler
from .batch_plan import StepBuilder
from .request import Request, RequestStatus
from sarathi_rt.step_time import StepShape, StepTimeModel, adaptive_prefill_tokens


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



class DeadlinePlanner:
    """The deadline half of the sarathi policy under qos_policy "deadline": it reads and
    rearranges the state of the scheduler that owns it (its queue, running requests and
    clock) and builds the step's prefill part through the scheduler's own mechanics.
    `budget` sizes the step; `cap(req)`: the most tokens `req` may take this step."""

    def __init__(self, sched: Scheduler, budget: AdaptiveBudget, cap: Callable[[Request], int]) -> None:
        self._sched, self._budget, self._cap = sched, budget, cap

    def order(self, b: StepBuilder, prefills: list[Request]) -> list[Request]:
        """Relegate the requests that can no longer make their first token; returns the
        prefills in progress and the waiting requests in one list sorted by
        DeadlineOrder.key, and sorts `prefills` and the waiting queue the same way."""
        s, plan = self._sched, b.plan
        # The best case relegation weighs: the decodes that could step aside (step_aside) do.
        bound = two_step_bound(s.step_time_model, s.config.token_budget,  # type: ignore[arg-type]
                               s._running.values()) if not s._pending else math.inf
        fixed = [e for e, r in zip(plan.entries, b.reqs) if not may_step_aside(r, s._now, bound)]
        order = DeadlineOrder(s.step_time_model, s._now, s.config.qos_srpf_weight,  # type: ignore[arg-type]
                              s.config.token_budget, len(fixed), sum(e.start_pos + 1 for e in fixed))
        pending = sorted(itertools.chain(prefills, s._waiting), key=order.key)
        plan.relegated.extend(r.request_id for r in order.relegate(pending))
        pending.sort(key=order.key)  # the newly relegated move to their fresh deadlines
        prefills[:] = [r for r in pending if r.status is RequestStatus.RUNNING]
        s._waiting = deque(r for r in pending if r.status is RequestStatus.WAITING)
        return pending

    def make_room(self, b: StepBuilder) -> None:
        """When the cache cannot hold the next chunk of the request waiting for its
        first token with the earliest deadline (not relegated; in progress or queued)
        beside the blocks kept for the decodes,
        preempt idle running requests of lower priority (or relegated) whose next
        deadline leaves time to recompute them, until it can: when memory binds, the
        tight classes keep their blocks and get new ones."""
        s = self._sched
        pending = itertools.chain((r for r in s._running.values() if not r.in_flight and r.is_prefill),
                                  s._waiting)
        head = min((r for r in pending if not r.relegated and r.num_generated == 0),
                   key=lambda r: r.next_deadline(), default=None)
        if head is None:
            return
        target = head.num_computed + min(self._cap(head), head.prefill_target - head.num_computed)
        # What the prefill chunk will keep free beside it: the decodes' next blocks.
        need = -(-target // s.config.block_size) - len(head.blocks) + \
            self._budget.decode_need(self._budget.decodes())
        if head.status is RequestStatus.WAITING:
            need += s._admit_keep_free()
        if s.num_free_blocks >= need:
            return
        rate = DeadlineOrder(s.step_time_model, s._now, 0.0, s.config.token_budget,  # type: ignore[arg-type]
                             0, 0).seconds_per_token
        priority = head.qos_class.priority  # type: ignore[union-attr]
        victims = [r for r in s._running.values() if not r.in_flight and
                   (r.relegated or r.qos_class.priority < priority) and  # type: ignore[union-attr]
                   r.next_deadline() - s._now > (r.num_prompt_tokens + r.num_generated) * rate]
        while victims and s.num_free_blocks < need:
            victim = min(victims, key=lambda r: (not r.relegated, r.qos_class.priority,  # type: ignore[union-attr]
                                                 -r.next_deadline()))
            victims.remove(victim)
            s._preempt(victim, b)
            s._waiting.append(s._waiting.popleft())  # behind the request it made room for
            b.made_room = True

    def fill(self, b: StepBuilder, pending: list[Request], keep: int) -> None:
        """Prefills in progress and newcomers in one order (`pending`, from `order`):
        the waiting queue is in the same order, so each newcomer met is the queue's
        head. `keep`: blocks to leave free for the decodes."""
        s = self._sched
        cfg = s.config
        # In-flight partial prompts rank ahead of everything (conservatively: they may
        # complete in flight).
        ahead = sum(1 for r in s._running.values() if r.in_flight and r.num_computed < r.prefill_target)
        admitting = b.admission_open
        for req in pending:
            if b.budget_left <= 0:
                return
            if req.status is RequestStatus.RUNNING:
                n = s._prefill_chunk(b, req, self._cap(req), keep)
                if n > 0:
                    s._run_prefill(b, req, n)
                ahead += n < req.prefill_target - req.num_computed  # still partial after this step
                continue
            if not admitting or len(s._running) >= cfg.max_num_seqs or s._waiting[0] is not req:
                admitting = False
                continue
            head = s._waiting_head()
            n = s._prefill_chunk(b, head, self._cap(head), max(keep, s._admit_keep_free()))
            partial = n < head.prefill_left
            if n <= 0 or (partial and ahead >= cfg.max_partial_prefills):
                admitting = False
                continue
            s._admit(b, n)
            ahead += partial

    def step_aside(self, b: StepBuilder, pending: list[Request]) -> None:
        """Leave slack decodes out of this step when a tighter prompt needs the time.

        The rule: with no plan in flight (so `now` is when this step starts), take the
        best-ranked request still waiting for its first token (`pending` order, not
        relegated) that can run this step. At the largest step that fits the step limit
        with the decodes in, the prefill ranked ahead of it and its own (run back to back
        at that rate) miss its deadline; leaving out running decodes whose next deadline
        is later than its first-token deadline and that may_step_aside (two bounding
        steps of slack, two_step_bound) makes it: then the fewest of them that
        do (the latest-due first, in groups of 1, 2, 4, ...) are left out and the step
        takes the larger chunk. A decode left out runs in the next step unless the same
        test holds again then, so under the predicted step times it is never late for
        it, and it is never starved; no decode steps aside when it would not save the
        prompt (relegation deals with those). When the step was sized below a chunk that
        already makes the deadline with every decode in, it takes that chunk instead."""
        s = self._sched
        head, ahead = None, 0
        for r in pending:
            if not r.relegated and r.num_generated == 0:
                head = r
                break
            ahead += r.prefill_target - r.num_computed
        cfg = s.config
        if head is None or s._pending or (head.status is RequestStatus.WAITING and (
                not b.admission_open or len(s._running) >= cfg.max_num_seqs)):
            return
        plan, model, now = b.plan, s.step_time_model, s._now
        due, tokens = head.next_deadline(), ahead + head.prefill_target - head.num_computed
        context = next((r.num_computed for r in pending if r.status is RequestStatus.RUNNING), 0)
        decode_kv = plan.num_decode_tokens + sum(e.start_pos for e in plan.entries)

        def chunk(out: set) -> int:
            """The largest chunk within the limit with the decodes `out` left out, if at
            that rate the prefill up to the head's makes its deadline; else 0."""
            kept = [r for r in b.reqs if r.request_id not in out]
            kv = decode_kv - sum(e.start_pos + 1 for e in plan.entries if e.request_id in out)
            n = adaptive_prefill_tokens(model, self._budget.step_seconds(kept), len(kept), kv,  # type: ignore[arg-type]
                                        context, cfg.token_budget, cfg.tile_size or 1, tokens)
            step = model.predict_shape(StepShape.hybrid(n, context, len(kept), kv))  # type: ignore[union-attr]
            return n if n > 0 and now + -(-tokens // n) * step <= due else 0

        have = b.budget - plan.num_decode_tokens
        if have > 0 and now + -(-tokens // have) * model.predict_shape(  # type: ignore[union-attr]
                StepShape.hybrid(have, context, plan.num_decode_tokens, decode_kv)) <= due:
            return  # it makes its deadline at the chunk the step was sized to
        kept_all = chunk(set())
        if kept_all:  # it makes its deadline at a larger chunk with every decode in: take that one
            self._budget.take_chunk(b, kept_all, have)
            return
        bound = two_step_bound(model, cfg.token_budget, s._running.values())  # type: ignore[arg-type]
        slack = sorted((r for r in b.reqs if r.next_deadline() > due and may_step_aside(r, now, bound)),
                       key=lambda r: -r.next_deadline())
        k = 1
        while slack:
            k = min(k, len(slack))
            out = {r.request_id for r in slack[:k]}
            n = chunk(out)
            if n:
                self._leave_out(b, out)
                self._budget.take_chunk(b, n, have)
                return
            if k == len(slack):
                return
            k *= 2

    @staticmethod
    def _leave_out(b: StepBuilder, ids: set) -> None:
        """Take the decodes `ids` back out of the plan: they run in a later step."""
        plan = b.plan
        kept = [(e, r) for e, r in zip(plan.entries, b.reqs) if e.request_id not in ids]
        for req in b.reqs:
            if req.request_id in ids:
                req.in_flight = False
        plan.num_decode_tokens -= len(b.reqs) - len(kept)
        plan.entries[:] = [e for e, _ in kept]
        b.reqs[:] = [r for _, r in kept]

"""Sarathi-Serve stall-free batching (Algorithm 3) with fairness limits."""
from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Any, Hashable

from ..base import Scheduler, StepBuilder
from ..deadline import DeadlineOrder, may_step_aside, step_limit, two_step_bound
from ..request import Request, RequestStatus
from ..registry import register_policy
from sarathi_rt.step_time import StepShape, adaptive_prefill_tokens, fastest_chunk_alone

# Prefill tokens a step takes, when no tile size is set, if the step limit leaves prefill
# nothing although its decodes alone already break it (or it has none): the prompts
# must move (see _size_budget; with a tile size, prefill fills the step's last tile).
MIN_PREFILL_PROGRESS = 128

# The most steps ahead the adaptive budget reserves the decodes' blocks for. The steps
# until the next decode finishes come from max_new_tokens, an upper bound (EOS and stop
# strings end requests sooner; a server request without max_tokens may get the whole
# model length), so an uncapped horizon would hold blocks back for growth that mostly
# never comes. A horizon of a few blocks' worth of steps keeps the reservation honest
# without that (bench/RESULTS.md, adaptive budget, compares the caps).
MAX_DECODE_HEADROOM_STEPS = 64


@register_policy
class SarathiScheduler(Scheduler):
    """Every running decode, then the prefills in progress (FCFS), then new requests
    (FCFS) until the token budget is spent. A prompt longer than
    long_prefill_threshold takes at most that many tokens per step, and up to
    max_partial_prefills prompts may be left half-done at the end of a step, so a
    prompt queued behind a huge one starts within a step or two instead of waiting
    for the whole huge prefill. Admission stays strictly FCFS.

    With config.tbt_slo (adaptive budget) the step's budget is sized after the decodes
    are in: the decodes plus the most tile-aligned prefill tokens whose predicted step
    time meets the SLO less the margin, capped by token_budget (of those, the chunk that
    prefills fastest on its own while the decodes set how many steps there are, else
    the step that prefills the most tokens per second); prefill leaves free the blocks
    the decodes will need before the next of them finishes, and while the cache cannot
    hold every live request to its end, prefill is paced to the rate the pending
    prompts arrived at.

    With QoS classes and qos_policy "deadline" the decodes still come first, all of
    them but the slack ones that step aside for a tighter prompt (_step_aside); the
    step's time limit is the tightest of the running decodes' next-token
    deadlines (and tbt_slo, if set), sized as above; the prefills in progress and the
    waiting requests go in one order, by deadline.DeadlineOrder (a relegated request
    by a fresh deadline of its class from when it was relegated); a newcomer may be left partial while fewer than max_partial_prefills partial
    prompts rank ahead of it (those behind it wait, holding their blocks)."""

    name = "sarathi"
    adaptive = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (step, prompt tokens) of the requests that arrived in the last
        # MAX_DECODE_HEADROOM_STEPS steps: the recent arrival rate (_paced_chunk).
        self._recent: deque[tuple[int, int]] = deque()
        self._chunk_limit: int | None = None  # this step's per-prompt cap while the cache binds

    def add_request(self, request_id: Hashable, num_prompt_tokens: int, max_new_tokens: int,
                    **kwargs: Any) -> None:
        super().add_request(request_id, num_prompt_tokens, max_new_tokens, **kwargs)
        if self.config.needs_step_time_model:
            self._recent.append((self._step, num_prompt_tokens))

    def _cap(self, req: Request) -> int:
        threshold = self.config.long_prefill_threshold
        cap = self.config.chunk_size
        if threshold is not None and req.prefill_target > threshold:
            cap = min(cap, threshold)
        return cap if self._chunk_limit is None else min(cap, self._chunk_limit)

    def _build(self, b: StepBuilder) -> None:
        self._chunk_limit = None
        if self.config.deadline_aware:
            self._make_room(b)
        decodes, prefills = self._split_running()
        self._schedule_decodes(b, decodes)
        cfg = self.config
        pending = self._deadline_order(b, prefills) if cfg.deadline_aware else None
        keep = 0
        if cfg.needs_step_time_model:
            past_prompt = self._decodes()  # in flight or not
            self._size_budget(b, prefills, past_prompt)
            # Blocks kept free for the decodes' next steps (see _decode_need).
            keep = self._decode_need(past_prompt)
        if pending is not None:
            self._step_aside(b, pending)
            self._fill_by_deadline(b, pending, keep)
            return
        # Prompts that will still be partial after this step (in-flight ones counted
        # as partial, conservatively); a newcomer may only add to these within limits.
        num_partial = sum(1 for r in self._running.values()
                          if r.num_computed < r.prefill_target)
        for req in prefills:
            if req.status is not RequestStatus.RUNNING or b.budget_left <= 0:
                continue
            n = self._prefill_chunk(b, req, self._cap(req), keep)
            if n > 0:
                if n == req.prefill_target - req.num_computed:
                    num_partial -= 1
                self._run_prefill(b, req, n)
        while b.admission_open and self._waiting and b.budget_left > 0 and \
                len(self._running) < cfg.max_num_seqs:
            req = self._waiting_head()
            n = self._prefill_chunk(b, req, self._cap(req), max(keep, self._admit_keep_free()))
            if n <= 0:
                return
            if n < req.prefill_left:
                if num_partial >= cfg.max_partial_prefills:
                    return
                num_partial += 1
            self._admit(b, n)

    def _deadline_order(self, b: StepBuilder, prefills: list[Request]) -> list[Request]:
        """Relegate the requests that can no longer make their first token; returns the
        prefills in progress and the waiting requests in one list sorted by
        DeadlineOrder.key, and sorts `prefills` and the waiting queue the same way."""
        plan = b.plan
        # The best case relegation weighs: the decodes that could step aside (_step_aside) do.
        bound = two_step_bound(self.step_time_model, self.config.token_budget,  # type: ignore[arg-type]
                               self._running.values()) if not self._pending else math.inf
        fixed = [e for e, r in zip(plan.entries, b.reqs) if not may_step_aside(r, self._now, bound)]
        order = DeadlineOrder(self.step_time_model, self._now, self.config.qos_srpf_weight,  # type: ignore[arg-type]
                              self.config.token_budget, len(fixed), sum(e.start_pos + 1 for e in fixed))
        pending = sorted(itertools.chain(prefills, self._waiting), key=order.key)
        plan.relegated.extend(r.request_id for r in order.relegate(pending))
        pending.sort(key=order.key)  # the newly relegated move to their fresh deadlines
        prefills[:] = [r for r in pending if r.status is RequestStatus.RUNNING]
        self._waiting = deque(r for r in pending if r.status is RequestStatus.WAITING)
        return pending

    def _make_room(self, b: StepBuilder) -> None:
        """When the cache cannot hold the next chunk of the request waiting for its
        first token with the earliest deadline (not relegated; in progress or queued)
        beside the blocks kept for the decodes,
        preempt idle running requests of lower priority (or relegated) whose next
        deadline leaves time to recompute them, until it can: when memory binds, the
        tight classes keep their blocks and get new ones."""
        pending = itertools.chain((r for r in self._running.values() if not r.in_flight and r.is_prefill),
                                  self._waiting)
        head = min((r for r in pending if not r.relegated and r.num_generated == 0),
                   key=lambda r: r.next_deadline(), default=None)
        if head is None:
            return
        target = head.num_computed + min(self._cap(head), head.prefill_target - head.num_computed)
        # What _prefill_chunk will keep free beside the chunk: the decodes' next blocks.
        need = -(-target // self.config.block_size) - len(head.blocks) + self._decode_need(self._decodes())
        if head.status is RequestStatus.WAITING:
            need += self._admit_keep_free()
        if self._blocks.num_free >= need:
            return
        rate = DeadlineOrder(self.step_time_model, self._now, 0.0, self.config.token_budget,  # type: ignore[arg-type]
                             0, 0).seconds_per_token
        priority = head.qos_class.priority  # type: ignore[union-attr]
        victims = [r for r in self._running.values() if not r.in_flight and
                   (r.relegated or r.qos_class.priority < priority) and  # type: ignore[union-attr]
                   r.next_deadline() - self._now > (r.num_prompt_tokens + r.num_generated) * rate]
        while victims and self._blocks.num_free < need:
            victim = min(victims, key=lambda r: (not r.relegated, r.qos_class.priority,  # type: ignore[union-attr]
                                                 -r.next_deadline()))
            victims.remove(victim)
            self._preempt(victim, b)
            self._waiting.append(self._waiting.popleft())  # behind the request it made room for
            b.made_room = True

    def _fill_by_deadline(self, b: StepBuilder, pending: list[Request], keep: int) -> None:
        """Prefills in progress and newcomers in one order (`pending`, from
        _deadline_order): the waiting queue is in the same order, so each newcomer met
        is the queue's head."""
        cfg = self.config
        # In-flight partial prompts rank ahead of everything (conservatively, as above).
        ahead = sum(1 for r in self._running.values() if r.in_flight and r.num_computed < r.prefill_target)
        admitting = b.admission_open
        for req in pending:
            if b.budget_left <= 0:
                return
            if req.status is RequestStatus.RUNNING:
                n = self._prefill_chunk(b, req, self._cap(req), keep)
                if n > 0:
                    self._run_prefill(b, req, n)
                ahead += n < req.prefill_target - req.num_computed  # still partial after this step
                continue
            if not admitting or len(self._running) >= cfg.max_num_seqs or self._waiting[0] is not req:
                admitting = False
                continue
            head = self._waiting_head()
            n = self._prefill_chunk(b, head, self._cap(head), max(keep, self._admit_keep_free()))
            partial = n < head.prefill_left
            if n <= 0 or (partial and ahead >= cfg.max_partial_prefills):
                admitting = False
                continue
            self._admit(b, n)
            ahead += partial

    def _size_budget(self, b: StepBuilder, prefills: list[Request], decodes: list[Request]) -> None:
        """Set the step's budget from the step-time model. Decodes are never dropped;
        a step with no prefill work to do keeps exactly its decodes (no padding).
        `decodes`: every running request past its prompt."""
        plan, cfg = b.plan, self.config
        num_decodes = plan.num_decode_tokens
        waiting = self._waiting and b.admission_open and len(self._running) < cfg.max_num_seqs
        head = next((r for r in prefills if r.status is RequestStatus.RUNNING), None)
        if head is None and not waiting:
            b.budget = num_decodes
            return
        decode_kv = num_decodes + sum(e.start_pos for e in plan.entries)
        context = head.num_computed if head is not None else 0
        quantum = cfg.tile_size or 1
        model, limit = self.step_time_model, self._step_seconds(b.reqs)
        pending = [*(r for r in prefills if r.status is RequestStatus.RUNNING), *self._waiting]

        def decode_seconds() -> float:  # the decodes' own step: no step this one builds is shorter
            return model.predict_shape(StepShape.hybrid(0, context, num_decodes,  # type: ignore[union-attr]
                                                         decode_kv)) if plan.entries else 0.0

        urgent = self._urgent_tokens(pending, max(limit, decode_seconds())) if cfg.deadline_aware else 0
        if self._cache_binds():
            n = adaptive_prefill_tokens(model, limit, num_decodes, decode_kv, context,  # type: ignore[arg-type]
                                        cfg.token_budget, quantum, max(urgent, self._arrival_pace(pending)))
            self._chunk_limit = max(urgent, self._paced_chunk(quantum))
        elif urgent:
            n = adaptive_prefill_tokens(model, limit, num_decodes, decode_kv, context,  # type: ignore[arg-type]
                                        cfg.token_budget, quantum, urgent)
        else:
            backlog = sum(r.prefill_target - r.num_computed for r in pending)
            n = adaptive_prefill_tokens(model, limit, num_decodes, decode_kv, context,  # type: ignore[arg-type]
                                        cfg.token_budget, quantum, backlog=backlog,
                                        decode_steps=self._decode_steps(decodes))
        if n == 0 and not (plan.entries and decode_seconds() <= limit):
            # The rule that keeps admission alive on slow hardware: decodes that already
            # miss the limit never hold prefill back. Leaving prefill out cannot bring
            # their step within it, and would keep every waiting request out until the
            # running ones finish (a 1B model on a CPU under the server's default tiers).
            # So prefill fills the step up to the next tile boundary (one tile when nothing
            # else runs), or takes MIN_PREFILL_PROGRESS tokens without a tile size, or
            # what a waiting first token needs to make its deadline if that is more.
            # (Decodes that fit keep the step to themselves: prefill waits for the next
            # of them to finish, as the SLO asks.)
            tile = cfg.tile_size
            n = -(-(num_decodes + 1) // tile) * tile - num_decodes if tile else MIN_PREFILL_PROGRESS
            if urgent:
                n = max(n, self._urgent_over_limit(pending, context, num_decodes, decode_kv))
            n = max(0, min(n, cfg.token_budget - num_decodes))
        b.budget = num_decodes + n

    def _step_seconds(self, reqs: list[Request]) -> float:
        """The most seconds a step holding `reqs` may be predicted to take: tbt_slo and,
        deadline-aware, its decodes' deadlines (step_limit), less the margin
        (config.slo_margin, else the step-time model's own)."""
        cfg = self.config
        limit = cfg.tbt_slo if cfg.tbt_slo is not None else float("inf")
        if cfg.deadline_aware:
            limit = min(limit, step_limit((r for r in reqs if not r.is_prefill), self._now))
        margin = cfg.slo_margin if cfg.slo_margin is not None else self.step_time_model.margin  # type: ignore[union-attr]
        return limit * (1 - margin)

    def _step_aside(self, b: StepBuilder, pending: list[Request]) -> None:
        """Leave slack decodes out of this step when a tighter prompt needs the time.

        The rule: with no plan in flight (so `now` is when this step starts), take the
        best-ranked request still waiting for its first token (`pending` order, not
        relegated) that can run this step. At the largest step that fits the step limit
        with the decodes in, the prefill ranked ahead of it and its own (run back to back
        at that rate) miss its deadline; leaving out running decodes whose next deadline
        is later than its first-token deadline and that may_step_aside (two bounding
        steps of slack, deadline.two_step_bound) makes it: then the fewest of them that
        do (the latest-due first, in groups of 1, 2, 4, ...) are left out and the step
        takes the larger chunk. A decode left out runs in the next step unless the same
        test holds again then, so under the predicted step times it is never late for
        it, and it is never starved; no decode steps aside when it would not save the
        prompt (relegation deals with those). When the step was sized below a chunk that
        already makes the deadline with every decode in, it takes that chunk instead."""
        head, ahead = None, 0
        for r in pending:
            if not r.relegated and r.num_generated == 0:
                head = r
                break
            ahead += r.prefill_target - r.num_computed
        cfg = self.config
        if head is None or self._pending or (head.status is RequestStatus.WAITING and (
                not b.admission_open or len(self._running) >= cfg.max_num_seqs)):
            return
        plan, model = b.plan, self.step_time_model
        due, tokens = head.next_deadline(), ahead + head.prefill_target - head.num_computed
        context = next((r.num_computed for r in pending if r.status is RequestStatus.RUNNING), 0)
        decode_kv = plan.num_decode_tokens + sum(e.start_pos for e in plan.entries)

        def chunk(out: set) -> int:
            """The largest chunk within the limit with the decodes `out` left out, if at
            that rate the prefill up to the head's makes its deadline; else 0."""
            kept = [r for r in b.reqs if r.request_id not in out]
            kv = decode_kv - sum(e.start_pos + 1 for e in plan.entries if e.request_id in out)
            n = adaptive_prefill_tokens(model, self._step_seconds(kept), len(kept), kv,  # type: ignore[arg-type]
                                        context, cfg.token_budget, cfg.tile_size or 1, tokens)
            step = model.predict_shape(StepShape.hybrid(n, context, len(kept), kv))  # type: ignore[union-attr]
            return n if n > 0 and self._now + -(-tokens // n) * step <= due else 0

        have = b.budget - plan.num_decode_tokens
        if have > 0 and self._now + -(-tokens // have) * model.predict_shape(  # type: ignore[union-attr]
                StepShape.hybrid(have, context, plan.num_decode_tokens, decode_kv)) <= due:
            return  # it makes its deadline at the chunk the step was sized to
        kept_all = chunk(set())
        if kept_all:  # it makes its deadline at a larger chunk with every decode in: take that one
            self._take_chunk(b, kept_all, have)
            return
        bound = two_step_bound(model, cfg.token_budget, self._running.values())  # type: ignore[arg-type]
        slack = sorted((r for r in b.reqs if r.next_deadline() > due and may_step_aside(r, self._now, bound)),
                       key=lambda r: -r.next_deadline())
        k = 1
        while slack:
            k = min(k, len(slack))
            out = {r.request_id for r in slack[:k]}
            n = chunk(out)
            if n:
                self._leave_out(b, out)
                self._take_chunk(b, n, have)
                return
            if k == len(slack):
                return
            k *= 2

    def _take_chunk(self, b: StepBuilder, n: int, have: int) -> None:
        """Let this step prefill `n` tokens (at least the `have` it was sized to)."""
        b.budget = b.plan.num_decode_tokens + max(n, have)
        if self._chunk_limit is not None:  # the cache binds: let the prompt take what it needs
            self._chunk_limit = max(self._chunk_limit, n)

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

    def _urgent_tokens(self, pending: list[Request], limit: float) -> int:
        """Prefill tokens per step that every request still waiting for its first token
        (not relegated) needs to get it by its deadline, the prefill ranked ahead of it
        (`pending` order) done first, in steps of `limit` seconds: the most any of them
        needs (all the prefill up to it when its deadline is within one step); 0 without
        one. Pacing or a rate-optimal chunk that is smaller would let a deadline pass
        while the decodes' deadlines allowed more. Each request counts, not only the
        first: one that needs a single token can hide the whole prompt behind it."""
        need = ahead = 0
        for r in pending:
            ahead += r.prefill_target - r.num_computed
            if r.relegated or r.num_generated > 0:
                continue
            steps = (r.next_deadline() - self._now) / limit
            need = max(need, ahead if not steps >= 1 else -(-ahead // int(steps)))
        return need

    def _urgent_over_limit(self, pending: list[Request], context: int, num_decodes: int, decode_kv: int) -> int:
        """_urgent_tokens for a step whose decodes alone already break its limit: steps
        then last as long as their tokens make them, not `limit`, so each request waiting
        for its first token (in `pending` order, the prefill ahead of it first) needs the
        fewest tokens per step n = ceil(tokens / k) over the most steps k whose time,
        k x T(decodes + n), still ends by its deadline (all its tokens at once when even
        one step cannot); the most any of them needs."""
        model = self.step_time_model

        def seconds(n: int) -> float:
            return model.predict_shape(StepShape.hybrid(n, context, num_decodes, decode_kv))  # type: ignore[union-attr]

        need = ahead = 0
        floor = seconds(0)
        for r in pending:
            ahead += r.prefill_target - r.num_computed
            if r.relegated or r.num_generated > 0:
                continue
            left = r.next_deadline() - self._now
            if not seconds(ahead) <= left:
                need = max(need, ahead)
                continue
            lo, hi = 1, max(1, min(ahead, int(left / floor) if floor > 0 else ahead))
            while lo < hi:  # the most steps that still fit (k x T(ceil(ahead / k)) grows with k)
                k = (lo + hi + 1) // 2
                if k * seconds(-(-ahead // k)) <= left:
                    lo = k
                else:
                    hi = k - 1
            need = max(need, -(-ahead // lo))
        return need

    def _cache_binds(self) -> bool:
        """True when the free blocks cannot hold every live request to its
        max_new_tokens: then admission will wait on the cache, not on prefill speed."""
        bs, free = self.config.block_size, self.num_free_blocks
        need = 0
        for r in itertools.chain(self._running.values(), self._waiting):
            last = r.num_prompt_tokens + r.max_new_tokens - 1  # the last token's KV is never stored
            need += max(0, -(-last // bs) - len(r.blocks))
            if need > free:  # a long queue is not walked to the end
                return True
        return False

    def _arrival_pace(self, pending: list[Request]) -> int:
        """Prefill tokens for this step at the rate the `pending` prompts (running
        prefills, then the waiting queue) arrived: their tokens (the part already
        prefilled too) divided by the steps from the one the oldest of them arrived
        during to this one, rounded up to a tile-aligned step (at least one prefill
        token). Counting the prefilled part keeps a lone prompt from
        slowing down as it ages: it still finishes in a few steps.

        While the cache binds, prefilling faster than the prompts arrive only fills the
        cache sooner and then leaves steps with nothing to prefill, while each large chunk
        makes its step slower per prefill token (its attention grows with the chunk and
        the step stops being memory-bound), so every running request holds its blocks
        longer. Paced, the same prompts ride in many steps' memory-bound slack."""
        arrived = sum(r.prefill_target for r in pending)
        steps = self._step - min(r.arrival_step for r in pending) + 1
        return -(-arrived // steps)

    def _paced_chunk(self, quantum: int) -> int:
        """While the cache binds, the most prefill tokens one prompt may take in a step:
        the larger of the chunk that prefills fastest on its own and the recent arrival
        rate (prompt tokens that arrived in the last MAX_DECODE_HEADROOM_STEPS steps, per
        step), rounded up to `quantum`. The step's budget may still be larger (several
        prompts share it).

        Admission waits on the cache, so a prompt taken in larger pieces than the
        arrivals ask for only fills the cache sooner, and each piece beyond the fastest
        chunk is slower per token, which every running request pays for in step time. The
        pending prompts' pace (_arrival_pace) is a poor guide here: a prompt that has
        just arrived alone paces at its whole length. A slower cap than the arrival rate
        would let the queue grow."""
        horizon = MAX_DECODE_HEADROOM_STEPS
        while self._recent and self._recent[0][0] <= self._step - horizon:
            self._recent.popleft()
        rate = -(-sum(tokens for _, tokens in self._recent) // horizon)
        paced = -(-rate // quantum) * quantum
        if paced >= self.config.chunk_size:  # no cap: spare the search
            return paced
        return max(paced, fastest_chunk_alone(self.step_time_model, self.config.token_budget,  # type: ignore[arg-type]
                                              quantum))

    def _decode_need(self, decodes: list[Request]) -> int:
        """Blocks the running `decodes` will take before the next of them finishes (or
        within MAX_DECODE_HEADROOM_STEPS steps).

        Until a request finishes no block comes back, so a prefill that takes these
        blocks now forces a recompute preemption of the newest request (often the one
        just prefilled: the whole prompt is thrown away). A static budget paces prefill
        slowly enough that this is rare; the adaptive budget, which may prefill a whole
        queue in a few steps, must leave them free."""
        bs = self.config.block_size
        if not decodes:
            return 0
        steps = self._decode_steps(decodes)
        need = 0
        for r in decodes:
            last = r.num_prompt_tokens + r.max_new_tokens - 1  # the last token's KV is never stored
            need += max(0, -(-min(r.num_computed + steps, last) // bs) - len(r.blocks))
        return need

    def _decodes(self) -> list[Request]:
        """The running requests past their prompt."""
        return [r for r in self._running.values() if r.num_computed >= r.prefill_target]

    @staticmethod
    def _decode_steps(decodes: list[Request]) -> int:
        """Steps until the next of the running decodes finishes (at most
        MAX_DECODE_HEADROOM_STEPS; 0 without decodes): they all run that long anyway."""
        if not decodes:
            return 0
        return min(MAX_DECODE_HEADROOM_STEPS, *(r.max_new_tokens - r.num_generated for r in decodes))

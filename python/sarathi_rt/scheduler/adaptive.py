"""The adaptive token budget (config.tbt_slo, and the deadline policy's step limit): how
many prefill tokens a step takes beside its decodes so that its predicted time meets
the step's limit, paced to the arrivals while the cache binds, leaving free the blocks
the decodes will need. Consulted by the sarathi policy once its decodes are in."""
from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable

from .base import Scheduler
from .batch_plan import StepBuilder
from .request import Request, RequestStatus
from sarathi_rt.step_time import StepShape, adaptive_prefill_tokens, fastest_chunk_alone

# Prefill tokens a step takes, when no tile size is set, if the step limit leaves prefill
# nothing although its decodes alone already break it (or it has none): the prompts
# must move (see AdaptiveBudget.size; with a tile size, prefill fills the step's last tile).
MIN_PREFILL_PROGRESS = 128

# The most steps ahead the adaptive budget reserves the decodes' blocks for. The steps
# until the next decode finishes come from max_new_tokens, an upper bound (EOS and stop
# strings end requests sooner; a server request without max_tokens may get the whole
# model length), so an uncapped horizon would hold blocks back for growth that mostly
# never comes. A horizon of a few blocks' worth of steps keeps the reservation honest
# without that (bench/RESULTS.md, adaptive budget, compares the caps).
MAX_DECODE_HEADROOM_STEPS = 64


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


class AdaptiveBudget:
    """The step-sizing half of the sarathi policy with a step-time model. It reads the
    state of the scheduler that owns it (queue, running requests, clock, free blocks)
    and writes only the step's budget and `chunk_limit`: the most prefill tokens one
    prompt may take this step while the cache binds (None: no such cap)."""

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        # (step, prompt tokens) of the requests that arrived in the last
        # MAX_DECODE_HEADROOM_STEPS steps: the recent arrival rate (_paced_chunk).
        self._recent: deque[tuple[int, int]] = deque()
        self.chunk_limit: int | None = None

    def note_arrival(self, num_prompt_tokens: int) -> None:
        if self._sched.config.needs_step_time_model:
            self._recent.append((self._sched._step, num_prompt_tokens))

    def decodes(self) -> list[Request]:
        """The running requests past their prompt (in flight or not)."""
        return [r for r in self._sched._running.values() if r.num_computed >= r.prefill_target]

    def size(self, b: StepBuilder, prefills: list[Request], decodes: list[Request]) -> None:
        """Set the step's budget from the step-time model. Decodes are never dropped;
        a step with no prefill work to do keeps exactly its decodes (no padding).
        `decodes`: every running request past its prompt."""
        s = self._sched
        plan, cfg = b.plan, s.config
        num_decodes = plan.num_decode_tokens
        waiting = s._waiting and b.admission_open and len(s._running) < cfg.max_num_seqs
        head = next((r for r in prefills if r.status is RequestStatus.RUNNING), None)
        if head is None and not waiting:
            b.budget = num_decodes
            return
        decode_kv = num_decodes + sum(e.start_pos for e in plan.entries)
        context = head.num_computed if head is not None else 0
        quantum = cfg.tile_size or 1
        model, limit = s.step_time_model, self.step_seconds(b.reqs)
        pending = [*(r for r in prefills if r.status is RequestStatus.RUNNING), *s._waiting]

        def decode_seconds() -> float:  # the decodes' own step: no step this one builds is shorter
            return model.predict_shape(StepShape.hybrid(0, context, num_decodes,  # type: ignore[union-attr]
                                                         decode_kv)) if plan.entries else 0.0

        urgent = self._urgent_tokens(pending, max(limit, decode_seconds())) if cfg.deadline_aware else 0
        if self._cache_binds():
            n = adaptive_prefill_tokens(model, limit, num_decodes, decode_kv, context,  # type: ignore[arg-type]
                                        cfg.token_budget, quantum, max(urgent, self._arrival_pace(pending)))
            self.chunk_limit = max(urgent, self._paced_chunk(quantum))
        else:
            backlog = sum(r.prefill_target - r.num_computed for r in pending)
            n = adaptive_prefill_tokens(model, limit, num_decodes, decode_kv, context,  # type: ignore[arg-type]
                                        cfg.token_budget, quantum, backlog=backlog,
                                        decode_steps=self._decode_steps(decodes))
            if n < urgent:  # a floor: the rate-optimal chunk would let a first-token deadline pass
                n = adaptive_prefill_tokens(model, limit, num_decodes, decode_kv, context,  # type: ignore[arg-type]
                                            cfg.token_budget, quantum, urgent)
        if n == 0 and not (plan.entries and decode_seconds() <= limit):
            # The rule that keeps admission alive on slow hardware: decodes that already
            # miss the limit never hold prefill back. Leaving prefill out cannot bring
            # their step within it, and would keep every waiting request out until the
            # running ones finish (a 1B model on a CPU under the server's default tiers).
            # So prefill fills the step up to the next tile boundary (one tile when nothing
            # else runs), or takes MIN_PREFILL_PROGRESS tokens without a tile size, or
            # the most the decodes' own step time holds (prefill that makes them no later),
            # or what a waiting first token needs to make its deadline, whichever is most.
            # (Decodes that fit keep the step to themselves: prefill waits for the next
            # of them to finish, as the SLO asks.)
            tile = cfg.tile_size
            n = -(-(num_decodes + 1) // tile) * tile - num_decodes if tile else MIN_PREFILL_PROGRESS
            if plan.entries:
                n = max(n, adaptive_prefill_tokens(model, decode_seconds(), num_decodes, decode_kv,  # type: ignore[arg-type]
                                                   context, cfg.token_budget, quantum))
            if urgent:
                n = max(n, self._urgent_over_limit(pending, context, num_decodes, decode_kv))
            n = max(0, min(n, cfg.token_budget - num_decodes))
        b.budget = num_decodes + n

    def step_seconds(self, reqs: list[Request]) -> float:
        """The most seconds a step holding `reqs` may be predicted to take: tbt_slo and,
        deadline-aware, its decodes' deadlines (step_limit), less the margin
        (config.slo_margin, else the step-time model's own)."""
        s = self._sched
        cfg = s.config
        limit = cfg.tbt_slo if cfg.tbt_slo is not None else float("inf")
        if cfg.deadline_aware:
            limit = min(limit, step_limit((r for r in reqs if not r.is_prefill), s._now))
        margin = cfg.slo_margin if cfg.slo_margin is not None else s.step_time_model.margin  # type: ignore[union-attr]
        return limit * (1 - margin)

    def take_chunk(self, b: StepBuilder, n: int, have: int) -> None:
        """Let this step prefill `n` tokens (at least the `have` it was sized to)."""
        b.budget = b.plan.num_decode_tokens + max(n, have)
        if self.chunk_limit is not None:  # the cache binds: let the prompt take what it needs
            self.chunk_limit = max(self.chunk_limit, n)

    def _urgent_tokens(self, pending: list[Request], limit: float) -> int:
        """Prefill tokens per step that every request still waiting for its first token
        (not relegated) needs to get it by its deadline, the prefill ranked ahead of it
        (`pending` order) done first, in steps of `limit` seconds: the most any of them
        needs (all the prefill up to it when its deadline is within one step); 0 without
        one. Pacing or a rate-optimal chunk that is smaller would let a deadline pass
        while the decodes' deadlines allowed more. Each request counts, not only the
        first: one that needs a single token can hide the whole prompt behind it."""
        now = self._sched._now
        need = ahead = 0
        for r in pending:
            ahead += r.prefill_target - r.num_computed
            if r.relegated or r.num_generated > 0:
                continue
            steps = (r.next_deadline() - now) / limit
            need = max(need, ahead if not steps >= 1 else -(-ahead // int(steps)))
        return need

    def _urgent_over_limit(self, pending: list[Request], context: int, num_decodes: int, decode_kv: int) -> int:
        """_urgent_tokens for a step whose decodes alone already break its limit: steps
        then last as long as their tokens make them, not `limit`, so each request waiting
        for its first token (in `pending` order, the prefill ahead of it first) needs the
        fewest tokens per step n = ceil(tokens / k) over the most steps k whose time,
        k x T(decodes + n), still ends by its deadline (all its tokens at once when even
        one step cannot); the most any of them needs."""
        model, now = self._sched.step_time_model, self._sched._now

        def seconds(n: int) -> float:
            return model.predict_shape(StepShape.hybrid(n, context, num_decodes, decode_kv))  # type: ignore[union-attr]

        need = ahead = 0
        floor = seconds(0)
        for r in pending:
            ahead += r.prefill_target - r.num_computed
            if r.relegated or r.num_generated > 0:
                continue
            left = r.next_deadline() - now
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
        s = self._sched
        bs, free = s.config.block_size, s.num_free_blocks
        need = 0
        for r in itertools.chain(s._running.values(), s._waiting):
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
        steps = self._sched._step - min(r.arrival_step for r in pending) + 1
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
        s = self._sched
        horizon = MAX_DECODE_HEADROOM_STEPS
        while self._recent and self._recent[0][0] <= s._step - horizon:
            self._recent.popleft()
        rate = -(-sum(tokens for _, tokens in self._recent) // horizon)
        paced = -(-rate // quantum) * quantum
        if paced >= s.config.chunk_size:  # no cap: spare the search
            return paced
        return max(paced, fastest_chunk_alone(s.step_time_model, s.config.token_budget,  # type: ignore[arg-type]
                                              quantum))

    def decode_need(self, decodes: list[Request]) -> int:
        """Blocks the running `decodes` will take before the next of them finishes (or
        within MAX_DECODE_HEADROOM_STEPS steps).

        Until a request finishes no block comes back, so a prefill that takes these
        blocks now forces a recompute preemption of the newest request (often the one
        just prefilled: the whole prompt is thrown away). A static budget paces prefill
        slowly enough that this is rare; the adaptive budget, which may prefill a whole
        queue in a few steps, must leave them free."""
        bs = self._sched.config.block_size
        if not decodes:
            return 0
        steps = self._decode_steps(decodes)
        need = 0
        for r in decodes:
            last = r.num_prompt_tokens + r.max_new_tokens - 1  # the last token's KV is never stored
            need += max(0, -(-min(r.num_computed + steps, last) // bs) - len(r.blocks))
        return need

    @staticmethod
    def _decode_steps(decodes: list[Request]) -> int:
        """Steps until the next of the running decodes finishes (at most
        MAX_DECODE_HEADROOM_STEPS; 0 without decodes): they all run that long anyway."""
        if not decodes:
            return 0
        return min(MAX_DECODE_HEADROOM_STEPS, *(r.max_new_tokens - r.num_generated for r in decodes))

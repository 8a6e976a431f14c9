"""Sarathi-Serve stall-free batching (Algorithm 3) with fairness limits."""
from __future__ import annotations

from typing import Any, Hashable

from ..adaptive import AdaptiveBudget
from ..base import Scheduler
from ..batch_plan import StepBuilder
from ..deadline import DeadlinePlanner
from ..request import Request, RequestStatus
from ..registry import register_policy


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
    them but the slack ones that step aside for a tighter prompt; the
    step's time limit is the tightest of the running decodes' next-token
    deadlines (and tbt_slo, if set), sized as above; the prefills in progress and the
    waiting requests go in one order, by deadline.DeadlineOrder (a relegated request
    by a fresh deadline of its class from when it was relegated); a newcomer may be left
    partial while fewer than max_partial_prefills partial prompts rank ahead of it
    (those behind it wait, holding their blocks).

    The policy owns the plain algorithm; it consults an AdaptiveBudget (scheduler.adaptive)
    to size a step with a step-time model and, deadline-aware, a DeadlinePlanner
    (scheduler.deadline) for the order, relegation, stepping aside and making room."""

    name = "sarathi"
    adaptive = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._budget = AdaptiveBudget(self)
        self._deadline = DeadlinePlanner(self, self._budget, self._cap) if self.config.deadline_aware else None

    def add_request(self, request_id: Hashable, num_prompt_tokens: int, max_new_tokens: int,
                    **kwargs: Any) -> None:
        super().add_request(request_id, num_prompt_tokens, max_new_tokens, **kwargs)
        self._budget.note_arrival(num_prompt_tokens)

    def _cap(self, req: Request) -> int:
        threshold = self.config.long_prefill_threshold
        cap = self.config.chunk_size
        if threshold is not None and req.prefill_target > threshold:
            cap = min(cap, threshold)
        limit = self._budget.chunk_limit
        return cap if limit is None else min(cap, limit)

    def _build(self, b: StepBuilder) -> None:
        self._budget.chunk_limit = None
        deadline = self._deadline
        if deadline is not None:
            deadline.make_room(b)
        decodes, prefills = self._split_running()
        self._schedule_decodes(b, decodes)
        # Deadline order (relegating who cannot make a first token) comes before sizing:
        # the budget reads the pending prompts in the order they will run.
        pending = deadline.order(b, prefills) if deadline is not None else []
        keep = 0
        if self.config.needs_step_time_model:
            past_prompt = self._budget.decodes()  # in flight or not
            self._budget.size(b, prefills, past_prompt)
            # Blocks kept free for the decodes' next steps (see AdaptiveBudget.decode_need).
            keep = self._budget.decode_need(past_prompt)
        if deadline is not None:
            deadline.step_aside(b, pending)
            deadline.fill(b, pending, keep)
        else:
            self._fill_fcfs(b, prefills, keep)

    def _fill_fcfs(self, b: StepBuilder, prefills: list[Request], keep: int) -> None:
        """Algorithm 3's prefill part: the prefills in progress, then newcomers, FCFS,
        until the budget is spent, leaving `keep` blocks free."""
        cfg = self.config
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

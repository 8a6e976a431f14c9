"""Sarathi-Serve stall-free batching (Algorithm 3) with fairness limits."""
from __future__ import annotations

from ..base import Scheduler, StepBuilder
from ..request import Request, RequestStatus
from ..registry import register_policy


@register_policy
class SarathiScheduler(Scheduler):
    """Every running decode, then the prefills in progress (FCFS), then new requests
    (FCFS) until the token budget is spent. A prompt longer than
    long_prefill_threshold takes at most that many tokens per step, and up to
    max_partial_prefills prompts may be left half-done at the end of a step, so a
    prompt queued behind a huge one starts within a step or two instead of waiting
    for the whole huge prefill. Admission stays strictly FCFS."""

    name = "sarathi"

    def _cap(self, req: Request) -> int:
        threshold = self.config.long_prefill_threshold
        if threshold is not None and req.prefill_target > threshold:
            return min(self.config.chunk_size, threshold)
        return self.config.chunk_size

    def _build(self, b: StepBuilder) -> None:
        decodes, prefills = self._split_running()
        self._schedule_decodes(b, decodes)
        # Prompts that will still be partial after this step (in-flight ones counted
        # as partial, conservatively); a newcomer may only add to these within limits.
        num_partial = sum(1 for r in self._running.values()
                          if r.num_computed < r.prefill_target)
        for req in prefills:
            if req.status is not RequestStatus.RUNNING or b.budget_left <= 0:
                continue
            n = self._prefill_chunk(b, req, self._cap(req))
            if n > 0:
                if n == req.prefill_target - req.num_computed:
                    num_partial -= 1
                self._run_prefill(b, req, n)
        cfg = self.config
        while b.admission_open and self._waiting and b.budget_left > 0 and \
                len(self._running) < cfg.max_num_seqs:
            req = self._waiting_head()
            n = self._prefill_chunk(b, req, self._cap(req), self._admit_keep_free())
            if n <= 0:
                return
            if n < req.prefill_left:
                if num_partial >= cfg.max_partial_prefills:
                    return
                num_partial += 1
            self._admit(b, n)

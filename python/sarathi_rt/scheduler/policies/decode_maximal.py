"""The original Sarathi: decode-maximal batching with one prefill chunk per step."""
from __future__ import annotations

from ..base import Scheduler
from ..batch_plan import StepBuilder
from ..registry import register_policy
from ..request import RequestStatus


@register_policy
class DecodeMaximalScheduler(Scheduler):
    """Each step carries one prefill chunk of chunk_size tokens and piggybacks every
    running decode (at most max_num_seqs - 1 beside a prefill). Pick chunk_size with
    `suggest_chunk_size` from the workload's prefill:decode ratio."""

    name = "decode_maximal"

    def _build(self, b: StepBuilder) -> None:
        decodes, prefills = self._split_running()
        self._schedule_decodes(b, decodes)
        prefills = [r for r in prefills if r.status is RequestStatus.RUNNING]
        if prefills:
            n = self._prefill_chunk(b, prefills[0], self.config.chunk_size)
            if n > 0:
                self._run_prefill(b, prefills[0], n)
            return
        if any(r.num_computed < r.prefill_target for r in self._running.values()):
            return  # the one prefill is in flight in another plan
        if b.admission_open and self._waiting and \
                len(self._running) < self.config.max_num_seqs:
            n = self._prefill_chunk(b, self._waiting_head(), self.config.chunk_size,
                                    self._admit_keep_free())
            if n > 0:
                self._admit(b, n)

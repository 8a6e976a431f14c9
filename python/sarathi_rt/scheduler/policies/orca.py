"""Orca: iteration-level hybrid batches with whole (unchunked) prefills."""
from __future__ import annotations

from ..base import Scheduler
from ..batch_plan import StepBuilder
from ..registry import register_policy


@register_policy
class OrcaScheduler(Scheduler):
    """Every running decode plus as many whole waiting prompts (FCFS) as the budget,
    the cache and max_num_seqs allow. A long prompt joins whole, so the decodes
    sharing its step see a long time-between-tokens."""

    name = "orca"
    chunked = False

    def _build(self, b: StepBuilder) -> None:
        self._schedule_decodes(b, self._split_running()[0])
        self._admit_whole_prompts(b)

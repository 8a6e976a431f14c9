"""vLLM before chunked prefill: prefill-prioritizing, whole prompts."""
from __future__ import annotations

from ..base import Scheduler
from ..batch_plan import StepBuilder
from ..config import SchedulerConfig
from ..registry import register_policy


@register_policy
class VLLMScheduler(Scheduler):
    """If the oldest waiting request fits, the step is prefill-only (as many whole
    prompts as fit, FCFS); otherwise it is decode-only. Prefills therefore stall
    every running decode: the generation stalls Sarathi-Serve removes."""

    name = "vllm"
    chunked = False

    @classmethod
    def check_config(cls, config: SchedulerConfig) -> None:
        # Steps never mix phases, so a decode-only step of max_num_seqs is not bounded
        # by the prefill budget: nothing further to check.
        return None

    def _build(self, b: StepBuilder) -> None:
        self._admit_whole_prompts(b)
        if not b.reqs:
            self._schedule_decodes(b, self._split_running()[0])

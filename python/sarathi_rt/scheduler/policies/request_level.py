"""FasterTransformer-style request-level batching."""
from __future__ import annotations

from ..base import Scheduler
from ..batch_plan import StepBuilder
from ..config import SchedulerConfig
from ..registry import register_policy


@register_policy
class RequestLevelScheduler(Scheduler):
    """A batch is admitted only when the previous one has completely finished; its
    prompts run whole in one step, then it decodes until every member is done."""

    name = "request_level"
    chunked = False

    @classmethod
    def check_config(cls, config: SchedulerConfig) -> None:
        return None  # phases never mix, as for vllm

    def _build(self, b: StepBuilder) -> None:
        if self._running:
            self._schedule_decodes(b, self._split_running()[0])
        else:
            self._admit_whole_prompts(b)

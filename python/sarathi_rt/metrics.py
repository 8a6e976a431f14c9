"""What the engine and the simulator record: per request and per step. Times are seconds
on one clock (time.perf_counter in the engine, simulated time in the simulator)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tbts(self) -> list[float]:
        """Time between consecutive generated tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def scheduling_delay(self) -> float | None:
        """Time from arrival until the request first ran."""
        s = self.first_scheduled_time
        return None if s is None else s - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class StepMetrics:
    start_time: float
    duration: float
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int
    tile_padding: int = 0

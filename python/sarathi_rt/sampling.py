"""How to pick each request's next tokens and when to stop: `SamplingParams`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable


def _int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    max_tokens: most tokens to generate. temperature: 0 is greedy (argmax); otherwise
    logits are divided by it before top_k (keep the k most likely; None keeps all) and
    top_p (keep the smallest set whose probability reaches p). seed: makes a sampled
    request reproducible, whatever else shares its batches; None draws one from the
    engine's seed. Generation stops at max_tokens, at any of stop_token_ids, or at the
    model's end-of-sequence ids unless ignore_eos (the token that stops it is in
    token_ids but not in the text), or once the text contains one of the `stop` strings
    (a str or several; the text ends before it; needs a tokenizer). logprobs: also return
    the log probability of each generated token under the model's unmodified
    distribution. skip_special_tokens: leave special tokens out of the text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, 1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None:
            _int("top_k", self.top_k, 1)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _int("seed", self.seed, 0)
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        stops = tuple(self.stop_token_ids)
        for t in stops:
            _int("stop_token_ids entries", t, 0)
        object.__setattr__(self, "stop_token_ids", stops)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Iterable) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be a non-empty string or a sequence of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("ignore_eos", "logprobs", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

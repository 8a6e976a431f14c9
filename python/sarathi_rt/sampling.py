"""How to pick each request's next tokens and when to stop: `SamplingParams`."""
from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable

SEED_LIMIT = 2**64  # seeds are mixed as 64-bit words: a larger one would alias a smaller
# Below this temperature sampling is greedy (vLLM's floor too): dividing float32 logits by
# 1e-38 overflows them to inf, and softmax of inf is NaN, which would pick garbage.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives per token, OpenAI's top_logprobs limit
# Samples per request: each is a sequence of its own (KV blocks past the shared prompt, a
# decode row per step), so one request may not take over the batch.
MAX_N = 16
_MASK64 = (1 << 64) - 1


def as_int(name: str, value: object) -> int:
    """`value` as a Python int: ints and integer scalars (numpy.int64, a 0-d integer
    tensor) pass, bools and anything else raise TypeError naming `name`."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool ({value!r})")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request with `seed`: the seed itself for sample 0
    (so n=1 draws as before), else a splitmix64 mix of (seed, index) in [0, 2**64). Sample
    i of an n > 1 request draws exactly the tokens of a single request with this seed."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _int(name: str, value: object, minimum: int, limit: int | None = None) -> int:
    number = as_int(name, value)
    if number < minimum or (limit is not None and number >= limit):
        bound = f"in [{minimum}, {limit})" if limit is not None else f">= {minimum}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return number


def _schema(value: object) -> str:
    """A JSON schema (a dict, or JSON text of an object) as JSON text. Property order is
    kept: it is the order a grammar writes the properties in."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"json_schema must be a JSON schema object (a dict or its JSON text), got {value!r:.80}")
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema must hold JSON values only: {exc}") from None


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    max_tokens: most tokens to generate. temperature: 0, or anything below
    GREEDY_TEMPERATURE (1e-5), is greedy (argmax); otherwise logits are divided by it before top_k (keep the k most likely; None keeps all) and
    top_p (keep the smallest set whose probability reaches p). seed: makes a sampled
    request reproducible, whatever else shares its batches; None draws one from the
    engine's seed (seeds lie in [0, 2**64)). Generation stops at max_tokens, at any of
    stop_token_ids, or at the model's end-of-sequence ids unless ignore_eos (the token
    that stops it is in token_ids but not in the text), or once the text contains one of
    the `stop` strings (a str or several; the text ends before it; needs a tokenizer).
    logprobs: also return, for each generated token, its log probability and the
    `logprobs` (0..20) most likely tokens with theirs; prompt_logprobs: the same for every
    prompt token after the first (such a request skips the prefix cache: a cached token
    has no logits). Log probabilities are those of the model's raw logits, before
    temperature, top-k/top-p and any grammar mask (vLLM's default, "raw_logprobs"), so
    they do not change with the sampling settings. skip_special_tokens: leave special
    tokens out of the text. n: independent samples of the prompt (1..MAX_N=16), prefilled
    once; sample i draws with seed sample_seed(seed, i), so it equals a single request
    with that seed (sample 0 keeps `seed`). json_schema: a JSON schema (a dict or its JSON
    text; held as text) the generated text must satisfy; the request stops ("stop") once
    the value is complete. It needs the optional xgrammar extra (`pip install
    'sarathi_rt[structured]'`) and the engine's tokenizer; the engine compiles it when the
    request is added and raises ValueError naming json_schema for one xgrammar does not
    support. `{"type": "object"}` asks for any JSON object. It takes no `stop` strings,
    which could cut the value short.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    n: int = 1
    json_schema: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_tokens", _int("max_tokens", self.max_tokens, 1))
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None:
            object.__setattr__(self, "top_k", _int("top_k", self.top_k, 1))
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            object.__setattr__(self, "seed", _int("seed", self.seed, 0, SEED_LIMIT))
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        stops = tuple(_int("stop_token_ids entries", t, 0) for t in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stops)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Iterable) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be a non-empty string or a sequence of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _int(name, getattr(self, name), 0, MAX_LOGPROBS + 1))
        object.__setattr__(self, "n", _int("n", self.n, 1, MAX_N + 1))
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema(self.json_schema))
            if self.stop:  # the grammar would end no value it cut: a "stop" answer that does not parse
                raise ValueError("stop strings cannot be combined with json_schema: a stop string would cut "
                                 "the value before it is complete")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

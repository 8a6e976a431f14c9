"""The driver's record of one request: tokens, sampling settings, metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from sarathi_rt.measure.metrics import RequestMetrics
from sarathi_rt.sampling import SamplingParams

from sarathi_rt.text.detokenizer import Detokenizer
from .outputs import Prefix, RequestOutput, TokenLogprob
from .step_io import RowSampling
from .structured import Grammar


@dataclass(frozen=True, slots=True)
class SampleKey:
    """The scheduler's id of sample `index` >= 1 of a request (sample 0 is scheduled
    under the request's own id): a class of its own, so no user id can equal it."""

    request_id: Hashable
    index: int


@dataclass
class SequenceState:
    """One sample of a request (`index` of its n; `key`: its scheduler id)."""

    request_id: Hashable
    prompt: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # max_tokens, cut to what the model's context leaves
    stop_ids: frozenset[int]
    metrics: RequestMetrics
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    detokenizer: Detokenizer | None = None  # with a tokenizer: the text, the stop strings
    # With params.prompt_logprobs: None for the first prompt token, then those scored so far.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0
    grammar: Grammar | None = None  # with params.json_schema: where the output is in it
    # Speculative decoding: the tokens proposed after `output` for the next step to verify.
    draft: list[int] = field(default_factory=list)
    key: Hashable = field(init=False)

    def __post_init__(self) -> None:
        self.key = self.request_id if self.index == 0 else SampleKey(self.request_id, self.index)

    def tokens(self, start: int, n: int) -> list[int]:
        """Tokens start..start+n of prompt + output (a re-prefill after preemption
        runs into the generated tokens)."""
        p = len(self.prompt)
        if start + n <= p:
            return self.prompt[start:start + n]
        if start >= p:  # a decode: no copy of the whole sequence per step
            return self.output[start - p:start - p + n]
        return self.prompt[start:] + self.output[:start + n - p]

    def row_sampling(self) -> RowSampling:
        p = self.params
        return RowSampling(p.temperature, p.top_k, p.top_p, self.seed, len(self.output), p.logprobs,
                           None if self.grammar is None else self.grammar.allowed())

    def prompt_targets(self, start: int, n: int) -> list[int] | None:
        """The prompt tokens that positions start..start+n-1 predict, when this request
        wants prompt logprobs (a chunk past the prompt, a decode, has none)."""
        if self.prompt_logprobs is None:
            return None
        return self.prompt[start + 1:start + n + 1] or None

    def add_prompt_logprobs(self, start: int, values: list[TokenLogprob]) -> None:
        """Scores of prompt tokens start + 1..; a re-prefill after a preemption scores
        the same tokens again (to the same values): the later ones replace them."""
        assert self.prompt_logprobs is not None and start + 1 <= len(self.prompt_logprobs)
        del self.prompt_logprobs[start + 1:]
        self.prompt_logprobs += values

    def append(self, token: int, logprob: TokenLogprob | None, now: float) -> None:
        """Record a generated token; sets finish_reason when it ends the request."""
        self.output.append(token)
        complete = self.grammar is not None and self.grammar.accept(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        if token in self.stop_ids:
            self.finish_reason = "stop"  # the stop token is not rendered
        elif self.detokenizer is not None and self.detokenizer.append(token):
            self.finish_reason = "stop"  # a stop string
        elif complete:
            self.finish_reason = "stop"  # the schema's value is complete
        elif len(self.output) >= self.max_new_tokens:
            self.finish_reason = "length"

    def to_output(self, num_new: int) -> RequestOutput:
        """A snapshot after a step that generated the last `num_new` tokens."""
        out = self.output
        text = new_text = offsets = None
        if self.detokenizer is not None:
            new_text = self.detokenizer.release(self.finish_reason is not None)
            text = self.detokenizer.released_text
            offsets = Prefix(self.detokenizer.offsets)
        return RequestOutput(self.request_id, self.prompt, out[len(out) - num_new:], Prefix(out),
                             self.finish_reason is not None, self.finish_reason, self.metrics,
                             None if self.logprobs is None else Prefix(self.logprobs), text, new_text,
                             self.prompt_logprobs, self.index, text_offsets=offsets)

"""The OpenAI request bodies the server accepts, checked by pydantic, and the response
bodies it writes. Fields are strictly typed ("5", 5.0 and true are not a max_tokens) and
closed: an unknown field, or one of OpenAI's or vLLM's this engine does not implement, is
refused rather than ignored."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from sarathi_rt.engine.outputs import TokenLogprob
from sarathi_rt.engine.structured import DEFAULT_MAX_SCHEMA_COMPLEXITY
from sarathi_rt.sampling import MAX_LOGPROBS, MAX_N, SamplingParams

# Fields of OpenAI's API (or vLLM's extensions) that would change what is generated or
# returned, which this engine cannot honour yet: a 400 names them instead of a 200 that
# quietly ignores them.
UNSUPPORTED = frozenset({
    "suffix", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "audio", "modalities", "prediction", "reasoning_effort", "verbosity",
    "store", "metadata", "web_search_options", "repetition_penalty", "min_tokens", "min_p", "stop_token_ids",
    "bad_words", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens", "chat_template",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "use_beam_search",
    "length_penalty", "truncate_prompt_tokens", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structural_tag", "name", "tool_calls", "tool_call_id", "refusal"})


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, so that no client slows the others
    without bound. max_request_bytes: the body (larger: 413, before it is read).
    max_prompt_tokens: a prompt's tokens (None: what max_model_len leaves room for); a
    text longer than this many of the tokenizer's longest tokens is refused before it is
    tokenized. max_stop: stop strings (OpenAI's limit), of at most max_stop_chars
    characters each. max_messages: messages in a chat.

    A response_format json_schema is compiled into a grammar (once: compiled schemas are
    cached), which for a large schema takes seconds to minutes of a CPU core and cannot
    be interrupted. max_schema_complexity: the most engine.structured.schema_complexity
    (about one per JSON value in the schema, more for long enums and many optional
    properties) a schema may have; over it, 400 naming response_format before any
    compile. The default, 20000, keeps compiles within about 2 s on a 2-core machine.
    compile_timeout: the seconds a request waits for its compile (and a free compile
    slot); over it, 400 naming response_format (the schema costs too much to compile
    here), or 503 if no slot came free (the server is busy, the schema may be fine).
    max_compiles: compiles running at once, each on a thread of its own; one that runs
    past compile_timeout keeps its slot until it ends."""

    max_request_bytes: int = 4 << 20
    max_prompt_tokens: Optional[int] = None
    max_stop: int = 4
    max_stop_chars: int = 256
    max_messages: int = 512
    max_schema_complexity: int = DEFAULT_MAX_SCHEMA_COMPLEXITY
    compile_timeout: float = 10.0
    max_compiles: int = 2

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompt_tokens", "max_stop", "max_stop_chars", "max_messages",
                     "max_schema_complexity", "max_compiles"):
            value = getattr(self, name)
            if value is None and name == "max_prompt_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        timeout = self.compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"compile_timeout must be a positive finite number of seconds, got {timeout!r}")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaFormat(Strict):
    """response_format's json_schema: OpenAI's name, description and strict (the grammar
    enforces the schema whatever strict says) and the schema itself."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    """OpenAI's response_format: "text" (free), "json_object" (any JSON object) or
    "json_schema" (a value of that schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema" and only there')
        return self

    @property
    def json_schema_value(self) -> dict[str, Any] | None:
        """SamplingParams.json_schema for this format; None for free text."""
        if self.json_schema is not None:
            return self.json_schema.schema_
        return {"type": "object"} if self.type == "json_object" else None


class SamplingRequest(Strict):
    """What /v1/completions and /v1/chat/completions share. ignore_eos and top_k are not
    OpenAI's (vLLM has them too); benchmarks need ignore_eos for fixed output lengths.
    `user` is accepted because it never changes the output. `service_tier` selects the
    request's QoS class (OpenAI's name; see OpenAIServer). `response_format` constrains
    the output to JSON (SamplingParams.json_schema; needs the `structured` extra)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=1)
    seed: Optional[int] = Field(default=None, ge=0)
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices, prefilled once (SamplingParams.n)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    # Accepted at their neutral values only: the engine has no penalties or alternatives.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM's extension: each prompt token's log probability and this many alternatives.
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _supported(self) -> SamplingRequest:
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = self.stops
        return SamplingParams(max_tokens=self.max_tokens or max_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed, stop=tuple(stop),
                              ignore_eos=self.ignore_eos, logprobs=self.num_logprobs, n=self.n,
                              prompt_logprobs=self.prompt_logprobs,
                              json_schema=None if self.response_format is None
                              else self.response_format.json_schema_value)

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives to return with each token's log probability; None: no logprobs."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[int] = None
    # Off by default: "<|im_end|>" in a prompt is text, so a client of a chat model cannot
    # forge turns through /v1/completions unless it asks to write control tokens.
    parse_special_tokens: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise ValueError("prompt must be one prompt (a string or a list of token ids)")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.echo or (self.best_of or 1) != 1:
            raise ValueError("echo and best_of are not supported")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]]]

    def text(self) -> str:
        """String content, or the text parts of a content list (no images or audio)."""
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in self.content):
            raise ValueError("only text content parts ({'type': 'text', 'text': str}) are supported")
        return "".join(part["text"] for part in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        if value is not None and not info.data.get("logprobs"):  # a field error: the 400 names it
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    @model_validator(mode="after")
    def _tokens(self) -> ChatRequest:
        self.max_tokens = self.max_completion_tokens or self.max_tokens
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def describe(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A RequestValidationError's errors -> (message, param) for an OpenAI error body;
    param is the top-level field of the first error (a JSON error's location is a byte
    offset, not a field, so it has none)."""
    lines, params = [], []
    for e in errors[:3]:
        loc = [str(p) for p in e.get("loc", ())]
        loc = loc[1:] if loc[:1] == ["body"] else loc
        field = ".".join(loc) or None
        if e.get("type") == "json_invalid":
            lines.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
            field = None
        elif e.get("type") == "extra_forbidden":
            supported = loc[-1] not in UNSUPPORTED
            lines.append(f"{field}: unknown field" if supported else f"{field} is not supported by this server")
        else:
            lines.append(f"{field or 'body'}: {e.get('msg')}")
        params.append(loc[0] if field else None)
    return "; ".join(lines) or "invalid request", params[0] if params else None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_body(chat: bool, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
                  token_text: Callable[[int], str], token_bytes: Callable[[int], bytes],
                  text_offsets: Sequence[int] | None) -> dict[str, Any]:
    """OpenAI's logprobs object for these tokens: chat's `content` list, or the legacy
    completions' parallel lists. text_offsets: where each token's text starts in the
    completion's text; None (a model without a tokenizer has no text): where the text
    of the token before it ends.

    Chat's `bytes` are the token's own (part of a character, where its `token` text
    shows U+FFFD). A completions `top_logprobs` dict is keyed by token text; tokens that
    share a text there (two halves of different characters, both U+FFFD) are keyed by
    vLLM's "token_id:<id>" instead, so no alternative is lost."""
    if chat:
        def entry(token: int, value: float) -> dict[str, Any]:
            return {"token": token_text(token), "logprob": value, "bytes": list(token_bytes(token))}

        return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp in zip(token_ids, logprobs)], "refusal": None}

    def alternatives(top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        texts = [token_text(i) for i, _ in top]
        return {text if texts.count(text) == 1 else f"token_id:{i}": v for text, (i, v) in zip(texts, top)}

    tokens = [token_text(t) for t in token_ids]
    if text_offsets is None:
        text_offsets = list(accumulate(map(len, tokens), initial=0))[:-1]
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [alternatives(lp.top) for lp in logprobs], "text_offset": list(text_offsets)}


def prompt_logprobs_body(prompt: Sequence[int], scored: Sequence[TokenLogprob | None],
                         token_text: Callable[[int], str]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first prompt token (nothing
    predicts it), then per token {token id: {"logprob", "rank", "decoded_token"}} for the
    prompt's own token and its alternatives. `rank` is 1 for the most likely token; null
    for a prompt token outside the alternatives (the engine returns no rank beyond them)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token, lp in zip(prompt, scored):
        if lp is None:
            out.append(None)
            continue
        ranks = {i: r for r, (i, _) in enumerate(lp.top, 1)}
        entry = {str(token): {"logprob": lp.logprob, "rank": ranks.get(token), "decoded_token": token_text(token)}}
        out.append(entry | {str(i): {"logprob": v, "rank": ranks[i], "decoded_token": token_text(i)}
                            for i, v in lp.top if i != token})
    return out


def completion_body(request_id: str, model: str, chat: bool, text: str | None, finish_reason: str | None,
                    stream: bool, role: bool = False, token_ids: list[int] | None = None,
                    logprobs: dict[str, Any] | None = None, index: int = 0,
                    service_tier: str | None = None,
                    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None) -> dict[str, Any]:
    """One response (stream=False) or chunk of a stream, with a single choice; token_ids
    (vLLM's name) carry the output of a model without a tokenizer, which has no text.
    service_tier: the tier that served the request, echoed as OpenAI does.
    prompt_logprobs (vLLM's): prompt_logprobs_body's list, in a choice's response or first chunk."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    if not chat:
        choice["text"] = text or ""
        kind = "text_completion"
    elif stream:
        choice["delta"] = ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})
        kind = "chat.completion.chunk"
    else:
        choice["message"] = {"role": "assistant", "content": text or ""}
        kind = "chat.completion"
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
    return body if service_tier is None else body | {"service_tier": service_tier}

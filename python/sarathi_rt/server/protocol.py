"""The OpenAI request bodies the server accepts, checked by pydantic, and the response
bodies it writes. Fields the engine cannot honour are refused rather than ignored."""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sarathi_rt.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What /v1/completions and /v1/chat/completions share. ignore_eos and top_k are not
    OpenAI's (vLLM has them too); benchmarks need ignore_eos for fixed output lengths."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=1)
    seed: Optional[int] = Field(default=None, ge=0)
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    # Accepted at their neutral values only: the engine has no penalties or alternatives.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None

    @model_validator(mode="after")
    def _supported(self) -> SamplingRequest:
        if self.n != 1:
            raise ValueError("n must be 1 (one choice per request)")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        return self

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(max_tokens=self.max_tokens or max_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed, stop=tuple(stop),
                              ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise ValueError("prompt must be one prompt (a string or a list of token ids)")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.echo or self.logprobs is not None or (self.best_of or 1) != 1:
            raise ValueError("echo, logprobs and best_of are not supported")
        return self


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]]]

    def text(self) -> str:
        """String content, or the text parts of a content list (no images or audio)."""
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False

    @model_validator(mode="after")
    def _no_logprobs(self) -> ChatRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        self.max_tokens = self.max_completion_tokens or self.max_tokens
        return self

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, chat: bool, text: str | None, finish_reason: str | None,
                    stream: bool, role: bool = False) -> dict[str, Any]:
    """One response (stream=False) or chunk of a stream, with a single choice."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if not chat:
        choice.update(text=text or "", logprobs=None)
        kind = "text_completion"
    elif stream:
        choice["delta"] = ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})
        kind = "chat.completion.chunk"
    else:
        choice["message"] = {"role": "assistant", "content": text or ""}
        kind = "chat.completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}

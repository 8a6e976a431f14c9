"""Replay a workload against any OpenAI-compatible server, as `replay` does against the
engine: each request is sent at its arrival time as a streamed /v1/completions call with
the same synthetic token-id prompt, greedy, ignoring EOS, for its trace's number of
tokens. The client's clock gives TTFT and the time between tokens. Only the client is
measured: no step records.

Tokens are counted, not events: a server may merge tokens into one event (llama.cpp
holds back a token that ends inside a UTF-8 character) or send events without a token
(a final empty one beside the usage). An event's tokens are the ones it reports
(`token_ids`, or logprobs' `tokens`), else one if it carries text; the count is then made
to agree with the usage the stream ends with (`stream_options.include_usage`): tokens it
adds arrived merged into the last event, so they get that event's time."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Sequence

from sarathi_rt.measure.metrics import RequestMetrics
from sarathi_rt.harness.replay import synthetic_prompt
from sarathi_rt.workloads import RequestSpec


class EndpointError(RuntimeError):
    """The server refused a request or answered with something that is not a stream."""


def server_model(endpoint: str, timeout: float = 30.0) -> dict[str, Any]:
    """The first model GET {endpoint}/models lists (its id, and max_model_len if given)."""
    import httpx

    try:
        response = httpx.get(f"{endpoint}/models", timeout=timeout)
    except httpx.HTTPError as exc:
        raise EndpointError(f"cannot reach {endpoint}/models: {exc}") from None
    if response.status_code != 200 or not response.json().get("data"):
        raise EndpointError(f"{endpoint}/models answered {response.status_code}: {response.text[:200]}")
    return response.json()["data"][0]


def replay_endpoint(endpoint: str, model: str, workload: Sequence[RequestSpec], *, vocab_size: int,
                    seed: int = 0, progress: Callable[[int], None] | None = None) -> list[RequestMetrics]:
    """Run `workload` (sorted by arrival) against `endpoint` (".../v1"); the requests'
    metrics in workload order."""
    if any(b.arrival_time < a.arrival_time for a, b in zip(workload, workload[1:])):
        raise ValueError("workload must be sorted by arrival_time")
    return asyncio.run(_replay(endpoint.rstrip("/"), model, workload, vocab_size, seed, progress))


async def _replay(endpoint: str, model: str, workload: Sequence[RequestSpec], vocab_size: int, seed: int,
                  progress: Callable[[int], None] | None) -> list[RequestMetrics]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0, read=None)) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_request(client, endpoint, model, spec, synthetic_prompt(spec, vocab_size, seed),
                                              t0, progress)) for spec in workload]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one request failed: do not leave the others streaming
            for task in tasks:
                task.cancel()


async def _request(client: Any, endpoint: str, model: str, spec: RequestSpec, prompt: list[int], t0: float,
                   progress: Callable[[int], None] | None) -> RequestMetrics:
    arrival = t0 + spec.arrival_time
    await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
    metrics = RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": spec.num_decode_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    stream = StreamTokens(spec.request_id)
    async with client.stream("POST", f"{endpoint}/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise EndpointError(f"request {spec.request_id}: HTTP {response.status_code}: {text[:300]}")
        async for line in response.aiter_lines():
            if not stream.feed(line, time.perf_counter()):
                break
    metrics.token_times = stream.token_times()
    if metrics.token_times:
        metrics.first_token_time = metrics.token_times[0]
    metrics.finish_time = time.perf_counter()
    if progress is not None:
        progress(1)
    return metrics


class StreamTokens:
    """The tokens of one streamed completion, line by line: each event's tokens at the
    time it arrived, and the completion token count of the usage event, if any."""

    def __init__(self, request_id: object) -> None:
        self.request_id = request_id
        self.times: list[float] = []
        self.completion_tokens: int | None = None

    def feed(self, line: str, now: float) -> bool:
        """Reads one line of the stream received at `now`; False once it is `[DONE]`."""
        if not line.startswith("data:"):
            return True  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        event = json.loads(data)
        if "error" in event:
            raise EndpointError(f"request {self.request_id}: {event['error']}")
        self.times.extend([now] * sum(tokens_in(choice) for choice in event.get("choices") or []))
        if event.get("usage"):
            self.completion_tokens = event["usage"].get("completion_tokens")
        return True

    def token_times(self) -> list[float]:
        """Each token's arrival time, in the number the server's usage counted."""
        return agree_with_usage(self.times, self.completion_tokens)


def tokens_in(choice: dict[str, Any]) -> int:
    """Tokens one streamed choice carries: as many as it lists ids or logprobs for, else
    one when it has text (a completion's `text`, a chat delta's `content`)."""
    if choice.get("token_ids") is not None:
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs") or {}
    if isinstance(logprobs, dict) and logprobs.get("tokens") is not None:
        return len(logprobs["tokens"])
    text = choice.get("text", (choice.get("delta") or {}).get("content"))
    return 1 if text else 0


def agree_with_usage(times: list[float], completion_tokens: int | None) -> list[float]:
    """Token arrival times made to agree with the server's own count: extra ones dropped
    from the end, missing ones (merged into the last event) at the last event's time."""
    if completion_tokens is None or completion_tokens == len(times):
        return times
    if completion_tokens < len(times):
        return times[:completion_tokens]
    if not times:
        raise EndpointError(f"the server counted {completion_tokens} tokens but streamed none")
    return times + [times[-1]] * (completion_tokens - len(times))

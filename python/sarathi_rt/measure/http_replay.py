"""Replay a workload against any OpenAI-compatible server, as `replay` does against the
engine: each request is sent at its arrival time as a streamed /v1/completions call with
the same synthetic token-id prompt, greedy, ignoring EOS, for its trace's number of
tokens. The client's clock gives TTFT and, from the arrival time of each streamed token
event, the time between tokens. Only the client is measured: no step records."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Sequence

from sarathi_rt.measure.metrics import RequestMetrics
from sarathi_rt.measure.replay import synthetic_prompt
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
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{endpoint}/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise EndpointError(f"request {spec.request_id}: HTTP {response.status_code}: {text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise EndpointError(f"request {spec.request_id}: {event['error']}")
            if event.get("choices"):  # one event per generated token
                metrics.token_times.append(time.perf_counter())
    if metrics.token_times:
        metrics.first_token_time = metrics.token_times[0]
    metrics.finish_time = time.perf_counter()
    if progress is not None:
        progress(1)
    return metrics

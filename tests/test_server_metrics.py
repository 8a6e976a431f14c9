"""/metrics as a scraper reads it (prometheus_client's parser), under concurrent load with
n > 1, whole and streamed responses, completions and chat, clients that leave mid-stream,
bad and refused requests, and then an engine failure: every counter and histogram count
equals what the requests sent must give."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from engine_faults import break_after  # noqa: E402
from http_servers import running  # noqa: E402
from metrics_text import scrape  # noqa: E402
from text_models import tiny_tokenizer  # noqa: E402
from sarathi_rt import LLM  # noqa: E402
from sarathi_rt.server import OpenAIServer  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server on loopback

BLOCKS = 256
SHARED = "the quick brown fox " * 2  # several full blocks: repeats of it hit the prefix cache
P = "sarathi_rt:"


@dataclass(frozen=True)
class Sent:
    """A request that runs to its max_tokens (ignore_eos)."""

    chat: bool
    stream: bool
    n: int
    max_tokens: int
    text: str

    def body(self) -> dict:
        prompt = {"messages": [{"role": "user", "content": self.text}]} if self.chat else {"prompt": self.text}
        return prompt | {"model": "tiny", "n": self.n, "max_tokens": self.max_tokens, "stream": self.stream,
                         "temperature": 0.8, "seed": 7, "ignore_eos": True}

    def path(self) -> str:
        return "/chat/completions" if self.chat else "/completions"


def _prompt_tokens(server: OpenAIServer, sent: Sent) -> int:
    tokenizer = server.llm.tokenizer
    if sent.chat:
        return len(tokenizer.apply_chat_template([{"role": "user", "content": sent.text}]))
    return len(tokenizer.encode(sent.text, parse_special=False))


async def _complete(client: httpx.AsyncClient, sent: Sent) -> int:
    """Sends `sent`; returns the completion tokens it got (usage, or streamed chunks)."""
    if not sent.stream:
        r = await client.post(sent.path(), json=sent.body())
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == sent.n
        return r.json()["usage"]["completion_tokens"]
    body = sent.body() | {"stream_options": {"include_usage": True}}
    usage = None
    async with client.stream("POST", sent.path(), json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage["completion_tokens"]


async def _leave(client: httpx.AsyncClient, sent: Sent) -> None:
    """Streams `sent` (too long to finish) and leaves once every choice has sent a chunk."""
    seen: set[int] = set()
    async with client.stream("POST", sent.path(), json=sent.body()) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                if len(seen) == sent.n:
                    break
    assert len(seen) == sent.n


async def _refused(client: httpx.AsyncClient, body: dict, status: int) -> None:
    r = await client.post("/completions", json=body)
    assert r.status_code == status, r.text


def _idle(server: OpenAIServer) -> None:
    engine, deadline = server.llm.engine, time.monotonic() + 15
    while (engine.has_unfinished() or engine.scheduler.num_free_blocks < BLOCKS) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished() and engine.scheduler.num_free_blocks == BLOCKS


def test_metrics_count_what_was_sent() -> None:
    llm = LLM("tiny", tokenizer=tiny_tokenizer(), num_kv_blocks=BLOCKS, block_size=8, token_budget=64,
              max_num_seqs=32, enable_prefix_caching=True)
    server = OpenAIServer(llm, "tiny", max_waiting=64)
    warm = Sent(chat=False, stream=False, n=1, max_tokens=3, text=SHARED)
    done = [Sent(chat=i % 4 == 3, stream=i % 2 == 1, n=1 + i % 3, max_tokens=3 + i % 4,
                 text=SHARED if i % 3 == 0 else f"request {i}") for i in range(12)]
    left = [Sent(chat=i == 1, stream=True, n=2, max_tokens=900, text=f"leaving {i}") for i in range(3)]

    async def load(base: str) -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            await _complete(client, warm)  # first, so that the SHARED prompts after it hit its blocks
            got = await asyncio.gather(*(_complete(client, s) for s in done), *(_leave(client, s) for s in left),
                                       _refused(client, warm.body() | {"n": 0}, 400),
                                       _refused(client, warm.body() | {"model": "nope"}, 404))
            server.max_waiting = 0  # every request now finds the queue full
            await _refused(client, warm.body(), 503)
            server.max_waiting = 64
            return got[:len(done)]

    with running(server.app) as base:
        tokens = asyncio.run(load(base))
        assert tokens == [s.n * s.max_tokens for s in done]  # every sample ran to max_tokens
        _idle(server)
        m = scrape(base)
        finished = [warm] + done
        # Each request once, by its least complete sample; those whose client left, as aborted.
        assert {end: m[f'{P}request_success_total{{finished_reason="{end}"}}'] for end in ("stop", "length", "abort")} \
            == {"stop": 0, "length": len(finished), "abort": len(left)}
        assert {r: m[f'{P}request_failures_total{{reason="{r}"}}'] for r in ("bad_request", "overloaded", "error")} \
            == {"bad_request": 2, "overloaded": 1, "error": 0}
        # A request that left before any sample ended has nothing measured: tokens and
        # phases count the finished ones, prompt tokens and TTFT once, generated tokens and
        # gaps over every sample.
        assert m[f"{P}prompt_tokens_total"] == sum(_prompt_tokens(server, s) for s in finished)
        assert m[f"{P}generation_tokens_total"] == sum(s.n * s.max_tokens for s in finished)
        assert m[f"{P}inter_token_latency_seconds_count"] == sum(s.n * (s.max_tokens - 1) for s in finished)
        for once in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                     "request_prefill_time_seconds", "request_decode_time_seconds",
                     "request_max_inter_token_latency_seconds"):
            assert m[f"{P}{once}_count"] == m[f'{P}{once}_bucket{{le="+Inf"}}'] == len(finished), once
            assert m[f"histogram {P}{once}"] == 1
        assert m[f"{P}time_to_first_token_seconds_sum"] > 0 and m[f"{P}e2e_request_latency_seconds_sum"] > 0
        assert m[f"{P}slo_window_requests"] == len(finished)
        # Every request that got a step looked its prompt up in the prefix cache, once (no preemption).
        assert m[f"{P}num_preemptions_total"] == 0
        assert m[f"{P}prefix_cache_queries_total"] == sum(_prompt_tokens(server, s) for s in finished + left)
        assert m[f"{P}prefix_cache_hits_total"] == llm.engine.prefix_cache_stats().hits >= 8  # a block at least
        assert (m[f"{P}num_requests_running"], m[f"{P}num_requests_waiting"], m[f"{P}kv_cache_usage_perc"]) == \
            (0, 0, 0)
        assert not any(name.startswith(f"{P}qos_") for name in m)  # the engine has no QoS classes

        # The engine fails under two running requests: each counts once, as an error; a
        # request after it is refused.
        body = warm.body() | {"max_tokens": 900}
        whole: dict[str, httpx.Response] = {}
        waiter = threading.Thread(target=lambda: whole.update(r=httpx.post(f"{base}/completions", json=body,
                                                                           timeout=60)))
        waiter.start()
        with httpx.stream("POST", f"{base}/completions", json=body | {"stream": True}, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            deadline = time.monotonic() + 15
            while llm.engine.scheduler.num_running < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert llm.engine.scheduler.num_running == 2
            break_after(llm.engine, 1)
            assert any("the forward raised" in line for line in lines)
        waiter.join(timeout=60)
        assert whole["r"].status_code == 500
        assert httpx.post(f"{base}/completions", json=warm.body()).status_code == 503
        after = scrape(base)
        assert {r: after[f'{P}request_failures_total{{reason="{r}"}}'] for r in ("bad_request", "overloaded",
                                                                                 "error")} \
            == {"bad_request": 2, "overloaded": 2, "error": 2}
        assert {k: v for k, v in after.items() if "request_success" in k or "tokens_total" in k} == \
            {k: v for k, v in m.items() if "request_success" in k or "tokens_total" in k}
        assert (after[f"{P}num_requests_running"], after[f"{P}kv_cache_usage_perc"]) == (0, 0)

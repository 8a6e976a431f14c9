"""`sarathi-rt serve` driven by the official openai client on loopback: completions and
chat, whole and streamed, 32 concurrent clients, clients that leave mid-stream, bad
requests, overload, /v1/models, /health and /metrics."""
from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from http_servers import running  # noqa: E402
from metrics_text import scrape  # noqa: E402
from text_models import tiny_tokenizer  # noqa: E402
from sarathi_rt import LLM, SamplingParams  # noqa: E402
from sarathi_rt.server import OpenAIServer  # noqa: E402

pytestmark = pytest.mark.slow  # each module starts a server on loopback

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
CONV = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served():
    llm = LLM("tiny", tokenizer=tiny_tokenizer(), num_kv_blocks=256, block_size=8, token_budget=64,
              max_num_seqs=32)
    expected = llm.generate(["hello world"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0]
    server = OpenAIServer(llm, "tiny", max_waiting=64)
    with running(server.app) as url:
        yield server, url, expected


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1], api_key="none", max_retries=0, timeout=60)


def _wait_idle(base: str) -> dict[str, float]:
    deadline = time.monotonic() + 15
    while True:
        m = scrape(base)
        if m["sarathi_rt:kv_cache_usage_perc"] == 0 and m["sarathi_rt:num_requests_running"] == 0 or \
                time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_completions_whole_and_streamed(served, client: openai.OpenAI) -> None:
    server, base, expected = served
    whole = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, **GREEDY)
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids) and whole.usage.completion_tokens == 8
    by_ids = client.completions.create(model="tiny", prompt=expected.prompt_token_ids, max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == expected.text
    chunks = list(client.completions.create(model="tiny", prompt="hello world", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert len(chunks) == 8 + 1  # one event per token, then usage
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected.text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 8


def test_chat_whole_and_streamed_with_a_stop_string(served, client: openai.OpenAI) -> None:
    server, base, _ = served
    whole = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=12, **GREEDY)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(server.llm.tokenizer.apply_chat_template(CONV))
    stream = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=12, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    stop = text[4:6]
    cut = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=12, stop=[stop], **GREEDY)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(stop)]


def test_32_concurrent_clients(served) -> None:
    server, base, expected = served

    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        kwargs = {"model": "tiny", "prompt": f"hello {i % 16}", "max_tokens": 6 + i % 5, "temperature": 0.8,
                  "top_p": 0.9, "seed": i % 16, "extra_body": {"ignore_eos": True}}
        if i % 2:
            return "".join([c.choices[0].text async for c in await aclient.completions.create(stream=True, **kwargs)])
        out = await aclient.completions.create(**kwargs)
        assert out.usage.completion_tokens == 6 + i % 5
        return out.choices[0].text

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    before = scrape(base)
    texts = asyncio.run(run())
    # i and i + 16 have the same prompt and seed (one streamed, one not): the same text
    # with max_tokens 6 + i % 5 vs 6 + (i + 16) % 5 tokens, so one is a prefix of the other
    for i in range(16):
        a, b = texts[i], texts[i + 16]
        assert a.startswith(b) or b.startswith(a)
    after = _wait_idle(base)
    assert after["sarathi_rt:kv_cache_usage_perc"] == 0
    length = 'sarathi_rt:request_success_total{finished_reason="length"}'
    assert after[length] - before[length] == 32


def test_a_client_leaving_mid_stream_frees_its_blocks(served, client: openai.OpenAI) -> None:
    server, base, _ = served
    for chat in (False, True):
        kwargs = {"model": "tiny", "max_tokens": 900, "stream": True, **GREEDY}
        stream = client.chat.completions.create(messages=CONV, **kwargs) if chat else \
            client.completions.create(prompt="hello world", **kwargs)
        it = iter(stream)
        for _ in range(3):
            next(it)
        assert scrape(base)["sarathi_rt:kv_cache_usage_perc"] > 0
        stream.close()
        m = _wait_idle(base)
        assert m["sarathi_rt:kv_cache_usage_perc"] == 0 and m["sarathi_rt:num_requests_running"] == 0
    assert m['sarathi_rt:request_success_total{finished_reason="abort"}'] >= 2
    assert not server.llm.engine.has_unfinished()


@pytest.mark.parametrize("bad", [{"n": 17}, {"temperature": -1}, {"prompt": [10 ** 6]}, {"prompt": ""},
                                 {"stop": [""]}, {"max_tokens": 0}, {"top_p": 0}, {"logprobs": 21},
                                 {"prompt": list(range(3, 1100))}])
def test_bad_requests_get_400_and_the_server_keeps_serving(served, client: openai.OpenAI, bad: dict) -> None:
    kwargs = {"model": "tiny", "prompt": "hello", "max_tokens": 4} | bad
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kwargs)
    assert err.value.status_code == 400 and err.value.body["type"] == "invalid_request_error"
    assert err.value.body["message"]
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).usage.completion_tokens >= 1


def test_malformed_bodies_and_unknown_models(served, client: openai.OpenAI) -> None:
    server, base, _ = served
    r = httpx.post(base + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base + "/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard",
                                                                                    "content": "x"}]})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hello", max_tokens=2)


def test_overload_answers_503(served, monkeypatch: pytest.MonkeyPatch) -> None:
    """With max_waiting=2 and the engine held back, the first two requests queue and the
    other ten are refused at once; released, the two are served."""
    server, base, _ = served
    engine = server.llm.engine
    gate = threading.Event()
    step = engine.step

    def held_step():  # runs in the async engine's worker thread
        gate.wait(timeout=60)
        return step()

    async def one(aclient: openai.AsyncOpenAI) -> int:
        try:
            await aclient.completions.create(model="tiny", prompt="hello", max_tokens=4)
            return 200
        except openai.APIStatusError as exc:
            assert exc.body["type"] == "server_overloaded"
            return exc.status_code

    async def run() -> list[int]:
        aclient = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
        tasks = [asyncio.create_task(one(aclient)) for _ in range(12)]
        deadline = time.monotonic() + 30
        while sum(t.done() for t in tasks) < 10 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        gate.set()
        return await asyncio.gather(*tasks)

    monkeypatch.setattr(engine, "step", held_step)
    server.max_waiting = 2
    try:
        codes = asyncio.run(run())
    finally:
        server.max_waiting = 64
        gate.set()
    assert sorted(codes) == [200] * 2 + [503] * 10
    assert _wait_idle(base)["sarathi_rt:kv_cache_usage_perc"] == 0


def test_models_health_andscrape(served) -> None:
    server, base, _ = served
    assert httpx.get(base.removesuffix("/v1") + "/health").status_code == 200
    models = httpx.get(base + "/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 1024
    m = scrape(base)
    p = "sarathi_rt:"
    assert m[f"histogram {p}time_to_first_token_seconds"] == 1
    assert m[f'{p}time_to_first_token_seconds_bucket{{le="+Inf"}}'] == m[f"{p}time_to_first_token_seconds_count"] > 0
    assert m[f"{p}inter_token_latency_seconds_count"] > 0
    assert m[f"{p}num_requests_waiting"] == 0
    assert m[f"{p}slo_window_requests"] > 0 and m[f"{p}inter_token_latency_max_seconds"] > 0
    assert 0 <= m[f"{p}prefill_wait_share"] <= 1 and math.isnan(m[f"{p}goodput_requests_per_second"])


def test_bench_replays_a_workload_against_the_endpoint(served, tmp_path, capsys) -> None:
    from sarathi_rt.cli import main
    from sarathi_rt.measure.metrics import load_requests_csv
    from sarathi_rt.workloads import WorkloadConfig, make_workload

    server, base, _ = served
    flags = ["--num-requests", "4", "--qps", "20", "--length-scale", "0.02", "--seed", "3"]
    assert main(["bench", "--endpoint", base, "--vocab-size", "512", "--out", str(tmp_path)] + flags) == 0
    table = capsys.readouterr().out
    assert f"tiny at {base}" in table and "endpoint" in table
    workload = make_workload(WorkloadConfig(num_requests=4, qps=20, lengths="sharegpt", length_scale=0.02,
                                            max_total_tokens=1024, seed=3))
    measured = load_requests_csv(tmp_path / "endpoint_requests.csv")
    assert [r.num_generated_tokens for r in measured] == [w.num_decode_tokens for w in workload]
    assert [r.num_prompt_tokens for r in measured] == [w.num_prompt_tokens for w in workload]
    assert all(r.ttft > 0 and r.finish_time >= r.token_times[-1] for r in measured)
    assert _wait_idle(base)["sarathi_rt:kv_cache_usage_perc"] == 0


def test_serve_command_rejects_bad_flags(capsys) -> None:
    from sarathi_rt.cli import main

    assert main(["serve", "--model", "tiny", "--max-waiting", "-1"]) == 2
    assert "max_waiting" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny", "--tokenizer", "no/such/tokenizer"]) == 2
    assert "tokenizer" in capsys.readouterr().err

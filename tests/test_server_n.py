"""The server's `n` through the official openai client on loopback: n choices with their
index, equal to the library's n samples of the same request, whole and streamed, for
completions and chat; n above the limit is a 400 naming n; a client leaving an n > 1
stream aborts every sample and frees their blocks; /metrics counts such a request once."""
from __future__ import annotations

import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from http_servers import tiny_server  # noqa: E402
from metrics_text import scrape  # noqa: E402
from sarathi_rt import LLM, SamplingParams  # noqa: E402
from sarathi_rt.sampling import MAX_N  # noqa: E402
from sarathi_rt.server import OpenAIServer  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server on loopback

CONV = [{"role": "user", "content": "hello"}]
BLOCKS = 256


@pytest.fixture(scope="module")
def served():
    with tiny_server(num_kv_blocks=BLOCKS) as served:
        yield served


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1], api_key="none", max_retries=0, timeout=60)


def _expected(server: OpenAIServer, prompt: list[int], n: int) -> list[str]:
    """The texts of the library's n samples of the same request, on a second LLM with
    the same weights."""
    llm = LLM("tiny", tokenizer=server.llm.tokenizer, num_kv_blocks=64, block_size=8)
    out = llm.generate([prompt], SamplingParams(n=n, max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
                       use_tqdm=False)[0]
    return [c.text for c in out.outputs]


def _idle(server: OpenAIServer) -> bool:
    deadline = time.monotonic() + 15
    engine = server.llm.engine
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not engine.has_unfinished() and engine.scheduler.num_free_blocks == BLOCKS


ABORTED = 'sarathi_rt:request_success_total{finished_reason="abort"}'
ARGS = dict(model="tiny", max_tokens=6, temperature=0.8, seed=3, extra_body={"ignore_eos": True})


def test_completions_n_whole_and_streamed(served, client: openai.OpenAI) -> None:
    server, _ = served
    want = _expected(server, server.llm.tokenizer.encode("hello world", parse_special=False), 3)
    whole = client.completions.create(prompt="hello world", n=3, **ARGS)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == want and len(set(want)) == 3
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.completion_tokens == 18 and whole.usage.prompt_tokens == len(
        server.llm.tokenizer.encode("hello world", parse_special=False))
    texts = ["", "", ""]
    usage = None
    for chunk in client.completions.create(prompt="hello world", n=3, stream=True,
                                           stream_options={"include_usage": True}, **ARGS):
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == want and usage.completion_tokens == 18
    assert _idle(server)


def test_chat_n_whole_and_streamed(served, client: openai.OpenAI) -> None:
    server, _ = served
    want = _expected(server, server.llm.tokenizer.apply_chat_template(CONV), 2)
    whole = client.chat.completions.create(messages=CONV, n=2, **ARGS)
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.message.content for c in whole.choices] == want
    assert whole.usage.completion_tokens == 12
    texts, roles = ["", ""], [0, 0]
    for chunk in client.chat.completions.create(messages=CONV, n=2, stream=True, **ARGS):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
    assert texts == want and roles == [1, 1]  # each choice's first chunk names the role
    assert _idle(server)


@pytest.mark.parametrize("n", [MAX_N + 1, 0])
def test_n_out_of_range_is_a_400_naming_n(served, client: openai.OpenAI, n: int) -> None:
    for create, kwargs in ((client.completions.create, {"prompt": "hi"}),
                           (client.chat.completions.create, {"messages": CONV})):
        with pytest.raises(openai.BadRequestError) as err:
            create(model="tiny", max_tokens=2, n=n, **kwargs)
        assert err.value.body["param"] == "n" and "n" in err.value.body["message"]
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=MAX_N).choices[-1].index == MAX_N - 1


def test_leaving_an_n_stream_aborts_every_sample(served, client: openai.OpenAI) -> None:
    server, _ = served
    for chat in (False, True):
        kwargs = {"model": "tiny", "max_tokens": 900, "n": 4, "stream": True, "temperature": 0.0,
                  "extra_body": {"ignore_eos": True}}
        stream = client.chat.completions.create(messages=CONV, **kwargs) if chat else \
            client.completions.create(prompt="hello world", **kwargs)
        seen: set[int] = set()
        for chunk in stream:
            seen.update(c.index for c in chunk.choices)
            if len(seen) == 4:
                break
        assert server.llm.engine.has_unfinished() and server.llm.engine.scheduler.num_running == 4
        stream.close()
        assert _idle(server)


def test_leaving_a_whole_n_response_aborts_every_sample(served, client: openai.OpenAI) -> None:
    server, base = served
    aborted = scrape(base)[ABORTED]
    with pytest.raises(openai.APITimeoutError):  # the client gives up and closes its connection
        client.with_options(timeout=0.5).completions.create(model="tiny", prompt="hello world", max_tokens=900, n=4,
                                                            temperature=0.0, extra_body={"ignore_eos": True})
    assert _idle(server)
    assert scrape(base)[ABORTED] - aborted == 1  # one request, every sample long before its 900 tokens


def test_metrics_count_an_n_request_once(served, client: openai.OpenAI) -> None:
    server, base = served
    prompt_tokens = len(server.llm.tokenizer.encode("hello world", parse_special=False))
    before = scrape(base)
    client.completions.create(prompt="hello world", n=3, **ARGS)
    list(client.completions.create(prompt="hello world", n=2, stream=True, **ARGS))
    assert _idle(server)
    after = scrape(base)
    delta = {name: after[name] - before[name] for name in after}
    p = "sarathi_rt:"
    assert delta[f'{p}request_success_total{{finished_reason="length"}}'] == 2
    assert sum(v for k, v in delta.items() if k.startswith(f"{p}request_success_total")) == 2
    assert delta[f"{p}prompt_tokens_total"] == 2 * prompt_tokens
    for once in ("time_to_first_token_seconds", "request_max_inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert delta[f"{p}{once}_count"] == 2, once
    # Every sample's 6 tokens and 5 gaps.
    assert delta[f"{p}generation_tokens_total"] == 5 * 6
    assert delta[f"{p}inter_token_latency_seconds_count"] == 5 * 5

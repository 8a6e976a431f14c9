"""The server's logprobs through the official openai client on loopback, checked
against the library's own outputs for the same requests (n: test_server_n.py;
response_format: test_server_structured.py)."""
from __future__ import annotations


import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from http_servers import tiny_server  # noqa: E402
from sarathi_rt import LLM, SamplingParams  # noqa: E402
from sarathi_rt.server import OpenAIServer  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server on loopback

CONV = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served():
    with tiny_server() as served:
        yield served


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1], api_key="none", max_retries=0, timeout=60)


def _expected(server: OpenAIServer, prompt: list[int], **params):
    """What the library returns for the same request (the engine is shared: run it
    while the server is idle, through a second LLM on the same weights)."""
    llm = LLM("tiny", tokenizer=server.llm.tokenizer, num_kv_blocks=64, block_size=8)
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_completion_logprobs_whole_and_streamed(served, client: openai.OpenAI) -> None:
    server, _ = served
    args = dict(model="tiny", prompt="hello world", max_tokens=6, temperature=0.7, seed=11, logprobs=3,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    prompt = server.llm.tokenizer.encode("hello world", parse_special=False)
    ref = _expected(server, prompt, max_tokens=6, temperature=0.7, seed=11, logprobs=3, ignore_eos=True)
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-6)
    assert [len(top) for top in lp.top_logprobs] == [3] * 6
    token_text = server._token_text
    assert lp.tokens == [token_text(t) for t in ref.token_ids]
    assert [sorted(top.values(), reverse=True) for top in lp.top_logprobs] == \
        [pytest.approx([v for _, v in x.top], abs=1e-6) for x in ref.logprobs]
    chunks = list(client.completions.create(stream=True, **args))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_chat_logprobs_whole_and_streamed(served, client: openai.OpenAI) -> None:
    server, _ = served
    args = dict(model="tiny", messages=CONV, max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=2,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    prompt = server.llm.tokenizer.apply_chat_template(CONV)
    ref = _expected(server, prompt, max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-6)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
               for c in content)
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    assert all(bytes(c.bytes).decode(errors="replace") == c.token for c in content)  # bytes: the token's own
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == [c.logprob for c in content]
    plain = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logprobs_stop_where_a_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    """The tokens scored are those whose text starts inside the returned text: a token the
    stop string begins inside is kept (its text runs on past the cut), the ones after are
    not; text_offset points into the text. Streamed chunks score the same tokens."""
    args = dict(model="tiny", prompt="json:", max_tokens=4, temperature=0.0, logprobs=1,
                extra_body={"ignore_eos": True})
    tokens = client.completions.create(**args).choices[0].logprobs.tokens
    full = "".join(tokens)
    assert full.isascii() and full.isprintable()  # the tiny model's answer: one character per byte
    starts = [len("".join(tokens[:i])) for i in range(len(tokens))]
    for stop in (tokens[-1], full[-3:], full[-1]):  # cuts at a token's start and inside tokens
        cut = full.index(stop)
        assert cut > 0
        kept = [i for i, start in enumerate(starts) if start < cut]
        whole = client.completions.create(stop=[stop], **args).choices[0]
        assert whole.text == full[:cut] and whole.finish_reason == "stop"
        lp = whole.logprobs
        assert lp.tokens == [tokens[i] for i in kept] and lp.text_offset == [starts[i] for i in kept]
        assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(kept)
        chunks = [c.choices[0] for c in client.completions.create(stop=[stop], stream=True, **args)]
        assert "".join(c.text for c in chunks) == whole.text
        assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens
        assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


def test_logprobs_of_partial_characters(served, client: openai.OpenAI) -> None:
    """The tiny model's greedy answer to CONV is mostly lone bytes of UTF-8 characters,
    whose text is U+FFFD: chat reports each token's own byte (joined, they decode to the
    answer), and a completion's top_logprobs keep every alternative, those sharing a
    text keyed "token_id:<id>"."""
    server, _ = served
    args = dict(model="tiny", max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(messages=CONV, logprobs=True, top_logprobs=5, **args).choices[0]
    entries = [e for c in chat.logprobs.content for e in (c, *c.top_logprobs)]
    partial = [e for e in entries if e.token == "\ufffd"]
    assert partial and all(len(e.bytes) == 1 and e.bytes[0] >= 0x80 for e in partial)
    assert b"".join(bytes(c.bytes) for c in chat.logprobs.content).decode(errors="replace") == chat.message.content
    whole = client.completions.create(prompt="hello", logprobs=5, **args).choices[0]
    prompt = server.llm.tokenizer.encode("hello", parse_special=False)
    ref = _expected(server, prompt, max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True)
    tops = whole.logprobs.top_logprobs
    assert any(key.startswith("token_id:") for top in tops for key in top)  # some texts were shared
    for top, x in zip(tops, ref.logprobs, strict=True):
        assert len(top) == 5
        for i, v in x.top:  # each alternative once: by its text, or by its id where that is shared
            assert top.get(f"token_id:{i}", top.get(server._token_text(i))) == pytest.approx(v, abs=1e-6)


@pytest.mark.parametrize("call, kwargs, param", [
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("chat", {"messages": CONV, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"messages": CONV, "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_are_400s_naming_the_field(served, client: openai.OpenAI, call: str, kwargs: dict,
                                                param: str) -> None:
    create = client.completions.create if call == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError, match=param):
        create(model="tiny", max_tokens=2, **kwargs)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_logprobs_are_vllms_and_the_librarys(served, client: openai.OpenAI, chat: bool) -> None:
    """vLLM's extra field: each choice (and a stream's first chunk of each choice) carries
    None for the first prompt token, then {token id: {logprob, rank, decoded_token}} for
    the prompt's token and its alternatives, as the library scores them."""
    server, _ = served
    tok = server.llm.tokenizer
    create = client.chat.completions.create if chat else client.completions.create
    where = dict(messages=CONV) if chat else dict(prompt="hello world")
    prompt = tok.apply_chat_template(CONV) if chat else tok.encode("hello world", parse_special=False)
    args = dict(model="tiny", max_tokens=3, temperature=0.0, n=2, extra_body={"ignore_eos": True, "prompt_logprobs": 2},
                **where)
    ref = _expected(server, prompt, max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2).prompt_logprobs
    whole = create(**args)
    for choice in whole.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert len(got) == len(prompt) and got[0] is None
        for token, entry, lp in zip(prompt[1:], got[1:], ref[1:]):
            assert entry[str(token)]["logprob"] == pytest.approx(lp.logprob, abs=1e-6)
            assert entry[str(token)]["decoded_token"] == server._token_text(token)
            for rank, (i, v) in enumerate(lp.top, 1):
                assert entry[str(i)]["rank"] == rank and entry[str(i)]["logprob"] == pytest.approx(v, abs=1e-6)
            assert set(entry) == {str(token)} | {str(i) for i, _ in lp.top}
    firsts = {}
    for chunk in create(stream=True, **args):
        for choice in chunk.choices:
            if choice.index not in firsts:
                firsts[choice.index] = (choice.model_extra or {}).get("prompt_logprobs")
            else:
                assert (choice.model_extra or {}).get("prompt_logprobs") is None  # the first chunk only
    assert firsts == {c.index: c.model_extra["prompt_logprobs"] for c in whole.choices}


def test_bad_prompt_logprobs_are_400_naming_it(served, client: openai.OpenAI) -> None:
    for value in (-1, 21, "2"):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": value})
        assert err.value.body["param"] == "prompt_logprobs"

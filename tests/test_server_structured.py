"""response_format over HTTP with the official openai client: json_schema and
json_object answers parse and validate, "text" is free, a schema xgrammar rejects and a
server without the extra answer 400 naming response_format, and the server goes on."""
from __future__ import annotations

import json
import sys

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from http_servers import running  # noqa: E402
from structured_schemas import schemas  # noqa: E402
from text_models import tiny_tokenizer  # noqa: E402
from sarathi_rt import LLM  # noqa: E402
from sarathi_rt.server import OpenAIServer  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server on loopback

CONV = [{"role": "user", "content": "give me json"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

COUNTS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}  # ASCII only: each token's text is whole


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def url():
    llm = LLM("tiny", tokenizer=tiny_tokenizer(), num_kv_blocks=256, block_size=8, token_budget=64, max_num_seqs=16)
    with running(OpenAIServer(llm, "tiny").app) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)


def test_chat_and_completions_follow_the_schema(client: openai.OpenAI) -> None:
    for seed, schema in enumerate([PERSON] + schemas()[16:20]):
        chat = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=160, seed=seed,
                                              response_format=_fmt(schema))
        choice = chat.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    whole = client.completions.create(model="tiny", prompt="json:", max_tokens=160, temperature=0.0,
                                      extra_body={"response_format": _fmt(PERSON)})
    jsonschema.validate(json.loads(whole.choices[0].text), PERSON)


def test_streamed_json_schema_joins_to_a_valid_value(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=160, seed=5, stream=True,
                                            response_format=_fmt(PERSON))
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_logprobs_cover_the_answer_not_its_end_token(client: openai.OpenAI) -> None:
    """The grammar ends the answer with the eos token, which has no text: no logprobs,
    so the tokens scored spell the content exactly, whole and streamed."""
    args = dict(model="tiny", max_tokens=40, seed=3, extra_body={"response_format": _fmt(COUNTS)})
    chat = client.chat.completions.create(messages=CONV, logprobs=True, **args).choices[0]
    tokens = [c.token for c in chat.logprobs.content]
    assert chat.finish_reason == "stop" and "".join(tokens) == chat.message.content
    json.loads(chat.message.content)
    chunks = [c.choices[0] for c in client.chat.completions.create(messages=CONV, logprobs=True, stream=True, **args)]
    assert [c.token for ch in chunks if ch.logprobs for c in ch.logprobs.content] == tokens
    text = client.completions.create(prompt="json:", logprobs=0, **args).choices[0]
    assert text.finish_reason == "stop" and "".join(text.logprobs.tokens) == text.text
    tokens = text.logprobs.tokens
    assert text.logprobs.text_offset == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_json_object_and_text(client: openai.OpenAI) -> None:
    """json_object gives an object whenever it completes within max_tokens (a random
    model may nest without end, hence several seeds); "text" is the free answer."""
    done = []
    for seed in range(6):
        out = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=96, seed=seed,
                                             response_format={"type": "json_object"}).choices[0]
        assert out.message.content.startswith("{")
        if out.finish_reason == "stop":
            done.append(json.loads(out.message.content))
    assert done and all(isinstance(d, dict) for d in done)
    free = dict(model="tiny", messages=CONV, max_tokens=12, temperature=0.0)
    assert client.chat.completions.create(**free, response_format={"type": "text"}).choices[0].message.content == \
        client.chat.completions.create(**free).choices[0].message.content


@pytest.mark.parametrize("response_format, message", [
    (_fmt({"type": "nonsense"}), "xgrammar supports"),
    ({"type": "json_schema"}, "json_schema is required"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}, "extra"),
    (_fmt({"type": "object", "required": ["zz"], "additionalProperties": False}), "has no value"),
])
def test_bad_formats_are_400_naming_response_format(client: openai.OpenAI, response_format: dict,
                                                    message: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CONV, max_tokens=8, response_format=response_format)
    assert message in err.value.message and err.value.body["param"] == "response_format"
    assert client.chat.completions.create(model="tiny", messages=CONV, max_tokens=4).choices[0].finish_reason


@pytest.mark.parametrize("response_format", [_fmt(PERSON), {"type": "json_object"}])
def test_stop_strings_with_a_schema_are_400_naming_stop(client: openai.OpenAI, response_format: dict) -> None:
    """A stop string would cut the value short: a "stop" answer that does not parse."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CONV, max_tokens=8, stop=["{"],
                                       response_format=response_format)
    assert "stop strings cannot be combined" in err.value.message and err.value.body["param"] == "stop"
    assert client.chat.completions.create(model="tiny", messages=CONV, max_tokens=4, stop=["{"]).choices[0]


def test_without_the_extra_a_400_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    llm = LLM("tiny", tokenizer=tiny_tokenizer(), num_kv_blocks=64, block_size=8, token_budget=32)
    with running(OpenAIServer(llm, "tiny").app) as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=CONV, max_tokens=8,
                                           response_format={"type": "json_object"})
        assert "sarathi_rt[structured]" in err.value.message and err.value.body["param"] == "response_format"
        assert client.chat.completions.create(model="tiny", messages=CONV, max_tokens=4).choices[0].finish_reason

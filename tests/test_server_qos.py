"""The server's service tiers: the official openai client sends service_tier, which
selects the request's QoS class; responses echo it; an unknown tier is a 400 and the
server keeps serving; /metrics counts attainment and relegations per class, a request of
n samples once."""
from __future__ import annotations


import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from http_servers import running  # noqa: E402
from metrics_text import scrape  # noqa: E402
from text_models import tiny_tokenizer  # noqa: E402
from sarathi_rt import LLM, SamplingParams  # noqa: E402
from sarathi_rt.scheduler import QoSClass  # noqa: E402
from sarathi_rt.server import OpenAIServer  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server on loopback

TIERS = {"priority": QoSClass(ttft=30.0, tbt=10.0, priority=2), "default": QoSClass(ttft=60.0, tbt=10.0, priority=1),
         "flex": QoSClass(ttft=1e-6, tbt=1e-6)}  # flex: hopeless, so always relegated
GREEDY = {"temperature": 0.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served():
    llm = LLM("tiny", tokenizer=tiny_tokenizer(), num_kv_blocks=128, block_size=8, token_budget=64, max_num_seqs=16,
              qos_classes=TIERS, default_qos="default")
    expected = llm.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0].text
    server = OpenAIServer(llm, "tiny")
    with running(server.app) as url:
        yield url, expected


def test_service_tier_selects_the_class_and_is_echoed(served) -> None:
    base, expected = served
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    for tier, echoed in [(None, "default"), ("auto", "default"), ("priority", "priority"), ("flex", "flex")]:
        # the client's legacy completions take no service_tier argument: it goes in the body
        body = {"ignore_eos": True} | ({} if tier is None else {"service_tier": tier})
        out = client.completions.create(model="tiny", prompt="hello world", **GREEDY | {"extra_body": body})
        assert out.choices[0].text == expected and out.service_tier == echoed  # same output in every tier
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **GREEDY}
    whole = client.chat.completions.create(service_tier="flex", **chat)
    chunks = list(client.chat.completions.create(stream=True, service_tier="priority", **chat))
    assert whole.service_tier == "flex" and chunks and all(c.service_tier == "priority" for c in chunks)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(service_tier="gold", **chat)  # type: ignore[arg-type]
    assert "service_tier" in str(err.value) and err.value.body["param"] == "service_tier"
    assert client.completions.create(model="tiny", prompt="hello world", **GREEDY).choices[0].text == expected
    metrics = scrape(base)
    assert metrics['sarathi_rt:qos_requests_total{qos_class="default"}'] == 3
    assert metrics['sarathi_rt:qos_requests_total{qos_class="priority"}'] == 2
    assert metrics['sarathi_rt:qos_attainment{qos_class="default"}'] == 1.0
    assert metrics['sarathi_rt:qos_relegated_total{qos_class="flex"}'] == 2
    assert metrics['sarathi_rt:qos_attained_total{qos_class="flex"}'] == 0


def test_metrics_count_an_n_request_once_per_class(served) -> None:
    base, _ = served
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    before = scrape(base)
    for tier in ("flex", "default"):
        body = {"ignore_eos": True, "service_tier": tier}
        out = client.completions.create(model="tiny", prompt="hello world", n=3, **GREEDY | {"extra_body": body})
        assert len(out.choices) == 3
    after = scrape(base)
    delta = {name: after[name] - before[name] for name in after if name.startswith("sarathi_rt:qos_")}
    for tier, attained, relegated in (("flex", 0, 1), ("default", 1, 0)):  # every sample of flex is relegated
        assert delta[f'sarathi_rt:qos_requests_total{{qos_class="{tier}"}}'] == 1
        assert delta[f'sarathi_rt:qos_attained_total{{qos_class="{tier}"}}'] == attained
        assert delta[f'sarathi_rt:qos_relegated_total{{qos_class="{tier}"}}'] == relegated


def test_a_server_without_classes_takes_auto_only() -> None:
    server = OpenAIServer(LLM("tiny", num_kv_blocks=32), "tiny")
    from sarathi_rt.server.protocol import CompletionRequest
    from sarathi_rt.server.app import ApiError

    assert server._tier(CompletionRequest(prompt=[5, 6], service_tier="auto")) == "default"
    with pytest.raises(ApiError, match=r"service_tier must be one of \['auto'\]"):
        server._qos(CompletionRequest(prompt=[5, 6], service_tier="priority"))


def test_serve_command_reads_qos_classes(tmp_path, capsys) -> None:
    from sarathi_rt.cli import main
    from sarathi_rt.commands.serve import DEFAULT_SERVICE_TIERS

    assert list(DEFAULT_SERVICE_TIERS) == ["priority", "default", "flex"]
    bad = tmp_path / "tiers.json"
    bad.write_text('{"chat": {"ttft": 0, "tbt": 0.1}}')
    assert main(["serve", "--model", "tiny", "--qos-classes", str(bad)]) == 2
    assert "qos_classes['chat']: ttft must be" in capsys.readouterr().err
    bad.write_text("{chat")
    assert main(["serve", "--model", "tiny", "--qos-classes", str(bad)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err

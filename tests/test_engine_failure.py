"""A failed engine (the model raising inside a step; a killed worker: test_distributed.py)
ends every request, frees every KV block and refuses new requests; the server then says
so on /health (503 with the cause), answers streams with an error event and whole
responses with a 500 naming the cause, refuses new requests with 503, and shuts down by
itself so that `sarathi-rt serve` exits non-zero for a supervisor to restart it."""
from __future__ import annotations

import threading

import pytest

from sarathi_rt import LLM, SamplingParams

from engine_faults import Boom, break_after
from http_servers import start_draining
from text_models import tiny_tokenizer

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
OPTS = dict(num_kv_blocks=64, block_size=8, token_budget=32, chunk_size=16, max_num_seqs=8)


def test_a_forward_that_raises_ends_every_request_and_frees_every_block() -> None:
    llm = LLM("tiny", **OPTS)
    engine = llm.engine
    for i in range(5):
        engine.add_request(i, list(range(3, 3 + 7 * (i + 1))), GREEDY)
    engine.step()
    break_after(engine, 1)
    with pytest.raises(Boom):
        while engine.has_unfinished():
            engine.step()
    assert isinstance(engine.failure, Boom)
    assert not engine.has_unfinished() and engine.num_unfinished == 0
    assert engine.scheduler.num_free_blocks == OPTS["num_kv_blocks"]
    assert engine.scheduler.num_plans_in_flight == 0
    with pytest.raises(RuntimeError, match="engine stopped after its executor failed: the forward raised"):
        engine.add_request("late", [5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="engine stopped after its executor failed"):
        engine.step()


httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")


@pytest.mark.slow
def test_the_server_reports_a_failed_engine_and_shuts_down() -> None:
    from sarathi_rt.server import OpenAIServer

    llm = LLM("tiny", tokenizer=tiny_tokenizer(), **OPTS)
    server = OpenAIServer(llm, "tiny")
    uv, thread, base = start_draining(server)
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=60) as client:
        assert client.get("/health").json() == {"status": "ok"}
        break_after(llm.engine, 4)  # the stream's and the whole request's first steps run
        results: dict[str, object] = {}

        def whole() -> None:
            results["whole"] = client.post("/v1/completions", json=body)

        waiter = threading.Thread(target=whole)
        waiter.start()
        with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        waiter.join(timeout=60)
        assert any("the forward raised" in e and "server_error" in e for e in events), events
        assert events[-1] == "data: [DONE]"
        response = results["whole"]
        assert response.status_code == 500, response.text  # type: ignore[union-attr]
        assert "the engine failed: the forward raised" in response.json()["error"]["message"]  # type: ignore[union-attr]
        # Until the drain ends, /health and new requests say why (the server may already be gone).
        try:
            health = client.get("/health")
            assert health.status_code == 503 and "the forward raised" in health.json()["error"]
            late = client.post("/v1/completions", json=body)
            assert late.status_code == 503 and "the engine failed" in late.json()["error"]["message"]
        except httpx.TransportError:
            pass
    thread.join(timeout=30)
    assert not thread.is_alive(), "the server did not shut itself down"
    assert uv.engine_failed
    assert llm.engine.scheduler.num_free_blocks == OPTS["num_kv_blocks"]
    # Each failed request counted once, as an error (not also as an abort); the late one as refused.
    from metrics_text import samples

    got = samples(server.stats.render()[0].decode())
    assert got['sarathi_rt:request_failures_total{reason="error"}'] == 2
    assert got['sarathi_rt:request_success_total{finished_reason="abort"}'] == 0

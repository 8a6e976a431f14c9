"""A response_format json_schema too costly to compile (issue 43), over HTTP on loopback:
refused by its complexity before any compile (400 naming response_format), or by the
compile time limit while the server goes on serving; a client that leaves while its
schema compiles adds no request; a drain or a SIGTERM never waits for a compile."""
from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

from gguf_models import write_tokenizer_gguf  # noqa: E402
from http_servers import serve_process, start_draining  # noqa: E402
from metrics_text import scrape  # noqa: E402
from test_grammar_limits import issue_schema  # noqa: E402
from text_models import tiny_tokenizer  # noqa: E402
from sarathi_rt import LLM  # noqa: E402
from sarathi_rt.server import Limits, OpenAIServer  # noqa: E402

pytestmark = pytest.mark.slow  # starts servers on loopback

BLOCKS = 64
BOOL = {"type": "boolean"}


def _body(schema: dict, **extra: object) -> dict:
    return {"prompt": "json:", "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}} | extra


class Served:
    """An OpenAIServer on a DrainingServer thread, its engine's compiles counted and
    slowed by `delay` seconds each."""

    def __init__(self, limits: Limits, delay: float = 0.0, shutdown_timeout: float = 5.0) -> None:
        self.llm = LLM("tiny", tokenizer=tiny_tokenizer(), num_kv_blocks=BLOCKS, block_size=8, token_budget=32)
        self.compiles: list[threading.Thread] = []
        compile_grammar = self.llm.engine.compile_grammar

        def slow(schema: str) -> None:
            self.compiles.append(threading.current_thread())
            time.sleep(delay)
            compile_grammar(schema)

        self.llm.engine.compile_grammar = slow  # type: ignore[method-assign]
        self.server = OpenAIServer(self.llm, "tiny", limits=limits)
        self.uv, self.thread, self.base = start_draining(self.server, shutdown_timeout)

    def post(self, body: dict, timeout: float = 30) -> httpx.Response:
        return httpx.post(self.base + "/v1/completions", json=body, timeout=timeout)

    def stop(self) -> float:
        """Shut down; the seconds it took."""
        start = time.monotonic()
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"
        return time.monotonic() - start


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    one = Served(*request.param)
    yield one
    if one.thread.is_alive():
        one.stop()


def _error(r: httpx.Response, status: int, param: str | None = "response_format") -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    return error["message"]


@pytest.mark.parametrize("served", [(Limits(),)], indirect=True)
def test_a_schema_over_the_complexity_limit_is_400_before_any_compile(served: Served) -> None:
    """The issue's ~1 MB schema (4000 properties, n=16): refused at once, nothing compiled."""
    body = _body(issue_schema(4000), n=16)
    assert 500_000 < len(json.dumps(body)) < (4 << 20)
    start = time.monotonic()
    message = _error(served.post(body), 400)
    assert time.monotonic() - start < 5 and not served.compiles
    assert "json_schema is too complex to compile" in message and "over the limit of 20000" in message
    assert json.loads(served.post(_body(BOOL)).json()["choices"][0]["text"]) in (True, False)
    assert len(served.compiles) == 1


@pytest.mark.parametrize("served", [(Limits(compile_timeout=0.5, max_compiles=1), 2.0)], indirect=True)
def test_a_compile_past_the_time_limit_is_400_and_the_server_goes_on(served: Served) -> None:
    start = time.monotonic()
    message = _error(served.post(_body(BOOL)), 400)
    assert "took longer than 0.5 s to compile" in message and time.monotonic() - start < 1.5
    assert served.compiles[0].is_alive()  # still compiling, unwatched: others are served meanwhile
    assert httpx.get(served.base + "/health").json() == {"status": "ok"}
    assert served.post({"prompt": "hi", "max_tokens": 2}).json()["choices"][0]["finish_reason"] == "length"
    r = served.post(_body({"type": "null"}))  # the one slot stays taken: 503, no second thread
    assert "compile slots stayed busy" in _error(r, 503) and r.json()["error"]["type"] == "server_overloaded"
    served.compiles[0].join(timeout=10)
    assert served.post(_body(BOOL)).status_code == 200  # compiled late, and cached
    assert len(served.compiles) == 1 and served.llm.engine.scheduler.num_free_blocks == BLOCKS


def _aborts(served: Served) -> float:
    return scrape(served.base).get('sarathi_rt:request_success_total{finished_reason="abort"}', 0.0)


@pytest.mark.parametrize("served", [(Limits(), 1.5)], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_its_schema_compiles_adds_nothing(served: Served, stream: bool) -> None:
    aborts = _aborts(served)
    with pytest.raises(httpx.ReadTimeout):
        served.post(_body(BOOL, stream=stream), timeout=0.5)
    served.compiles[0].join(timeout=10)
    time.sleep(0.2)
    assert _aborts(served) == aborts + 1
    assert not served.llm.engine.has_unfinished() and served.llm.engine.scheduler.num_free_blocks == BLOCKS
    assert not served.server._live and not served.server._admitting


@pytest.mark.parametrize("served", [(Limits(compile_timeout=60), 60.0, 30.0)], indirect=True)
def test_shutdown_does_not_wait_for_a_compile(served: Served) -> None:
    """A drain of 30 s: the request compiling is refused at once, and the server stops."""
    results: list[httpx.Response] = []
    client = threading.Thread(target=lambda: results.append(served.post(_body(BOOL), timeout=60)))
    client.start()
    while not served.compiles:
        time.sleep(0.02)
    assert served.stop() < 5
    client.join(timeout=10)
    assert results[0].status_code == 503 and results[0].json()["error"]["type"] == "server_shutting_down"
    assert served.compiles[0].is_alive() and served.compiles[0].daemon
    assert not served.llm.engine.has_unfinished()


def test_serve_exits_on_sigterm_while_a_real_compile_runs(tmp_path: Path) -> None:
    """1500 optional properties: about 6 s of xgrammar's C++ on a 2-core machine (the
    limit raised to let it in). SIGTERM mid-compile: the process exits 0 within seconds."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}
    with serve_process("--model", "tiny", "--tokenizer", str(write_tokenizer_gguf(tmp_path / "bpe.gguf")),
                       "--threads", "1", "--num-kv-blocks", "64", "--max-schema-complexity", "1000000",
                       "--compile-timeout", "60", "--shutdown-timeout", "30") as (proc, base):
        results: list[httpx.Response] = []
        client = threading.Thread(target=lambda: results.append(
            httpx.post(base + "/v1/completions", json=_body(schema), timeout=60)))
        client.start()
        time.sleep(1.0)  # parsed, checked and compiling
        assert not results
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0 and time.monotonic() - start < 5
        client.join(timeout=10)
        assert results[0].status_code == 503 and results[0].json()["error"]["type"] == "server_shutting_down"
        assert "Traceback" not in proc.stderr.read()

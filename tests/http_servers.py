"""Running an OpenAIServer's app on loopback for a test module, on a thread of its own
(plain uvicorn, or the DrainingServer `sarathi-rt serve` runs); `sarathi-rt serve` in a
process of its own; the tiny random-weight server the feature tests share."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from text_models import tiny_tokenizer


@contextmanager
def running(app: object) -> Iterator[str]:
    """Serves `app` on 127.0.0.1 at a free port; yields its base URL (".../v1") and
    stops it (asserting that it stopped) on exit."""
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    host, port = uv.servers[0].sockets[0].getsockname()[:2]
    assert host == "127.0.0.1"
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive(), "the server did not stop"


@contextmanager
def tiny_server(num_kv_blocks: int = 256) -> Iterator[tuple[object, str]]:
    """An OpenAIServer over the tiny random-weight model (8-token blocks, budget 64, 32
    sequences) on loopback: yields (server, base URL)."""
    from sarathi_rt import LLM
    from sarathi_rt.server import OpenAIServer

    llm = LLM("tiny", tokenizer=tiny_tokenizer(), num_kv_blocks=num_kv_blocks, block_size=8, token_budget=64,
              max_num_seqs=32)
    server = OpenAIServer(llm, "tiny", max_waiting=64)
    with running(server.app) as url:
        yield server, url


def start_draining(server: Any, shutdown_timeout: float = 5.0) -> tuple[Any, threading.Thread, str]:
    """`server` (an OpenAIServer) behind a DrainingServer on 127.0.0.1, on a thread:
    returns (the DrainingServer, its thread, the base URL without /v1) once it listens."""
    from sarathi_rt.server import DrainingServer

    uv = DrainingServer(server, "127.0.0.1", 0, shutdown_timeout, log_level="warning")
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return uv, thread, f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(*flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`sarathi-rt serve --port <free port> *flags` in a process of its own: yields (the
    process, its base URL) once /health answers; kills it on exit if it still runs."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sarathi_rt.cli", "serve", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

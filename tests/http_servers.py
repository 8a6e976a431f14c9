"""Running an OpenAIServer's app on loopback for a test module, on a thread of its own."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


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

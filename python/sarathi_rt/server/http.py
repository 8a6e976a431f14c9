"""The HTTP layer around the app: a bound on request bodies, and a uvicorn server whose
shutdown drains the OpenAIServer instead of cancelling its streams mid-body."""
from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from .protocol import error_body

if TYPE_CHECKING:
    from .app import OpenAIServer

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# How long past the drain uvicorn waits for connections before it cancels their tasks:
# only a stream the drain could not end (a client that stopped reading) is left by then.
CANCEL_GRACE_SECONDS = 10.0


class BodyLimit:
    """Answers 413 to a request whose body is over `max_bytes` (its Content-Length, or
    what arrives). The body is read here and handed on whole, so the app never holds
    more than the limit; the rest of a refused one is read and dropped, since a client
    still sending when the connection closes would miss the answer."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refuse: Callable[[], None]) -> None:
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        body = bytearray()
        too_large = not length.isdigit() or int(length) > self.max_bytes
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if not too_large:
                body += message.get("body", b"")
                too_large = len(body) > self.max_bytes
            more = message.get("more_body", False)
        if too_large:
            return await self._refuse(send)
        handed = False

        async def replay() -> Message:  # the whole body once, then the connection's own messages
            nonlocal handed
            if handed:
                return await receive()
            handed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        self.on_refuse()
        content = json.dumps(error_body(f"the request body is over {self.max_bytes} bytes "
                                        "(the server's --max-request-bytes)", param=None)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGINT, SIGTERM, should_exit) stops listening
    and closes idle connections at once, then drains `server` for `shutdown_timeout`
    seconds (see OpenAIServer.drain) before uvicorn's own shutdown. It shuts down by
    itself once the engine has failed (`engine_failed`; the command then exits non-zero)."""

    def __init__(self, server: OpenAIServer, host: str, port: int, shutdown_timeout: float,
                 log_level: str = "info") -> None:
        if not shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout!r}")
        self.server, self.shutdown_timeout = server, shutdown_timeout
        super().__init__(uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=shutdown_timeout + CANCEL_GRACE_SECONDS))

    @property
    def engine_failed(self) -> bool:
        return self.server.llm.engine.failure is not None

    async def on_tick(self, counter: int) -> bool:
        if self.engine_failed:  # nothing more can be served: drain what is left and exit
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for listener in self.servers:
            listener.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle keep-alive ones close; busy ones close after their response
        await self.server.drain(self.shutdown_timeout)
        await super().shutdown(sockets)

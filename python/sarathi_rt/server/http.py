"""The HTTP layer below the app: a bound on request bodies, as ASGI middleware."""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from .protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


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

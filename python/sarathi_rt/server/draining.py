"""The uvicorn server above the app: its shutdown drains the OpenAIServer instead of
cancelling its streams mid-body."""
from __future__ import annotations

import socket

import uvicorn

from .app import OpenAIServer

# How long past the drain uvicorn waits for connections before it cancels their tasks:
# only a stream the drain could not end (a client that stopped reading) is left by then.
CANCEL_GRACE_SECONDS = 10.0


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

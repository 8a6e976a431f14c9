"""The OpenAI-compatible HTTP API over an AsyncLLMEngine: /v1/completions and
/v1/chat/completions (whole responses, or server-sent events ending in `data: [DONE]`),
/v1/models, /health and /metrics.

Every request owns one engine request. It is aborted, and its KV blocks freed, as soon as
its client goes away: a closed stream, or a disconnect while a whole response is being
generated. Bad input is answered with HTTP 400 and an OpenAI-style error body; when more
than `max_waiting` requests already wait for their first step the server answers 503
instead of queueing without bound."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from sarathi_rt.engine import AsyncLLMEngine, RequestOutput
from sarathi_rt.llm import LLM

from .protocol import ChatRequest, CompletionRequest, SamplingRequest, completion_body, error_body, usage
from .stats import ServerStats


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


class OpenAIServer:
    """Serves `llm` (its engine and tokenizer) as `model_name`."""

    def __init__(self, llm: LLM, model_name: str, max_waiting: int = 256) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.llm, self.model_name, self.max_waiting = llm, model_name, max_waiting
        self._admitting = 0  # requests between the overload check and the engine's queue
        self.engine = AsyncLLMEngine(llm.engine)
        self.stats = ServerStats()
        self.created = int(time.time())
        self.app = self._build()

    # ------------------------------------------------------------------ routes
    def _build(self) -> FastAPI:
        app = FastAPI(title="sarathi_rt", version="1")
        app.state.server = self

        @app.exception_handler(ApiError)
        async def api_error(_: Request, exc: ApiError) -> JSONResponse:
            if exc.status in (400, 404, 503):  # 499: the client left, counted as "abort"
                self.stats.requests["overloaded" if exc.status == 503 else "bad_request"] += 1
            return JSONResponse(error_body(str(exc), exc.kind, exc.param), status_code=exc.status)

        @app.exception_handler(RequestValidationError)
        async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            self.stats.requests["bad_request"] += 1
            first = exc.errors()[0] if exc.errors() else {}
            param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
            message = "; ".join(f"{'.'.join(map(str, e.get('loc', ())[1:])) or 'body'}: {e.get('msg')}"
                                for e in exc.errors())
            return JSONResponse(error_body(message or "invalid request", param=param), status_code=400)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "sarathi_rt",
                                                "max_model_len": self.llm.engine.max_model_len}]}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(self.stats.render(self.llm.engine), media_type="text/plain; version=0.0.4")

        @app.post("/v1/completions", response_model=None)
        async def completions(body: CompletionRequest, request: Request) -> Any:
            prompt = body.prompt
            if isinstance(prompt, str):
                if self.llm.tokenizer is None:
                    raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
                prompt = self.llm.tokenizer.encode(prompt)
            return await self._serve(body, list(prompt), request, chat=False)  # type: ignore[arg-type]

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(body: ChatRequest, request: Request) -> Any:
            if self.llm.tokenizer is None or self.llm.tokenizer.chat_template is None:
                raise ApiError(400, "this model has no chat template", param="messages")
            try:
                prompt = self.llm.tokenizer.apply_chat_template(body.conversation(), add_generation_prompt=True)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            return await self._serve(body, prompt, request, chat=True)  # type: ignore[arg-type]

        return app

    # ------------------------------------------------------------------ requests
    async def _serve(self, body: SamplingRequest, prompt: list[int], request: Request, chat: bool) -> Any:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           kind="model_not_found", param="model")
        # Requests still on their way into the engine (waiting for the step in progress to
        # release it) count as waiting too, or a burst would all pass this check at once.
        if self.llm.engine.scheduler.num_waiting + self._admitting >= self.max_waiting:
            raise ApiError(503, f"the server is overloaded ({self.max_waiting} requests waiting); retry later",
                           kind="server_overloaded")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self._admitting += 1
        try:
            params = body.sampling_params(max(1, self.llm.engine.max_model_len - len(prompt)))
            queue = await self.engine.add_request(request_id, prompt, params)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        finally:
            self._admitting -= 1
        outputs = self._outputs(request_id, queue)
        if body.stream:
            return StreamingResponse(self._events(request_id, outputs, chat, body.include_usage),
                                     media_type="text/event-stream")
        watcher = asyncio.create_task(self._abort_on_disconnect(request, request_id))
        try:
            last = None
            async for last in outputs:
                pass
        finally:
            watcher.cancel()
        assert last is not None
        if last.finish_reason == "abort":
            raise ApiError(499, "the request was aborted", kind="aborted")
        response = completion_body(request_id, self.model_name, chat, last.text, last.finish_reason, stream=False)
        return response | {"usage": usage(len(prompt), len(last.token_ids))}

    async def _outputs(self, request_id: str, queue: asyncio.Queue[RequestOutput | Exception]
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, counted by how they end; if the consumer stops early,
        the engine aborts the request."""
        finished = False
        try:
            async with contextlib.aclosing(self.engine.outputs(request_id, queue)) as outputs:  # abort now
                async for out in outputs:
                    finished = out.finished
                    if finished:
                        self.stats.finished(out.finish_reason or "abort", out.metrics)
                    yield out
        finally:
            if not finished:
                self.stats.requests["abort"] += 1

    async def _events(self, request_id: str, outputs: AsyncIterator[RequestOutput], chat: bool,
                      include_usage: bool) -> AsyncIterator[str]:
        """One server-sent event per generated token (its text may be empty while a
        character or a possible stop string is incomplete), then usage and [DONE]."""
        last = None
        try:
            async for out in outputs:
                chunk = completion_body(request_id, self.model_name, chat, out.new_text,
                                        out.finish_reason, stream=True, role=chat and last is None)
                last = out
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:  # the engine failed: tell the client, then end the stream
            self.stats.requests["error"] += 1
            yield f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n"
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        if include_usage and last is not None:
            chunk = completion_body(request_id, self.model_name, chat, None, None, stream=True)
            chunk["choices"] = []
            yield f"data: {json.dumps(chunk | {'usage': usage(len(last.prompt_token_ids), len(last.token_ids))})}\n\n"
        yield "data: [DONE]\n\n"

    async def _abort_on_disconnect(self, request: Request, request_id: str) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        await self.engine.abort(request_id)

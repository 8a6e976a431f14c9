"""The OpenAI-compatible HTTP API over an AsyncLLMEngine: /v1/completions and
/v1/chat/completions (whole responses, or server-sent events ending in `data: [DONE]`),
/v1/models, /health and /metrics.

Every request owns one engine request (with `n` > 1, n samples of it, prefilled once, each
a choice with its `index`; streamed chunks carry their choice's index and usage counts
every choice's tokens). It is aborted, every sample of it, and its KV blocks freed, as soon as
its client goes away: a closed stream, or a disconnect while a whole response is being
generated. Bad input is answered with HTTP 400 (413 for a body over the limit) and an
OpenAI-style error body, as is every other error; when more than `max_waiting` requests
already wait for their first step the server answers 503 instead of queueing without
bound. Text is tokenized (and chat templates rendered) in a worker thread, so a long
prompt never stalls the event loop that serves every other client.

`drain` ends the server's work at shutdown: new requests get 503, running ones get a
grace period to finish, then each remaining stream ends with an error event and [DONE]
and its request is aborted.

When the engine fails (a worker dies, the model raises inside a step) it ends every
request and frees every KV block: each stream gets an error event naming the cause, each
whole response a 500 naming it; /health turns 503 with the cause and new requests get
503; DrainingServer then shuts the process down with a non-zero exit, so a supervisor
restarts it."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from sarathi_rt.engine import AsyncLLMEngine, RequestOutput
from sarathi_rt.engine.grammar_pool import CompilesBusy
from sarathi_rt.llm import LLM
from sarathi_rt.measure.metrics import RequestMetrics

from .http import BodyLimit
from .protocol import (ChatRequest, CompletionRequest, Limits, SamplingRequest, completion_body, describe,
                       error_body, logprobs_body, prompt_logprobs_body, usage)
from .stats import ServerStats

log = logging.getLogger("uvicorn.error")  # uvicorn's own log, so its level and format apply


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


class ShuttingDown(Exception):
    """Put in a request's output queue when the drain time is over."""


class OpenAIServer:
    """Serves `llm` (its engine and tokenizer) as `model_name`; `limits` bound what one
    request may ask for; docs=True serves /docs and /openapi.json. ttft_slo / tbt_slo
    (seconds): the targets of the goodput /metrics reports; tbt_slo defaults to the
    engine's own (the adaptive budget's). A request's `service_tier` names its QoS class
    among the engine's qos_classes ("auto" or none: default_qos); responses echo it."""

    def __init__(self, llm: LLM, model_name: str, max_waiting: int = 256, limits: Limits | None = None,
                 docs: bool = False, ttft_slo: float | None = None, tbt_slo: float | None = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.llm, self.model_name, self.max_waiting = llm, model_name, max_waiting
        self.limits = Limits() if limits is None else limits
        room = llm.engine.max_model_len - 1  # a prompt must leave a token to generate
        self.max_prompt_tokens = self.limits.max_prompt_tokens or room
        if self.max_prompt_tokens > room:
            raise ValueError(f"max_prompt_tokens must be <= {room} (max_model_len - 1), "
                             f"got {self.max_prompt_tokens}")
        self._admitting = 0  # requests between the overload check and the engine's queue
        self._live: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self.draining = False
        self._drained = asyncio.Event()  # set when the drain begins: schema compiles stop being waited for
        self.engine = AsyncLLMEngine(llm.engine, max_compiles=self.limits.max_compiles,
                                     compile_timeout=self.limits.compile_timeout,
                                     max_schema_complexity=self.limits.max_schema_complexity)
        self.stats = ServerStats(llm.engine, model_name, ttft_slo,
                                 llm.engine.config.tbt_slo if tbt_slo is None else tbt_slo)
        self.created = int(time.time())
        self.app = BodyLimit(self._build(docs), self.limits.max_request_bytes, self._refused_body)

    def _refused_body(self) -> None:
        self.stats.failed("bad_request")

    # ------------------------------------------------------------------ routes
    def _build(self, docs: bool) -> FastAPI:
        hidden: dict[str, Any] = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
        app = FastAPI(title="sarathi_rt", version="1", **hidden)
        app.state.server = self

        @app.exception_handler(ApiError)
        async def api_error(_: Request, exc: ApiError) -> JSONResponse:
            if exc.status in (400, 404, 503):  # 499: the client left, and 500 (the engine failed): counted by _outputs
                self.stats.failed("overloaded" if exc.status == 503 else "bad_request")
            return JSONResponse(error_body(str(exc), exc.kind, exc.param), status_code=exc.status)

        @app.exception_handler(RequestValidationError)
        async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            self.stats.failed("bad_request")
            message, param = describe(list(exc.errors()))
            return JSONResponse(error_body(message, param=param), status_code=400)

        @app.exception_handler(HTTPException)
        async def http_error(_: Request, exc: HTTPException) -> JSONResponse:  # 404, 405 from routing
            self.stats.failed("bad_request")
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

        @app.exception_handler(Exception)
        async def failed(_: Request, exc: Exception) -> JSONResponse:
            self.stats.failed("error")
            return JSONResponse(error_body(f"internal error ({type(exc).__name__})", "server_error"),
                                status_code=500)

        @app.get("/health", response_model=None)
        async def health() -> dict[str, str] | JSONResponse:
            failure = self.llm.engine.failure
            if failure is not None:  # a supervisor restarts the process (it exits non-zero after draining)
                return JSONResponse({"status": "error", "error": f"the engine failed: {failure}"}, status_code=503)
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "sarathi_rt",
                                                "max_model_len": self.llm.engine.max_model_len}]}

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            body, content_type = self.stats.render(request.headers.get("accept", ""))
            return Response(body, media_type=content_type)

        @app.post("/v1/completions", response_model=None)
        async def completions(body: CompletionRequest, request: Request) -> Any:
            with self._admitting_one(body) as arrival:
                prompt = body.prompt
                if isinstance(prompt, str):
                    if self.llm.tokenizer is None:
                        raise ApiError(400, "this model has no tokenizer: send the prompt as token ids",
                                       param="prompt")
                    text, tokenizer, special = prompt, self.llm.tokenizer, body.parse_special_tokens
                    prompt = await self._tokenize(lambda: tokenizer.encode(text, parse_special=special), len(text),
                                                  "prompt")
                queue, request_id = await self._add(body, list(prompt), False, arrival,  # type: ignore[arg-type]
                                                    request)
            return await self._respond(body, request_id, queue, len(prompt), request, chat=False)

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(body: ChatRequest, request: Request) -> Any:
            tokenizer = self.llm.tokenizer
            if tokenizer is None or tokenizer.chat_template is None:
                raise ApiError(400, "this model has no chat template", param="messages")
            if len(body.messages) > self.limits.max_messages:
                raise ApiError(400, f"{len(body.messages)} messages; this server takes at most "
                                    f"{self.limits.max_messages}", param="messages")
            with self._admitting_one(body) as arrival:
                try:
                    conversation = body.conversation()
                except ValueError as exc:
                    raise ApiError(400, str(exc), param="messages") from None
                chars = sum(len(m["content"]) for m in conversation)
                prompt = await self._tokenize(lambda: tokenizer.apply_chat_template(conversation), chars, "messages")
                queue, request_id = await self._add(body, prompt, True, arrival, request)
            return await self._respond(body, request_id, queue, len(prompt), request, chat=True)

        return app

    # ------------------------------------------------------------------ requests
    @contextlib.contextmanager
    def _admitting_one(self, body: SamplingRequest) -> Iterator[float]:
        """Refuse what can be refused before any work; count the request as waiting
        while its prompt is tokenized and it waits for the engine (a burst would all pass
        the overload check at once otherwise), and a drain waits for it. Yields its
        arrival (time.perf_counter): its QoS deadlines and TTFT count from there, not
        from when the engine queued it, after tokenizing."""
        arrival = time.perf_counter()
        failure = self.llm.engine.failure
        if failure is not None:
            raise ApiError(503, f"the engine failed: {failure}", kind="server_error")
        if self.draining:
            raise ApiError(503, "the server is shutting down", kind="server_shutting_down")
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           kind="model_not_found", param="model")
        stops = body.stops
        if len(stops) > self.limits.max_stop:
            raise ApiError(400, f"{len(stops)} stop strings; at most {self.limits.max_stop}", param="stop")
        if any(len(stop) > self.limits.max_stop_chars for stop in stops):
            raise ApiError(400, f"stop strings must have at most {self.limits.max_stop_chars} characters",
                           param="stop")
        if self.llm.engine.scheduler.num_waiting + self._admitting >= self.max_waiting:
            raise ApiError(503, f"the server is overloaded ({self.max_waiting} requests waiting); retry later",
                           kind="server_overloaded")
        self._admitting += 1
        try:
            yield arrival
        finally:
            self._admitting -= 1

    async def _tokenize(self, encode: Callable[[], list[int]], chars: int, param: str) -> list[int]:
        """`encode()` in a worker thread, refused before it runs when `chars` of text
        must be more tokens than a prompt may have."""
        tokenizer = self.llm.tokenizer
        assert tokenizer is not None
        if chars > self.max_prompt_tokens * tokenizer.max_token_chars:
            raise ApiError(400, f"the prompt is {chars} characters, more than {self.max_prompt_tokens} tokens "
                                "(the most a prompt may have) can spell", param=param)
        try:
            ids = await asyncio.to_thread(encode)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc), param=param) from None
        self._check_length(len(ids))
        return ids

    def _check_length(self, num_tokens: int) -> None:
        if num_tokens > self.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {num_tokens} tokens; this server takes at most "
                                f"{self.max_prompt_tokens}", param="prompt")

    async def _add(self, body: SamplingRequest, prompt: list[int], chat: bool, arrival: float, request: Request
                   ) -> tuple[asyncio.Queue[RequestOutput | Exception], str]:
        if self.draining:  # the drain began while this one was tokenized: it gets the shutdown error
            raise ApiError(503, "the server is shutting down", kind="server_shutting_down")
        self._check_length(len(prompt))
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        qos = self._qos(body)
        try:
            params = body.sampling_params(max(1, self.llm.engine.max_model_len - len(prompt)))
            if params.json_schema is not None:  # compiled first, so add_request finds it cached
                await self._compile(params.json_schema, request)
            if self.draining:
                raise ApiError(503, "the server is shutting down", kind="server_shutting_down")
            queue = await self.engine.add_request(request_id, prompt, params, qos=qos, arrival_time=arrival)
        except CompilesBusy as exc:
            raise ApiError(503, f"response_format: {exc}", kind="server_overloaded", param="response_format") from None
        except (ValueError, TypeError) as exc:
            # The engine names SamplingParams' json_schema, which a client sent as response_format.
            if body.response_format is not None and str(exc).startswith("json_schema"):
                raise ApiError(400, f"response_format: {exc}", param="response_format") from None
            raise ApiError(400, str(exc), param="stop" if str(exc).startswith("stop strings") else None) from None
        self._live[request_id] = queue
        return queue, request_id

    async def _compile(self, schema: str, request: Request) -> None:
        """Wait for `schema`'s compile unless the client leaves first (499, the request
        never added) or the drain begins (503): a compile cannot be interrupted, so it
        runs on, cached for the next request with the schema, but nobody waits for it."""
        compiled = asyncio.ensure_future(self.engine.compile_grammar(schema))
        waits = {compiled, asyncio.ensure_future(self._disconnected(request)),
                 asyncio.ensure_future(self._drained.wait())}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if compiled in done:
            return compiled.result()
        if self._drained.is_set():
            raise ApiError(503, "the server is shutting down", kind="server_shutting_down")
        self.stats.finished([], num_samples=1)  # an abort, with nothing measured
        raise ApiError(499, "the client went away while its response_format compiled", kind="aborted")

    @staticmethod
    async def _disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def _qos(self, body: SamplingRequest) -> str | None:
        """The QoS class body.service_tier selects: a class of the engine's qos_classes
        by name; "auto" or none, the engine's default_qos. 400 for any other tier."""
        config = self.llm.engine.scheduler_config
        tier = body.service_tier
        if tier is None or tier == "auto":
            return config.default_qos
        if config.qos_classes is None or tier not in config.qos_classes:
            tiers = ["auto", *(config.qos_classes or ())]
            raise ApiError(400, f"service_tier must be one of {tiers}, got {tier!r}", param="service_tier")
        return tier

    def _tier(self, body: SamplingRequest) -> str:
        """The tier a response echoes: the class that served it ("default" without classes)."""
        return self._qos(body) or "default"

    async def _respond(self, body: SamplingRequest, request_id: str,
                       queue: asyncio.Queue[RequestOutput | Exception], num_prompt_tokens: int, request: Request,
                       chat: bool) -> Any:
        outputs = self._outputs(request_id, queue, body.n)
        if body.stream:
            return StreamingResponse(self._events(request_id, outputs, chat, body.include_usage, self._tier(body)),
                                     media_type="text/event-stream")
        watcher = asyncio.create_task(self._abort_on_disconnect(request, request_id))
        finals: dict[int, RequestOutput] = {}  # each sample's finished output
        try:
            async for out in outputs:
                if out.finished:
                    finals[out.index] = out
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", kind="server_shutting_down") from None
        except Exception as exc:  # the engine failed: every request in it ends with the cause
            raise ApiError(500, f"the engine failed: {exc}", kind="server_error") from None
        finally:
            watcher.cancel()
        if any(out.finish_reason == "abort" for out in finals.values()):
            raise ApiError(499, "the request was aborted", kind="aborted")
        choices = [completion_body(request_id, self.model_name, chat, out.text, out.finish_reason, stream=False,
                                   token_ids=self._ids_without_text(out.token_ids),
                                   logprobs=self._logprobs(chat, out, 0), index=index,
                                   service_tier=self._tier(body), prompt_logprobs=self._prompt_logprobs(out))
                   for index, out in sorted(finals.items())]
        response = choices[0] | {"choices": [c for one in choices for c in one["choices"]]}
        return response | {"usage": usage(num_prompt_tokens, sum(len(out.token_ids) for out in finals.values()))}

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs of `out`'s prompt (None if not asked for)."""
        if out.prompt_logprobs is None:
            return None
        return prompt_logprobs_body(out.prompt_token_ids, out.prompt_logprobs, self._token_text)

    def _ids_without_text(self, ids: Any) -> list[int] | None:
        return list(ids) if self.llm.tokenizer is None else None

    def _logprobs(self, chat: bool, out: RequestOutput, first: int) -> dict[str, Any] | None:
        """The logprobs object of `out`'s tokens from `first` on that spell its text so far
        (None if not asked for). Only the returned text's tokens are scored: not the end
        token, nor tokens after a stop string; a token that the stop string begins inside
        is, so the last token's text may run on past the text (RequestOutput.num_text_tokens)."""
        if out.logprobs is None:
            return None
        end = out.num_text_tokens
        offsets = None if out.text_offsets is None else out.text_offsets[first:end]
        return logprobs_body(chat, out.token_ids[first:end], out.logprobs[first:end], self._token_text,
                             self._token_bytes, offsets)

    def _token_text(self, token_id: int) -> str:
        """A token as text; without a tokenizer, vLLM's "token_id:<id>"."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            return f"token_id:{token_id}"
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes a token spells, which may be part of a character; without a
        tokenizer, those of its "token_id:<id>" text."""
        tokenizer = self.llm.tokenizer
        return self._token_text(token_id).encode() if tokenizer is None else tokenizer.token_bytes(token_id)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests (503), give running ones `timeout` seconds to finish, then
        end the rest: a stream with an error event and [DONE], a whole response with a
        503; their requests are aborted and their KV blocks freed."""
        self.draining = True
        self._drained.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        running, tokenizing = len(self._live), self._admitting  # those tokenizing meet `draining` in _add
        while (self._live or self._admitting) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = len(self._live)
        for queue in self._live.values():
            queue.put_nowait(ShuttingDown("the server is shutting down"))
        while self.llm.engine.has_unfinished() and loop.time() < deadline + 5:  # the aborts, a step away
            await asyncio.sleep(0.02)
        log.info("sarathi-rt serve: drained %d running requests: %d finished, %d cut after %gs; %d refused after "
                 "tokenizing", running, running - cut, cut, timeout, tokenizing)

    async def _outputs(self, request_id: str, queue: asyncio.Queue[RequestOutput | Exception], num_samples: int
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs (every sample's), the request counted once by how its
        samples end; if the consumer stops early, the engine aborts the request."""
        ended: list[tuple[str, RequestMetrics]] = []
        failed = False
        try:
            async with contextlib.aclosing(self.engine.outputs(request_id, queue, num_samples)) as outputs:  # abort now
                async for out in outputs:
                    if out.finished:
                        ended.append((out.finish_reason or "abort", out.metrics))
                    yield out
        except Exception as exc:
            failed = not isinstance(exc, ShuttingDown)  # the engine failed: an error, not an abort
            raise
        finally:
            self._live.pop(request_id, None)
            if failed:
                self.stats.failed("error")
            else:
                self.stats.finished(ended, num_samples)

    async def _events(self, request_id: str, outputs: AsyncIterator[RequestOutput], chat: bool,
                      include_usage: bool, tier: str) -> AsyncIterator[str]:
        """One server-sent event per generated token of each choice (its text may be empty
        while a character or a possible stop string is incomplete, and so its logprobs,
        which follow the text), then usage and [DONE]."""
        last = None
        scored: dict[int, int] = {}  # per choice: the tokens whose logprobs were sent
        completion_tokens: dict[int, int] = {}
        try:
            async for out in outputs:
                chunk = completion_body(request_id, self.model_name, chat, out.new_text,
                                        out.finish_reason, stream=True, role=chat and out.index not in scored,
                                        token_ids=self._ids_without_text(out.new_token_ids),
                                        logprobs=self._logprobs(chat, out, scored.get(out.index, 0)),
                                        index=out.index, service_tier=tier,
                                        prompt_logprobs=None if out.index in scored else self._prompt_logprobs(out))
                scored[out.index] = out.num_text_tokens
                completion_tokens[out.index] = len(out.token_ids)
                last = out
                yield f"data: {json.dumps(chunk)}\n\n"
        except ShuttingDown as exc:
            yield f"data: {json.dumps(error_body(str(exc), 'server_shutting_down'))}\n\n"
        except Exception as exc:  # the engine failed (counted by _outputs): tell the client, then end the stream
            yield f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n"
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        if include_usage and last is not None:
            chunk = completion_body(request_id, self.model_name, chat, None, None, stream=True)
            chunk["choices"] = []
            counts = usage(len(last.prompt_token_ids), sum(completion_tokens.values()))
            yield f"data: {json.dumps(chunk | {'usage': counts})}\n\n"
        yield "data: [DONE]\n\n"

    async def _abort_on_disconnect(self, request: Request, request_id: str) -> None:
        await self._disconnected(request)
        await self.engine.abort(request_id)

"""Serve an LLMEngine from asyncio: per-request async streams of outputs, with the steps
run in a thread of their own so the event loop stays responsive.

One thread, always the same, runs every step, and the thread that built the engine gives
its OpenMP workers up to it (`_C.release_cpu_threads`). libgomp keeps a team of workers
for each thread that has run a parallel region; with two teams on two cores it counted
more workers than cores and put each to sleep the moment its region ended, so every
kernel call waited for a futex wake-up: SmolLM2 decoded one stream at 67 tok/s through
the server against 131 from `LLM.generate` (bench/RESULTS.md, "The step thread")."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Hashable

from sarathi_rt import _C
from sarathi_rt.sampling import SamplingParams

from .grammar_pool import GrammarPool
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .structured import schema_complexity


class AsyncLLMEngine:
    """One background task steps the engine while requests are unfinished. The engine
    is touched only under an asyncio lock that each step holds, so add_request and abort
    slip in between steps (the lock is fair) and never race a running step. A request
    with SamplingParams(n > 1) sends every sample's outputs (told apart by `index`) to
    its queue; its stream ends after the last sample's finished output.

    A request's json_schema is compiled before it is added, on a GrammarPool of
    `max_compiles` daemon threads, within `compile_timeout` seconds (None: no limit);
    a schema whose structured.schema_complexity is over `max_schema_complexity` (None: no
    limit) is refused before it is compiled. The defaults trust the caller, as a program
    of its own does; a server passes its limits."""

    def __init__(self, engine: LLMEngine, *, max_compiles: int = 2, compile_timeout: float | None = None,
                 max_schema_complexity: int | None = None) -> None:
        if max_schema_complexity is not None and (isinstance(max_schema_complexity, bool) or
                                                  not isinstance(max_schema_complexity, int) or
                                                  max_schema_complexity < 1):
            raise ValueError(f"max_schema_complexity must be an int >= 1 or None, got {max_schema_complexity!r}")
        self.engine = engine
        self.max_schema_complexity = max_schema_complexity
        self.grammars = GrammarPool(engine.compile_grammar, max_compiles, compile_timeout)
        self._lock = asyncio.Lock()
        self._queues: dict[Hashable, asyncio.Queue[RequestOutput | Exception]] = {}
        self._running: dict[Hashable, int] = {}  # request id -> samples not finished
        self._task: asyncio.Task[None] | None = None
        self._aborts: set[asyncio.Task[bool]] = set()  # kept referenced until they run
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sarathi-rt-step")
        _C.release_cpu_threads()  # this thread's workers: the step thread starts its own

    def close(self) -> None:
        """End the step thread (after a step it is running). The engine stays usable by
        its owner; stepping it from here again would need a new AsyncLLMEngine."""
        self._stepper.shutdown(wait=False)

    async def add_request(self, request_id: Hashable, prompt: Sequence[int], params: SamplingParams | None = None,
                          queue: asyncio.Queue[RequestOutput | Exception] | None = None, *, qos: str | None = None,
                          arrival_time: float | None = None) -> asyncio.Queue[RequestOutput | Exception]:
        """Queue a request (of QoS class `qos`, arrived at `arrival_time` on
        time.perf_counter's clock, default now: its deadlines and TTFT count from it); its
        outputs (or the exception that ended the loop) go to `queue` (a new one if None),
        which is returned. Bad input raises here; see compile_grammar for a json_schema."""
        queue = asyncio.Queue() if queue is None else queue
        if isinstance(params, SamplingParams) and params.json_schema is not None:
            await self.compile_grammar(params.json_schema)  # cached: adding the request compiles nothing
        async with self._lock:
            self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time, qos=qos)
            self._queues[request_id] = queue
            self._running[request_id] = 1 if params is None else params.n
        self._ensure_running()
        return queue

    async def compile_grammar(self, schema: str) -> None:
        """Compile SamplingParams.json_schema `schema` (cached) while steps go on. Raises
        ValueError naming json_schema for a schema over max_schema_complexity (before any
        compile), one past compile_timeout or one xgrammar refuses, and
        grammar_pool.CompilesBusy when no compile slot came free in time. Cancelling the
        caller abandons the wait, not the compile (see GrammarPool). A cached schema
        returns at once: its compile cost is paid (the server compiles before it adds)."""
        if self.engine.grammar_compiled(schema):  # no thread, no slot, no second complexity walk
            return
        if self.max_schema_complexity is not None:
            complexity = schema_complexity(json.loads(schema))
            if complexity > self.max_schema_complexity:
                raise ValueError(f"json_schema is too complex to compile: complexity {complexity}, over the "
                                 f"limit of {self.max_schema_complexity} (about one per JSON value in it, more "
                                 "for long enums and many optional properties)")
        await self.grammars.compile(schema)

    async def abort(self, request_id: Hashable) -> bool:
        """Abort a request; its stream ends with a finish_reason "abort" output. False if
        it already finished (its last output may still wait in its queue)."""
        async with self._lock:
            if not self.engine.has_request(request_id):
                return False
            self.engine.abort(request_id)
        self._ensure_running()
        return True

    async def generate(self, prompt: Sequence[int], params: SamplingParams | None = None,
                       request_id: Hashable | None = None, qos: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield one output per step that gives this request a token, the last one with
        finished=True. Leaving the loop early aborts the request."""
        request_id = object() if request_id is None else request_id
        queue = await self.add_request(request_id, prompt, params, qos=qos)
        async with contextlib.aclosing(self.outputs(request_id, queue, 1 if params is None else params.n)
                                       ) as outputs:  # closed now, not at GC
            async for out in outputs:
                yield out

    async def outputs(self, request_id: Hashable, queue: asyncio.Queue[RequestOutput | Exception],
                      num_samples: int = 1) -> AsyncIterator[RequestOutput]:
        """The outputs that add_request sends to `queue`, up to the finished one of each
        of the request's `num_samples` samples (SamplingParams.n). If the consumer stops
        early the request (every sample) is aborted, in a task of its own: this may run
        inside a cancelled scope, where awaiting the engine's lock would be cancelled again."""
        left = num_samples
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                left -= out.finished
                finished = not left
                yield out
        finally:
            if not finished:
                task = asyncio.get_running_loop().create_task(self.abort(request_id))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            await self._step_while_unfinished()
        finally:
            # Idle: the step thread ends its OpenMP workers too, so whoever steps the engine
            # directly meanwhile (LLM.generate on the building thread) holds the only team.
            with contextlib.suppress(RuntimeError):  # closed: its thread has ended
                self._stepper.submit(_C.release_cpu_threads)

    async def _step_while_unfinished(self) -> None:
        while True:
            async with self._lock:
                if not self.engine.has_unfinished():
                    return
                try:
                    outputs = await asyncio.get_running_loop().run_in_executor(self._stepper, self.engine.step)
                except Exception as exc:  # every waiting stream re-raises it
                    for queue in self._queues.values():
                        queue.put_nowait(exc)
                    self._queues.clear()
                    self._running.clear()
                    return
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        self._running[out.request_id] -= 1
                        if not self._running[out.request_id]:
                            del self._queues[out.request_id], self._running[out.request_id]
            await asyncio.sleep(0)

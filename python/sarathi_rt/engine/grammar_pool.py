"""Grammar compiles for AsyncLLMEngine, bounded in threads and in time.

xgrammar's compile is C++ that cannot be interrupted and, for a large schema, runs for
minutes. So a compile runs on a daemon thread of its own, never on asyncio's default
executor (which tokenizing and the engine's steps share: slow schemas would stall every
request there) nor on any ThreadPoolExecutor (whose threads the interpreter joins at exit,
so the process would not end while a compile runs). At most `max_threads` compiles run at
once; a request whose compile cannot start waits (on the event loop, holding no thread)
for a slot. A caller waits `timeout` seconds in all (None: without limit), for a slot and
the compile; past that the compile runs on unwatched, holding its slot, and its result is
cached as any other."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class CompilesBusy(RuntimeError):
    """No compile slot came free within the time limit: the server is overloaded, the
    schema may be fine."""


class GrammarPool:
    """Runs `compile(schema)` (which caches what it compiles) for the callers of
    `compile`, one thread per distinct schema: callers with a schema already compiling
    wait for that compile instead of starting another. Bound to the event loop of its
    first call, like the asyncio primitives it uses."""

    def __init__(self, compile: Callable[[str], object], max_threads: int, timeout: float | None) -> None:
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise ValueError(f"max_compiles must be an int >= 1, got {max_threads!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"compile_timeout must be a positive number of seconds or None, got {timeout!r}")
        self._compile, self.max_threads, self.timeout = compile, max_threads, timeout
        self._slots = asyncio.Semaphore(max_threads)
        self._jobs: dict[str, asyncio.Future[None]] = {}  # schema -> its running compile

    @property
    def running(self) -> int:
        """Compiles running now, watched or not."""
        return len(self._jobs)

    async def compile(self, schema: str) -> None:
        """Return once `schema` is compiled (and so cached); raise what the compile raised,
        CompilesBusy when no slot came free within the time limit, or ValueError naming
        json_schema when the compile took longer than that. A cancelled caller just
        stops waiting: the compile's thread runs to its end and frees its slot."""
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        job = self._jobs.get(schema)
        if job is None:
            try:
                await asyncio.wait_for(self._slots.acquire(), self.timeout)
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on
                raise CompilesBusy(f"all {self.max_threads} grammar compile slots stayed busy for "
                                   f"{self.timeout:g} s; retry later") from None
            job = self._jobs.get(schema)  # another caller may have started it meanwhile
            if job is None:
                job = self._start(schema, loop)
            else:
                self._slots.release()
        try:
            await asyncio.wait_for(asyncio.shield(job), None if deadline is None else max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on
            raise ValueError(f"json_schema took longer than {self.timeout:g} s to compile (the compile time "
                             "limit): simplify the schema") from None

    def _start(self, schema: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        job: asyncio.Future[None] = loop.create_future()
        job.add_done_callback(lambda f: f.exception())  # nobody may wait any more: no "never retrieved" log
        self._jobs[schema] = job

        def run() -> None:
            error: BaseException | None = None
            try:
                self._compile(schema)
            except BaseException as exc:  # handed to the waiters
                error = exc
            try:
                loop.call_soon_threadsafe(self._finish, schema, job, error)
            except RuntimeError:  # the loop is closed (the server has stopped): nobody waits
                pass

        threading.Thread(target=run, name="sarathi-rt-grammar-compile", daemon=True).start()
        return job

    def _finish(self, schema: str, job: asyncio.Future[None], error: BaseException | None) -> None:
        del self._jobs[schema]
        self._slots.release()
        if error is None:
            job.set_result(None)
        else:
            job.set_exception(error)

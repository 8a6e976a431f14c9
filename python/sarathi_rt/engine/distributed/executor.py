"""The driver's side of tensor/pipeline parallelism: spawns one process per worker rank,
ships each StepInput to all of them, and collects the last stage's tokens.

Every wait is bounded: queues are polled in short slices, each slice checks that every
worker process still lives, and a step that takes longer than worker_timeout fails
(start-up may take STARTUP_TIMEOUT_S, or worker_timeout if that is longer).
Any failure stops all workers and raises WorkerError naming the rank and the cause."""
from __future__ import annotations

import os
import queue
import shutil
import signal
import tempfile
import time
import weakref
from collections import deque
from typing import Any, Callable

import torch.multiprocessing as mp

from sarathi_rt.measure.metrics import StageMetrics
from sarathi_rt.models import ResolvedModel

from sarathi_rt.config import EngineConfig
from ..memory import CPU_FRACTION
from ..step_io import StepInput, StepOutput
from .process import STARTUP_TIMEOUT_S, Progress, Report, WorkerSpec, worker_main
from .topology import Topology

POLL_S = 0.05
GRACE_S = 5.0  # a clean shutdown's wait for workers to exit before they are killed


class WorkerError(RuntimeError):
    """A worker process died, failed or stopped answering; the executor is shut down."""


class MultiprocessExecutor:
    """tensor_parallel_size x pipeline_parallel_size worker processes (spawned), each
    holding its shard of the weights and KV cache. The KV cache size is the minimum of
    what fits on each worker. pipeline_depth = pipeline_parallel_size. Each worker gets
    `model` (config.model as the engine resolved it) rather than looking it up again."""

    def __init__(self, config: EngineConfig, model: ResolvedModel) -> None:
        topo = self.topology = Topology(config.tensor_parallel_size, config.pipeline_parallel_size)
        topo.check(model.config)
        self.pipeline_depth = topo.pp
        self._timeout = float(config.worker_timeout)
        fraction = config.kv_memory_fraction
        if config.device.type == "cpu":  # the workers share the host's memory
            fraction = (CPU_FRACTION if fraction is None else fraction) / topo.world_size
        ctx = mp.get_context("spawn")
        tmpdir = tempfile.mkdtemp(prefix="sarathi-rt-dist-")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(topo.world_size)]
        self._progress = Progress(ctx.Array("q", [-1] * (2 * topo.world_size), lock=False))
        self._procs = [ctx.Process(target=worker_main, name=f"sarathi-rt-worker-{r}", daemon=True, args=(
            WorkerSpec(r, topo, config, model, os.path.join(tmpdir, "store"), os.getpid(), fraction),
            self._inboxes[r], self._outbox, self._progress)) for r in range(topo.world_size)]
        self._closed: str | None = None
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._inboxes, self._outbox, tmpdir)
        self._order: deque[int] = deque()
        self._reports: dict[int, dict[int, tuple[StageMetrics, StepOutput | None]]] = {}
        try:
            for p in self._procs:
                p.start()
            ready = self._gather("ready", "loading the model", STARTUP_TIMEOUT_S)
            self.num_kv_blocks = min(r.payload for r in ready)
            for inbox in self._inboxes:
                inbox.put(self.num_kv_blocks)
            self._gather("allocated", "allocating the KV cache and warming up", STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        """Worker process ids, by rank."""
        return [p.pid for p in self._procs]

    # ------------------------------------------------------------------ steps
    def submit(self, step: StepInput) -> None:
        self._check_open()
        self._check_alive()
        for inbox in self._inboxes:
            inbox.put(step)
        self._order.append(step.step)
        self._reports[step.step] = {}

    def collect(self) -> StepOutput:
        self._check_open()
        if not self._order:
            raise RuntimeError("collect() without a submitted step")
        step = self._order[0]
        got = self._reports[step]
        deadline = time.monotonic() + self._timeout
        while len(got) < self.topology.pp:
            report = self._receive(deadline, f"step {step}", lambda: self._laggards(step))
            if report.kind != "step" or report.step not in self._reports:
                self._fail(f"worker {self.topology.describe(report.rank)} sent an unexpected "
                           f"{report.kind!r} report for step {report.step}")
            metrics, out = report.payload
            self._reports[report.step][metrics.stage] = (metrics, out)
        self._order.popleft()
        del self._reports[step]
        stages = [got[s][0] for s in range(self.topology.pp)]
        out = got[self.topology.pp - 1][1]
        if out is None:
            self._fail(f"the last pipeline stage returned no tokens for step {step}")
        out.stages = stages
        return out

    def shutdown(self) -> None:
        if self._closed is None:
            self._closed = "shutdown() was called"
        self._finalizer()

    # ------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed is not None:
            raise WorkerError(f"the workers are shut down ({self._closed})")

    def _gather(self, kind: str, what: str, timeout: float) -> list[Report]:
        deadline = time.monotonic() + max(timeout, self._timeout)
        got: dict[int, Report] = {}
        while len(got) < self.topology.world_size:
            report = self._receive(deadline, what, lambda: [r for r in range(self.topology.world_size)
                                                            if r not in got])
            if report.kind != kind:
                self._fail(f"worker {self.topology.describe(report.rank)} sent {report.kind!r} "
                           f"while {what}")
            got[report.rank] = report
        return list(got.values())

    def _laggards(self, step: int) -> list[int]:
        """The ranks holding up `step`: those that never began it (hung, or stuck on an
        earlier one) if any, else those that began it but did not finish."""
        ranks = range(self.topology.world_size)
        unstarted = [r for r in ranks if self._progress.started(r) < step]
        return unstarted or [r for r in ranks if self._progress.finished(r) < step]

    def _receive(self, deadline: float, what: str, missing: Callable[[], list[int]]) -> Report:
        while True:
            try:
                report = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    ranks = ", ".join(self.topology.describe(r) for r in missing())
                    self._fail(f"no answer from worker {ranks} within worker_timeout={self._timeout:g}s "
                               f"while {what}: the worker is hung or too slow")
                continue
            if report.kind == "error":
                # A peer's death often surfaces first as a communication error in another
                # worker: name the killed worker as the cause when there is one.
                failed = f"worker {self.topology.describe(report.rank)} failed:\n{report.payload}"
                killed = self._dead_workers(settle=1.0, signalled_only=True)
                self._fail(f"{killed} (then {failed.splitlines()[-1].strip()})" if killed else failed)
            return report

    def _check_alive(self) -> None:
        if any(p.exitcode is not None for p in self._procs):
            self._fail(self._dead_workers())

    def _dead_workers(self, settle: float = 0.0, signalled_only: bool = False) -> str:
        """Which workers have exited (or been killed by a signal) and how; waits up to
        `settle` seconds for one to show."""
        deadline = time.monotonic() + settle
        while True:
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs)
                    if p.exitcode is not None and (p.exitcode < 0 or not signalled_only)]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        parts = []
        for rank, code in dead:
            how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            parts.append(f"worker {self.topology.describe(rank)} (pid {self._procs[rank].pid}) {how}")
        return "; ".join(parts)

    def _fail(self, message: str) -> None:
        self._closed = message
        _stop(self._procs, self._inboxes, self._outbox, None, grace=0.0)
        self._finalizer()
        raise WorkerError(f"{message}; all workers were stopped")


def _stop(procs: list[Any], inboxes: list[Any], outbox: Any, tmpdir: str | None, grace: float = GRACE_S) -> None:
    """Ask the workers to exit, give them `grace` seconds, then terminate and kill."""
    for inbox, p in zip(inboxes, procs):
        if grace and p.is_alive():
            inbox.put(None)
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(1.0)
            if p.is_alive():  # SIGTERM waits while a process is stopped; SIGKILL does not
                p.kill()
                p.join()
    for q in [*inboxes, outbox]:
        q.cancel_join_thread()
        q.close()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)

"""Tensor/pipeline parallelism across machines, under torchrun (or any launcher that
sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT).

Every process is one worker rank (Topology's numbering); world rank 0 also holds the
engine (scheduler and API) and runs its own stage when a step is submitted, and its
EngineConfig is the job's (published in the store when the ranks meet). Steps go
from rank 0 to every rank, and reports (timings, tokens) from each stage's tensor
rank 0 back to rank 0, as pickled messages on a gloo group; activations and
all-reduces use the default group (NCCL on GPUs, gloo on CPUs) as in the spawned mode,
through the same Worker and PipelineStage.

Failures: each rank beats a counter in the launcher's TCPStore every HEARTBEAT_S and
writes its traceback there when it fails. A watchdog thread on rank 0 turns a failed
rank, a heartbeat stopped for min(HEARTBEAT_STALE_S, worker_timeout) or a step older
than worker_timeout into a WorkerError naming the rank and its host, and sets a stop
key that ends every other rank; if rank 0 is itself blocked in a collective with the
dead peer, the watchdog prints the error and ends the process."""
from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sarathi_rt.models import ResolvedModel, resolve_configured

from sarathi_rt.config import EngineConfig
from ..memory import CPU_FRACTION
from ..step_io import StepInput, StepOutput
from ..worker import Worker
from .executor import WorkerError
from .heartbeat import HEARTBEAT_S, HEARTBEAT_STALE_S, KEY, Beats, Heartbeat
from .messages import BYE, POLL_S, Inbox, Outbox
from .process import STARTUP_TIMEOUT_S, PipelineStage
from .topology import Topology

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
META_TIMEOUT = timedelta(days=365)  # an idle server's ranks wait for the next step
EXIT_GRACE_S = 2.0  # a failure seen while rank 0 is inside a collective: wait this long, then exit


def launched_by_torchrun() -> bool:
    return all(v in os.environ for v in ENV_VARS) and int(os.environ["WORLD_SIZE"]) > 1


@dataclass
class _Rank:
    """This process's place in the job, its store and message group."""

    rank: int
    topo: Topology
    config: EngineConfig
    model: ResolvedModel  # config.model, resolved once in this process
    store: Any
    meta: Any  # gloo group for the pickled messages
    groups: list[Any]  # tensor-parallel group of each stage
    heartbeat: Heartbeat

    def host(self, rank: int) -> str:
        try:
            return self.store.get(f"{KEY}host/{rank}").decode()
        except Exception:  # the store may be gone with the failure being reported
            return "an unknown host"

    def describe(self, rank: int) -> str:
        return f"{self.topo.describe(rank)} on {self.host(rank)}"


def start(config: EngineConfig, model: ResolvedModel | None = None) -> TorchrunExecutor:
    """Join the job. Rank 0 gets the executor; every other rank serves steps until the
    driver shuts down, then ends its process (status 0; 1 after a failure). `model` is
    config.model already resolved (the engine's); None resolves it here."""
    model = resolve_configured(config) if model is None else model
    topo = Topology(config.tensor_parallel_size, config.pipeline_parallel_size)
    topo.check(model.config)
    world = int(os.environ["WORLD_SIZE"])
    if world != topo.world_size:
        raise ValueError(f"torchrun started {world} processes but tensor_parallel_size x pipeline_parallel_size "
                         f"is {topo.world_size}: start nnodes x nproc-per-node = {topo.world_size} processes")
    me = _join(config, model, topo)
    if me.rank == 0:
        return TorchrunExecutor(me)
    stopping = threading.Event()
    watchdog = threading.Thread(target=_watch_driver, args=(me, stopping), name="sarathi-rt-watchdog", daemon=True)
    watchdog.start()
    try:
        _serve(me, stopping)
    except BaseException:
        me.store.set(f"{KEY}error/{me.rank}", traceback.format_exc())
        me.store.add(f"{KEY}failed", 1)
        print(f"sarathi-rt worker {me.describe(me.rank)} failed:\n{traceback.format_exc()}", file=sys.stderr)
        # Leave only once rank 0 has named the cause: on rank 0's node, this process's exit
        # makes torchrun stop rank 0 at once. A peer's death often surfaces here first, as
        # a broken connection, and rank 0 needs up to a heartbeat's staleness to see which
        # rank fell silent. Its stop key ends this process (the watchdog thread) sooner.
        time.sleep(2 * HEARTBEAT_STALE_S + HEARTBEAT_S)
        os._exit(1)  # os._exit: a peer may still hold this process in a collective
    _end_threads(me, watchdog)
    dist.destroy_process_group()
    sys.exit(0)


def _join(config: EngineConfig, model: ResolvedModel, topo: Topology) -> _Rank:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    timeout = timedelta(seconds=max(config.worker_timeout, STARTUP_TIMEOUT_S))
    store, rank, world = next(dist.rendezvous("env://", rank, topo.world_size, timeout=timeout))
    config = _driver_config(store, rank, config)
    if str(config.model) != model.name:  # this rank serves rank 0's model, named otherwise here
        model = resolve_configured(config)
    if config.device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        config, backend = replace(config, device=device), "nccl"
    else:  # the ranks of one node share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _local_world()))
        backend = "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    store.set(f"{KEY}host/{rank}", f"host {socket.gethostname()} (pid {os.getpid()})")
    # Every rank creates every group, in the same order.
    meta = dist.new_group(backend="gloo", timeout=META_TIMEOUT)
    groups = [dist.new_group(topo.stage_ranks(s)) for s in range(topo.pp)]
    return _Rank(rank, topo, config, model, store, meta, groups, Heartbeat(store, rank))


def _driver_config(store: Any, rank: int, config: EngineConfig) -> EngineConfig:
    """Rank 0's configuration is the job's: it publishes it, every other rank serves with
    it (dtype, block size, seed, ... need not be repeated on their command lines)."""
    if rank == 0:
        store.set(f"{KEY}config", pickle.dumps(config))
        return config
    store.wait([f"{KEY}config"])
    driver = pickle.loads(store.get(f"{KEY}config"))
    mine = (config.tensor_parallel_size, config.pipeline_parallel_size)
    if (driver.tensor_parallel_size, driver.pipeline_parallel_size) != mine:
        raise ValueError(f"rank 0 runs tensor_parallel_size x pipeline_parallel_size = {driver.tensor_parallel_size} "
                         f"x {driver.pipeline_parallel_size}, rank {rank} was started with {mine[0]} x {mine[1]}")
    return driver


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _stage(me: _Rank) -> PipelineStage:
    """This rank's Worker (its shard, KV cache not yet allocated) as a pipeline stage."""
    layout = me.topo.layout(me.rank, me.model.config, me.groups[me.topo.stage(me.rank)])
    fraction = me.config.kv_memory_fraction
    if me.config.device.type == "cpu":  # the ranks of one node share its memory
        fraction = (CPU_FRACTION if fraction is None else fraction) / _local_world()
    worker = Worker(me.config, me.model, layout, kv_memory_fraction=fraction, allocate=False)
    return PipelineStage(worker, me.topo, me.rank)


# ------------------------------------------------------------------ workers
def _serve(me: _Rank, stopping: threading.Event) -> None:
    def nothing() -> None:
        pass  # the watchdog thread ends this process if the driver goes

    inbox, outbox = Inbox(0, me.meta, None), Outbox(me.meta, me.config.worker_timeout)
    stage = _stage(me)
    outbox.send(stage.worker.num_kv_blocks, 0)
    stage.worker.allocate_kv_cache(inbox.get(nothing))
    outbox.send("allocated", 0)
    root = me.topo.tp_rank(me.rank) == 0
    while (step := inbox.get(nothing)) is not None:
        metrics, out = stage.run(step, received=time.perf_counter())
        if root:
            outbox.send((metrics, out), 0)
    stopping.set()
    outbox.send(BYE, 0)
    outbox.flush()


def _watch_driver(me: _Rank, stopping: threading.Event) -> None:
    """End this worker when the driver stops the job or stops beating."""
    beats = Beats(me.store, [0], min(HEARTBEAT_STALE_S, me.config.worker_timeout))
    while not stopping.wait(HEARTBEAT_S):
        try:
            reason = me.store.get(f"{KEY}stop").decode() if me.store.check([f"{KEY}stop"]) else None
            if reason is None and beats.stopped():
                reason = "rank 0 stopped beating (dead, hung or unreachable)"
        except Exception as exc:  # the store lives with rank 0's launcher
            reason = f"the job's store is gone ({exc})"
        if reason is not None and not stopping.is_set():
            print(f"sarathi-rt worker rank {me.rank}: the driver ended the job: {reason}", file=sys.stderr)
            os._exit(1)


# ------------------------------------------------------------------ driver
class TorchrunExecutor:
    """Rank 0's executor: sends each step to every rank, runs pipeline stage 0's share of
    it here, and gathers each stage's report. pipeline_depth = pipeline_parallel_size."""

    def __init__(self, me: _Rank) -> None:
        self.me, self.topology = me, me.topo
        self.pipeline_depth = me.topo.pp
        self._timeout = float(me.config.worker_timeout)
        self._outbox = Outbox(me.meta, self._timeout)
        self._inboxes = {r: Inbox(r, me.meta, BYE) for r in range(1, me.topo.world_size)}
        self._local: dict[int, tuple[Any, StepOutput | None]] = {}
        self._order: list[int] = []
        self._failure: str | None = None
        self._closed = threading.Event()  # set once: shut down or failed
        self._deadline: tuple[float, str, list[int]] | None = None  # (when, while doing what, awaited ranks)
        self._in_stage = False
        self._watchdog = threading.Thread(target=self._watch, name="sarathi-rt-watchdog", daemon=True)
        self._watchdog.start()
        self._finalizer = weakref.finalize(self, _stop_workers, me, self._outbox, self._inboxes, None,
                                           self._closed, self._watchdog)
        others = list(range(1, me.topo.world_size))
        try:
            self._stage = _stage(me)
            blocks = [self._recv(r, "loading the model", STARTUP_TIMEOUT_S) for r in others]
            self.num_kv_blocks = min([self._stage.worker.num_kv_blocks, *blocks])
            for r in others:
                self._outbox.send(self.num_kv_blocks, r)
            self._in_stage = True
            self._stage.worker.allocate_kv_cache(self.num_kv_blocks)
            self._in_stage = False
            for r in others:
                self._recv(r, "allocating the KV cache and warming up", STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    @property
    def hosts(self) -> list[str]:
        """Where each rank runs ("host H (pid P)"), by rank."""
        return [self.me.host(r) for r in range(self.topology.world_size)]

    def submit(self, step: StepInput) -> None:
        self._check()
        for r in range(1, self.topology.world_size):
            self._outbox.send(step, r)
        # A tensor peer whose main thread hangs (its heartbeat still beats) holds this
        # rank in a collective: the step's deadline names the stage's other ranks.
        peers = self.topology.stage_ranks(0)[1:]
        self._deadline = (time.monotonic() + self._timeout, f"step {step.step}", peers) if peers else None
        self._in_stage = True
        try:
            self._local[step.step] = self._stage.run(step, received=time.perf_counter())
        finally:
            self._in_stage, self._deadline = False, None
        self._order.append(step.step)

    def collect(self) -> StepOutput:
        self._check()
        if not self._order:
            raise RuntimeError("collect() without a submitted step")
        step = self._order.pop(0)
        stages = [self._local[step]]
        del self._local[step]
        for s in range(1, self.topology.pp):
            stages.append(self._recv(self.topology.stage_ranks(s), f"step {step}", self._timeout))
        out = stages[-1][1]
        if out is None or out.step != step:
            self._fail(f"the last pipeline stage returned no tokens for step {step}")
        out.stages = [m for m, _ in stages]
        return out

    def shutdown(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._failure = self._failure or "shutdown() was called"
            self._finalizer()

    # ------------------------------------------------------------ internals
    def _check(self) -> None:
        if self._closed.is_set():
            raise WorkerError(f"the workers are shut down ({self._failure})")
        if self._failure is not None:
            self._fail(self._failure)

    def _recv(self, ranks: int | list[int], what: str, timeout: float) -> Any:
        """The next message of `ranks`' first rank; a hang in any of them (a stage's
        report waits for all of its tensor ranks) is named after `timeout`."""
        ranks = [ranks] if isinstance(ranks, int) else ranks
        src = ranks[0]
        self._deadline = (time.monotonic() + max(timeout, self._timeout), what, ranks)
        try:
            return self._inboxes[src].get(self._check)
        except WorkerError:
            raise
        except Exception as exc:  # the connection broke: let the watchdog find the cause
            settle = time.monotonic() + 2 * HEARTBEAT_STALE_S + HEARTBEAT_S
            while self._failure is None and time.monotonic() < settle:
                time.sleep(POLL_S)
            self._fail(self._failure or f"the connection to worker {self.me.describe(src)} broke while "
                                        f"{what}: {exc}")
        finally:
            self._deadline = None

    def _fail(self, message: str) -> None:
        self._failure = message
        self._closed.set()
        self._finalizer.detach()
        _stop_workers(self.me, self._outbox, self._inboxes, message, self._closed, self._watchdog)
        raise WorkerError(f"{message}; all workers were stopped")

    def _watch(self) -> None:
        """Turn failed, silent or late ranks into self._failure; leave the process if the
        main thread is stuck in a collective with them."""
        me = self.me
        beats = Beats(me.store, list(range(1, me.topo.world_size)), min(HEARTBEAT_STALE_S, self._timeout))
        while not self._closed.wait(HEARTBEAT_S):
            try:
                failure = self._diagnose(beats)
            except Exception as exc:  # the store is on this node: only a teardown gets here
                failure = f"the job's store failed ({exc})"
            if failure is None or self._closed.is_set():
                continue
            self._failure = failure
            if self._in_stage:  # the main thread cannot raise: wait a little, then leave
                time.sleep(EXIT_GRACE_S)
                if self._in_stage:
                    _stop_workers(me, self._outbox, self._inboxes, failure, self._closed, self._watchdog)
                    print(f"sarathi-rt: {failure}; all workers were stopped", file=sys.stderr, flush=True)
                    os._exit(1)
            return

    def _diagnose(self, beats: Beats) -> str | None:
        me, stopped = self.me, beats.stopped()
        if me.store.add(f"{KEY}failed", 0):
            # A peer's death often surfaces first as a communication error in another
            # rank: name the silent rank as the cause when one falls silent soon.
            # A rank that reported its error left on purpose: it is not the silent one.
            failed = [r for r in range(1, me.topo.world_size) if me.store.check([f"{KEY}error/{r}"])]
            stopped = [r for r in stopped if r not in failed]
            settle = time.monotonic() + beats.stale + HEARTBEAT_S
            while not stopped and time.monotonic() < settle:
                time.sleep(HEARTBEAT_S)
                stopped = [r for r in beats.stopped() if r not in failed]
            error = me.store.get(f"{KEY}error/{failed[0]}").decode()
            first = f"worker {me.describe(failed[0])} failed:\n{error}"
            if not stopped:
                return first
            return f"{_silent(me, stopped, beats.stale)} (then {first.splitlines()[-1].strip()})"
        if stopped:
            return _silent(me, stopped, beats.stale)
        if self._deadline is not None and time.monotonic() > self._deadline[0]:
            _, what, ranks = self._deadline
            who = ", ".join(me.describe(r) for r in ranks)
            return (f"no answer within worker_timeout={self._timeout:g}s while {what} from worker {who}: "
                    f"{'it is' if len(ranks) == 1 else 'one of them is'} hung or too slow")
        return None


def _silent(me: _Rank, ranks: list[int], stale: float) -> str:
    return (f"worker {', '.join(me.describe(r) for r in ranks)} stopped answering (no heartbeat for "
            f"{stale:g}s: the process died, hangs or its host is unreachable)")


def _stop_workers(me: _Rank, outbox: Outbox, inboxes: dict[int, Inbox], failure: str | None,
                  closed: threading.Event, watchdog: threading.Thread) -> None:
    """A clean end sends every rank None and waits for their BYE; a failure sets the
    stop key that their watchdogs read. Then this rank's own threads end."""
    closed.set()
    try:
        if failure is not None:
            me.store.set(f"{KEY}stop", failure)
            return
        for r in inboxes:
            outbox.send(None, r)
        outbox.flush()
        deadline = time.monotonic() + HEARTBEAT_STALE_S
        for inbox in inboxes.values():
            inbox.thread.join(max(0.0, deadline - time.monotonic()))
        if not any(inbox.thread.is_alive() for inbox in inboxes.values()):
            dist.destroy_process_group()
    except Exception:  # a teardown after a failure: the workers' watchdogs end them
        pass
    finally:
        _end_threads(me, watchdog)


def _end_threads(me: _Rank, watchdog: threading.Thread) -> None:
    """Stop this rank's heartbeat and wait for its watchdog, which has been told to stop:
    neither may be inside a store call when the interpreter ends (see heartbeat.py)."""
    me.heartbeat.stop()
    if watchdog is not threading.current_thread():
        watchdog.join(HEARTBEAT_STALE_S + 2 * HEARTBEAT_S)

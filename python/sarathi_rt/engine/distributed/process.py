"""The worker process: joins the torch.distributed group, loads its shard, then runs
every StepInput the driver sends, in order, as its pipeline stage.

Stage s > 0 receives (hidden, residual) from the same tensor rank of stage s - 1; the
send to stage s + 1 is asynchronous, so a stage starts its next micro-batch while the
next stage is still taking the last one. Tensor rank 0 of each stage reports its timing
to the driver; that of the last stage also the sampled tokens."""
from __future__ import annotations

import os
import queue
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sarathi_rt.measure.metrics import StageMetrics
from sarathi_rt.models import ResolvedModel

from sarathi_rt.config import EngineConfig
from ..step_io import StepInput, StepOutput
from ..worker import Worker
from .topology import Topology

POLL_S = 0.5  # how often an idle worker checks that the driver still lives
STARTUP_TIMEOUT_S = 600.0  # loading a large shard may take minutes, whatever worker_timeout says


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    topology: Topology
    config: EngineConfig
    model: ResolvedModel  # config.model, resolved once by the driver
    store_path: str  # torch.distributed FileStore rendezvous
    parent_pid: int
    kv_memory_fraction: float | None


class Progress:
    """Per rank, the last step it started and the last it finished, in memory shared
    with the driver: when a step times out, the driver names the ranks that never began
    it (hung) apart from those that began it and wait on a peer, at no cost per step."""

    def __init__(self, words: Any) -> None:
        self.words = words  # 2 x world_size signed 64-bit integers, all -1 at first

    def mark(self, rank: int, step: int, done: bool) -> None:
        self.words[2 * rank + done] = step

    def started(self, rank: int) -> int:
        return self.words[2 * rank]

    def finished(self, rank: int) -> int:
        return self.words[2 * rank + 1]


@dataclass(frozen=True)
class Report:
    """Worker -> driver. kind: "ready" (payload: KV blocks that fit), "allocated",
    "step" (payload: (StageMetrics, StepOutput or None)), "error" (payload: traceback)."""

    kind: str
    rank: int
    step: int = -1
    payload: Any = None


class DriverGone(Exception):
    """The driver process exited; the worker leaves quietly."""


def worker_main(spec: WorkerSpec, inbox: Any, outbox: Any, progress: Progress) -> None:
    try:
        _serve(spec, inbox, outbox, progress)
    except DriverGone:
        pass
    except BaseException:  # the driver turns this into a WorkerError naming the rank
        outbox.put(Report("error", spec.rank, payload=traceback.format_exc()))
        outbox.close()
        outbox.join_thread()
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _next(inbox: Any, spec: WorkerSpec) -> Any:
    while True:
        try:
            return inbox.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != spec.parent_pid:
                raise DriverGone from None


def _serve(spec: WorkerSpec, inbox: Any, outbox: Any, progress: Progress) -> None:
    topo, rank, config = spec.topology, spec.rank, spec.config
    if config.device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        config = replace(config, device=device)
        backend = "nccl"
    else:
        # The workers share the host's cores; more threads each would only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // topo.world_size))
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"file://{spec.store_path}", rank=rank,
                            world_size=topo.world_size,
                            timeout=timedelta(seconds=max(config.worker_timeout, STARTUP_TIMEOUT_S)))
    # Every rank must create every group, in the same order.
    groups = [dist.new_group(topo.stage_ranks(s)) for s in range(topo.pp)]
    layout = topo.layout(rank, spec.model.config, groups[topo.stage(rank)])
    worker = Worker(config, spec.model, layout, kv_memory_fraction=spec.kv_memory_fraction, allocate=False)
    outbox.put(Report("ready", rank, payload=worker.num_kv_blocks))
    worker.allocate_kv_cache(_next(inbox, spec))
    stage = PipelineStage(worker, topo, rank)
    outbox.put(Report("allocated", rank))
    while (step := _next(inbox, spec)) is not None:
        progress.mark(rank, step.step, done=False)
        metrics, out = stage.run(step, received=time.perf_counter())
        progress.mark(rank, step.step, done=True)
        if topo.tp_rank(rank) == 0:
            outbox.put(Report("step", rank, step.step, (metrics, out)))


class PipelineStage:
    def __init__(self, worker: Worker, topology: Topology, rank: int) -> None:
        self.worker = worker
        self.model = worker.model
        self.stage = topology.stage(rank)
        self.prev = rank - topology.tp if self.stage > 0 else None
        self.next = rank + topology.tp if self.stage < topology.pp - 1 else None
        self.max_sends = topology.pp  # one per micro-batch in flight
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()
        self._cuda = worker.config.device.type == "cuda"
        self._last_end: float | None = None

    @torch.inference_mode()
    def run(self, step: StepInput, received: float) -> tuple[StageMetrics, StepOutput | None]:
        """Run one micro-batch; `received`: when the driver's StepInput arrived."""
        intermediate = None
        if self.prev is not None:
            hidden_size = self.model.config.hidden_size
            buf = torch.empty(2, step.num_tokens, hidden_size, dtype=self.model.dtype,
                              device=self.worker.config.device)
            dist.recv(buf, src=self.prev)
            intermediate = (buf[0], buf[1])
        start = time.perf_counter()
        result = self.worker.execute(step, intermediate)
        out = None
        if self.next is not None:
            payload = torch.stack(result)
            self._sends.append((dist.isend(payload, dst=self.next), payload))
            while len(self._sends) > self.max_sends:
                self._sends.popleft()[0].wait()
        else:
            out = result
        if self._cuda:  # the timing should cover the kernels, not just their launch
            torch.cuda.synchronize()
        end = time.perf_counter()
        idle_since = received if self._last_end is None else self._last_end
        self._last_end = end
        return StageMetrics(step.step, self.stage, start, end - start, start - idle_since), out

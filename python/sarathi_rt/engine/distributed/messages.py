"""Pickled objects between ranks on a gloo group (torchrun mode). A gloo send or
receive completes only inside wait(), which blocks: each peer's messages are received
by a thread that blocks there and queues them for a thread that polls."""
from __future__ import annotations

import pickle
import queue
import threading
from collections import deque
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

POLL_S = 0.05
BYE = "bye"  # a rank's last message to rank 0

class Outbox:
    """Non-blocking sends of pickled objects; keeps each send's buffers until it is done."""

    KEEP = 64  # sends in flight before the oldest is waited for (its receiver is always ready)

    def __init__(self, group: Any, timeout: float) -> None:
        self.group, self.timeout = group, timedelta(seconds=timeout)
        self.pending: deque[tuple[Any, ...]] = deque()

    def send(self, obj: Any, dst: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self.pending.append((dist.isend(size, dst, group=self.group), dist.isend(data, dst, group=self.group),
                             size, data))
        while len(self.pending) > self.KEEP:
            self._finish(self.pending.popleft())

    def flush(self) -> None:
        while self.pending:
            self._finish(self.pending.popleft())

    def _finish(self, sent: tuple[Any, ...]) -> None:
        sent[0].wait(self.timeout)
        sent[1].wait(self.timeout)


class Broken:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Inbox:
    """What one rank sends this one, in order, received by a daemon thread until `last`."""

    def __init__(self, src: int, group: Any, last: Any) -> None:
        self.src, self.group, self.last = src, group, last
        self.queue: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"sarathi-rt-inbox-{src}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                size = torch.empty(1, dtype=torch.int64)
                dist.recv(size, self.src, group=self.group)
                data = torch.empty(int(size.item()), dtype=torch.uint8)
                dist.recv(data, self.src, group=self.group)
                obj = pickle.loads(data.numpy().tobytes())
                self.queue.put(obj)
                if obj == self.last:
                    return
        except BaseException as exc:  # the watchdogs name the cause; keep it for the record
            self.queue.put(Broken(exc))

    def get(self, check: Callable[[], None]) -> Any:
        """The next object; calls check() every POLL_S while none has come."""
        while True:
            try:
                obj = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                check()
                continue
            if isinstance(obj, Broken):
                raise obj.exc
            return obj

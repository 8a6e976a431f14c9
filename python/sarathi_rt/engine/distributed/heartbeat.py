"""Heartbeats in the torchrun job's store: every rank adds to its counter every
HEARTBEAT_S from a thread of its own (so a rank beats while its main thread computes
or waits in a collective, and stops when its process dies or is stopped); a watchdog
calls a rank silent once its counter has not moved for a while.

Every thread that calls into the store (or gloo) must end before the interpreter does:
CPython ends a daemon thread that comes back from such a call during finalization with
pthread_exit, whose unwinding through torch's noexcept C++ frames aborts the process
("terminate called without an active exception"), or leaves a lock held that the
teardown then waits on."""
from __future__ import annotations

import threading
import time
from typing import Any

HEARTBEAT_S = 0.5
HEARTBEAT_STALE_S = 6.0
KEY = "sarathi-rt/"  # prefix of every key this package sets in the job's store


class Heartbeat:
    """This rank's beat, from a thread of its own until stop()."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sarathi-rt-heartbeat", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the thread; a store call in progress may take up to the store's timeout."""
        self.stopping.set()
        self.thread.join(HEARTBEAT_STALE_S)

    def _run(self) -> None:
        while True:
            try:
                self.store.add(f"{KEY}beat/{self.rank}", 1)
            except Exception:  # the store went away with rank 0's node: the watchdogs act
                return
            if self.stopping.wait(HEARTBEAT_S):
                return


class Beats:
    """Which ranks' heartbeats have not moved for `stale` seconds of this clock."""

    def __init__(self, store: Any, ranks: list[int], stale: float) -> None:
        self.store, self.stale = store, stale
        now = time.monotonic()
        self.last = {r: (-1, now) for r in ranks}

    def stopped(self) -> list[int]:
        now, out = time.monotonic(), []
        for rank, (count, since) in self.last.items():
            latest = self.store.add(f"{KEY}beat/{rank}", 0)
            if latest != count:
                self.last[rank] = (latest, now)
            elif now - since > self.stale:
                out.append(rank)
        return out

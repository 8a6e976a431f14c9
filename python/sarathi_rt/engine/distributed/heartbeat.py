"""Heartbeats in the torchrun job's store: every rank adds to its counter every
HEARTBEAT_S from a thread of its own (so a rank beats while its main thread computes
or waits in a collective, and stops when its process dies or is stopped); a watchdog
calls a rank silent once its counter has not moved for a while."""
from __future__ import annotations

import time
from typing import Any

HEARTBEAT_S = 0.5
HEARTBEAT_STALE_S = 6.0
KEY = "sarathi-rt/"  # prefix of every key this package sets in the job's store


def beat(store: Any, rank: int) -> None:
    """The heartbeat thread's loop."""
    while True:
        try:
            store.add(f"{KEY}beat/{rank}", 1)
        except Exception:  # the store went away with rank 0's node: the watchdogs act
            return
        time.sleep(HEARTBEAT_S)


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

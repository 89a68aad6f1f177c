"""Frozen-rank detection: a rank that stops running (SIGSTOP, a hung host, swapped out) raises nothing and closes no
connection, so its peers would wait in their collectives for the whole process-group timeout (600 s by default)
without learning which rank it is.

Each rank's failure watchdog (failure.py) bumps a counter of its own in the job's store every `BEAT_S` seconds (one
atomic `add`). A rank that has been inside one step for more than a quarter of `frozen_after` reads the other ranks'
counters each beat; a counter that has not moved for `frozen_after` seconds (this rank's clock: no clock is compared
across hosts) names a frozen rank. The watchdog then publishes the failure, and every rank still waiting in the step
stops, naming it. Bound: frozen_after (default 120 s, `HYBRID_PARALLEL_FROZEN_RANK_S`) plus a quarter of it plus a
beat after the frozen rank's last beat: at most 2.6 minutes by default. The watchdog thread keeps beating while its
rank computes, saves or waits: only a stopped process stops beating.
"""
from __future__ import annotations

import os
import time
from typing import Dict, Optional, Tuple

__all__ = ["Heartbeats", "frozen_after_seconds", "BEAT_S"]

BEAT_S = 5.0
DEFAULT_FROZEN_S = 120.0
_PREFIX = "hybrid_parallel/heartbeat/"


def frozen_after_seconds() -> float:
    """Seconds without a heartbeat after which a rank counts as frozen (HYBRID_PARALLEL_FROZEN_RANK_S)."""
    value = os.environ.get("HYBRID_PARALLEL_FROZEN_RANK_S")
    return float(value) if value else DEFAULT_FROZEN_S


class Heartbeats:
    """This rank's beat, and its view of the others' (see the module docstring)."""

    def __init__(self, store, rank: int, world: int, frozen_after: float, beat: float = BEAT_S) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.frozen_after, self.beat = frozen_after, min(beat, frozen_after / 4)
        self._last_beat = float("-inf")
        self._seen: Dict[int, Tuple[int, float]] = {}  # rank -> (counter, when it last moved on this rank's clock)

    def tick(self, in_step_since: Optional[float]) -> Optional[Tuple[int, float]]:
        """Beat if one is due; inside a step begun at `in_step_since` (monotonic; None: outside any step) and long
        enough, (frozen rank, seconds since its counter last moved) for the first frozen rank found, else None."""
        now = time.monotonic()
        if now - self._last_beat < self.beat:
            return None
        self._last_beat = now
        self.store.add(f"{_PREFIX}{self.rank}", 1)
        if in_step_since is None or now - in_step_since < self.frozen_after / 4:
            self._seen.clear()  # outside long steps: nothing is watched (no store reads)
            return None
        for rank in range(self.world):
            if rank == self.rank:
                continue
            counter = self.store.add(f"{_PREFIX}{rank}", 0)  # read without changing it
            seen = self._seen.get(rank)
            if seen is None or seen[0] != counter:
                self._seen[rank] = (counter, now)
            elif now - seen[1] >= self.frozen_after:
                return rank, now - seen[1]
        return None

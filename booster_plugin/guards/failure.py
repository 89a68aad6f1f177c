"""Failure containment: an exception on one rank inside a step ends the step on every rank, naming that rank.

A gloo receive or collective cannot be interrupted: a rank blocked waiting for a rank that raised would wait for the
process-group timeout (the plugin's, 600 s by default) or, if that rank's script catches the exception and goes on,
forever.
So a failing rank publishes `rank R: ExceptionType: message` in the job's rendezvous store (the TCPStore of the
default process group) before re-raising, and a watchdog thread on every rank polls that store:
- a rank inside a step whose collective fails because the failing rank closed its connections raises `RankFailure`
  naming that rank; one still blocked in a receive prints the failing rank's error and exits with status 1
  (torchrun then ends the job; nothing else can unblock it);
- a rank outside a step raises `RankFailure` naming the failing rank at its next step or checkpoint call.
The failing rank itself refuses further steps with the same error, so a script that catches it stops cleanly. A rank
that dies without raising (killed, out of memory) closes its connections: its peers' collectives fail at once and
they report the lost connection through the same path. A rank that stops without dying (SIGSTOP, a hung host) stops
beating (heartbeat.py): a peer waiting for it publishes that it stopped responding, naming it, within about 2.6
minutes by default, and every rank still in the step stops with that message.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from typing import Iterator, Optional

import torch.distributed as dist

from .heartbeat import Heartbeats, frozen_after_seconds

__all__ = ["RankFailure", "FailureGuard", "default_store"]

_KEY = "hybrid_parallel/failure"


class RankFailure(RuntimeError):
    """Another rank failed during a step; the pipeline cannot continue (the message names that rank)."""


class FailureGuard:
    """Shares the first failure of a step with every rank of the job (see the module docstring).

    Args:
        poll_seconds: how often the watchdog looks at the store.
    """

    _shared: Optional["FailureGuard"] = None

    @classmethod
    def shared(cls) -> "FailureGuard":
        """One guard (one watchdog thread) per process and default process group."""
        store = default_store()
        if cls._shared is None or cls._shared._store is not store:
            if cls._shared is not None:
                cls._shared.close()
            cls._shared = cls()
        return cls._shared

    def __init__(self, poll_seconds: float = 0.5) -> None:
        self.rank = dist.get_rank()
        self._store = default_store()
        self._failure: Optional[str] = None
        self._in_step = threading.Event()
        self._step_since: Optional[float] = None  # monotonic start of the step this rank is in (heartbeat.py)
        self._beats = None if self._store is None else Heartbeats(self._store, self.rank, dist.get_world_size(),
                                                                  frozen_after_seconds())
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._watch, args=(poll_seconds,), daemon=True,
                                            name="hybrid-parallel-failure-watchdog")
            self._thread.start()
            # stop polling before the interpreter tears down: a daemon thread killed inside a store call aborts
            atexit.register(self.close)

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Run one step (or collective call, or a direct forward or backward's reduction) of this rank under the
        guard. Re-entrant: inside a step (a forward run by the pipeline schedule) it adds nothing, not even a
        store read."""
        if self._in_step.is_set():
            yield
            return
        self.check()
        self._step_since = time.monotonic()
        self._in_step.set()
        try:
            yield
        except RankFailure:
            raise
        except BaseException as error:
            # a collective that failed because another rank failed first (its connections closed): name that rank
            other = self._other_failure(wait_seconds=2.0) if isinstance(error, RuntimeError) else None
            if other is not None:
                self._failure = other
                raise RankFailure(f"The job cannot continue: {other.rstrip('.')}.") from error
            self._publish(f"rank {self.rank} failed in {what}: {type(error).__name__}: {error}")
            raise
        finally:
            self._in_step.clear()
            self._step_since = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A collective of this rank outside a step (the per-step batch agreement): a peer's published failure or
        a frozen peer ends the wait as inside a step; this rank's own errors are not published (every rank raises
        the same one there)."""
        if self._in_step.is_set():
            yield
            return
        self._step_since = time.monotonic()
        self._in_step.set()
        try:
            yield
        finally:
            self._in_step.clear()
            self._step_since = None

    def check(self) -> None:
        """Raise RankFailure if any rank has failed (checked at the start of every step)."""
        failure = self._failure or self._read()
        if failure is not None:
            self._failure = failure
            raise RankFailure(f"The job cannot continue: {failure.rstrip('.')}. Stop this process (torchrun restarts the job "
                              f"with --max-restarts; resume from the last checkpoint).")

    def published_failure(self, wait_seconds: float = 5.0) -> Optional[RankFailure]:
        """After a collective failed outside a step (e.g. a peer closed its connections): the RankFailure naming
        another rank's published failure, waiting up to `wait_seconds` for it to appear (longer than a failing rank
        waits before it publishes, 2 s in `step`); None if there is none."""
        other = self._other_failure(wait_seconds)
        return None if other is None else RankFailure(f"The job cannot continue: {other.rstrip('.')}.")

    def close(self) -> None:
        """Stop the watchdog and wait for it (it leaves any store call within one poll)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # -- internals -------------------------------------------------------------------------------------------
    def _publish(self, text: str) -> None:
        if self._failure is None:
            self._failure = text
        if self._store is not None:
            with contextlib.suppress(Exception):
                if not self._store.check([_KEY]):
                    self._store.set(_KEY, text.encode()[:4096])

    def _other_failure(self, wait_seconds: float) -> Optional[str]:
        """Another rank's published failure, waiting up to `wait_seconds` for it to appear."""
        deadline = time.monotonic() + wait_seconds
        while True:
            failure = self._read()
            if failure is not None and not failure.startswith(f"rank {self.rank} "):
                return failure
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def _read(self) -> Optional[str]:
        if self._store is None:
            return None
        try:
            if self._store.check([_KEY]):
                return self._store.get(_KEY).decode(errors="replace")
        except Exception:  # the store's host (rank 0) is gone
            return "rank 0 (which hosts the rendezvous store) exited"
        return None

    def _watch(self, poll_seconds: float) -> None:
        while not self._stop.wait(poll_seconds):
            self._watch_heartbeats()
            failure = self._read()
            if failure is None:
                continue
            self._failure = self._failure or failure
            if failure.startswith(f"rank {self.rank} "):
                return  # our own failure: this rank raised it
            # wait for this rank to leave a step: one that does not (blocked in a receive) has to exit
            if self._in_step.is_set() and not self._stop.wait(2 * poll_seconds) and self._in_step.is_set():
                print(f"[hybrid-parallel rank {self.rank}] stopping: {failure}", file=sys.stderr, flush=True)
                os._exit(1)
            return


    def _watch_heartbeats(self) -> None:
        """Beat; inside a long step, publish a rank whose heartbeat stopped (then every rank still in the step
        stops, naming it: see `_watch`)."""
        try:
            frozen = self._beats.tick(self._step_since if self._in_step.is_set() else None)
        except Exception:  # the store's host is gone: `_read` reports it
            return
        if frozen is not None:
            rank, silent = frozen
            self._publish(f"rank {rank} stopped responding: no heartbeat for {silent:.0f} s while rank {self.rank} "
                          f"waited for it (frozen: stopped with SIGSTOP, a hung host, swapped out); the bound is "
                          f"HYBRID_PARALLEL_FROZEN_RANK_S={self._beats.frozen_after:.0f} s")


def default_store():
    """The default process group's store, or None where torch does not expose it."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except Exception:
        return None

"""Agreement on errors across ranks, and save jobs that finish now or in a background thread.

A save has a collective phase (plan, tp gathers, pp sends: always in the caller's thread) and a local phase: each
writer writes its files, reports to rank 0 through the rendezvous store (a key per save and writer: no disk needed,
so a full disk is reported too), and rank 0 commits (index, config, swap) or, if a writer does not report within
the plugin's timeout, fails the save naming it. The
local phase runs inline, or with `use_async=True` in a thread on snapshots of the tensors; `synchronize()` (and
every later checkpoint call, through any Booster) joins the threads and agrees on their errors. A background save
that failed and was never synchronized is reported on stderr when the process exits (no collective is possible
then): the error is never lost.
"""
from __future__ import annotations

import atexit
import itertools
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence

import torch
import torch.distributed as dist

from pipeline.groups import world_group

from ..guards.failure import default_store
from .atomic import discard

_MESSAGE_BYTES = 2048
_SAVE_NUMBERS = itertools.count()  # every rank makes the same checkpoint calls: the same number for the same save


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank. Loading changed nothing."""


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def listed(items: Sequence[str], most: int = 8) -> str:
    """The first `most` items, for a message ("[...] ..." when there are more)."""
    return f"{list(items[:most])}{' ...' if len(items) > most else ''}"


def agree(error: Optional[str], action: str, device: torch.device) -> None:
    """Collective: if any rank has an error, every rank raises one CheckpointError listing them all."""
    flag = torch.tensor([1 if error else 0], dtype=torch.int64, device=device)
    try:
        dist.all_reduce(flag, group=world_group())
    except RuntimeError as lost:  # a rank left (exited right after an asynchronous save) or froze
        raise CheckpointError(f"{action} failed: another rank left the job or did not answer before the ranks agreed "
                              f"on the result ({lost}); {error or 'this rank had no error'}. A checkpoint is "
                              f"swapped in only when complete: the previous one at that path is untouched.") from lost
    if not flag.item():
        return
    raw = (error or "").encode("utf-8")[:_MESSAGE_BYTES]
    mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if raw:
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    parts = [torch.empty(_MESSAGE_BYTES, dtype=torch.uint8, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine.to(device), group=world_group())
    by_message: Dict[str, List[int]] = {}
    for rank, part in enumerate(parts):
        text = bytes(part.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")
        if text:
            by_message.setdefault(text, []).append(rank)
    details = "; ".join(f"[rank {','.join(map(str, ranks))}] {text}" for text, ranks in by_message.items())
    raise CheckpointError(f"{action} failed: {details}")


@dataclass
class SaveJob:
    """The local phase of one save on one rank."""

    action: str                     # e.g. "save_model('ckpt')", for messages
    tmp: str                        # the temporary directory or file
    writers: FrozenSet[int]         # global ranks other than 0 that write files into `tmp` and report
    write: Callable[[], None]       # this rank's file writes (no collectives); a no-op if it has none
    commit: Callable[[], None]      # rank 0 only: index / config, then the swap
    timeout_s: float                # how long rank 0 waits for the writers' reports (the plugin's timeout)
    error: Optional[str] = None     # set by the collective phase, then by the local phase
    rank: int = field(default_factory=dist.get_rank)  # taken at the call: the group may be gone at exit
    key: str = field(default_factory=lambda: f"hybrid_parallel/save/{next(_SAVE_NUMBERS)}")
    thread: Optional[threading.Thread] = field(default=None, repr=False)

    def run(self) -> None:
        rank = self.rank
        if self.error is None:
            try:
                self.write()
            except Exception as exc:
                self.error = describe(exc)
        if rank in self.writers:
            try:
                default_store().set(f"{self.key}/{rank}", "error:" + self.error if self.error else "ok")
            except Exception as exc:
                self.error = self.error or describe(exc)
        if rank != 0:
            return
        try:
            failed = _wait_reports(self.key, self.writers, self.timeout_s)
            if failed and self.error is None:
                self.error = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            if self.error is None:
                self.commit()
        except Exception as exc:
            self.error = self.error or describe(exc)
        if self.error is not None:
            discard(self.tmp)  # the previous checkpoint is untouched


def _wait_reports(key: str, writers: FrozenSet[int], timeout_s: float) -> Dict[int, str]:
    """Rank 0: wait for every writer's report of the save `key` (polling: a blocking store wait would hold the
    store's connection, which the failure watchdog shares); {rank: error} of those that failed."""
    store, pending, errors = default_store(), set(writers), {}
    deadline = time.monotonic() + timeout_s
    while pending:
        for rank in sorted(pending):
            if store.check([f"{key}/{rank}"]):
                report = store.get(f"{key}/{rank}").decode(errors="replace")
                store.delete_key(f"{key}/{rank}")
                if report != "ok":
                    errors[rank] = report[len("error:"):]
                pending.discard(rank)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"rank(s) {sorted(pending)} did not finish writing their files within {timeout_s:.0f} s "
                               f"(the plugin's timeout)")
        if pending:
            time.sleep(0.02)
    return errors


# background saves of this process, of every Booster / CheckpointIO: a load of a path saved asynchronously through
# another Booster waits for it too. Every rank makes the same collective calls, so every rank has the same list.
_PENDING: List[SaveJob] = []


def _run_in_background(job: SaveJob) -> None:
    try:
        job.run()
    except BaseException as exc:  # reported by synchronize(), never lost with the thread
        job.error = job.error or describe(exc)
        if job.rank == 0:
            discard(job.tmp)


def finish(job: SaveJob, use_async: bool, device: torch.device) -> None:
    """Run the local phase of a save now (then agree on errors), or start it in a background thread."""
    if not use_async:
        job.run()
        agree(job.error, job.action, device)
        return
    job.thread = threading.Thread(target=_run_in_background, args=(job,), name=f"checkpoint {job.action}")
    job.thread.start()
    _PENDING.append(job)


def synchronize(device: torch.device) -> None:
    """Collective when saves are pending: wait for them and raise one CheckpointError on every rank if any failed
    (the failed checkpoint was not swapped in)."""
    pending = list(_PENDING)
    _PENDING.clear()
    if not pending:
        return
    errors = []
    for job in pending:
        job.thread.join()
        if job.error is not None:
            errors.append(f"{job.action}: {job.error}")
    agree("; ".join(errors) or None, "asynchronous save", device)


@atexit.register
def report_unsynchronized() -> List[str]:
    """At exit (after Python joined the save threads): print the errors of background saves never synchronized."""
    lost = []
    for job in _PENDING:
        if job.thread is not None:
            job.thread.join()
        if job.error is not None:
            lost.append(f"rank {job.rank}: asynchronous {job.action} failed and was never synchronized "
                        f"(call booster.checkpoint_io.synchronize() to get it as an error): {job.error}; the "
                        f"previous checkpoint at that path is untouched.")
    _PENDING.clear()
    for line in lost:
        print(line, file=sys.stderr, flush=True)
    return lost

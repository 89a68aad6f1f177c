"""A job that finished exits 0 on every rank, also when the script never calls `dist.destroy_process_group()`.

The abort this prevents (`terminate called without an active exception`, SIGABRT after the last step): gloo runs
every collective on a worker thread of its process group (`pt_gloo_runloop`), which drops its reference to the
operation's tensors only after the caller has been woken. A tensor whose Python object died in the meantime (any
temporary passed to a collective, e.g. a checkpoint's error flag) is then freed by that C++ thread, which must take
the GIL to free the Python object. If the main thread has started finalizing the interpreter by then, CPython ends
the worker with `pthread_exit`; its unwinding crosses a `noexcept` destructor and `std::terminate` aborts the
process. (A daemon Python thread blocked in a GIL-released torch call at finalization aborts the same way.)

So an atexit hook, registered when `booster_plugin` is imported (before the checkpoint and failure-guard hooks,
hence run after them: atexit runs last-registered first), runs while the interpreter is whole:
1. stops the failure guard's watchdog (a daemon thread polling the store) and joins background checkpoint savers;
2. waits, with the GIL released, until every gloo worker thread of the process is idle (blocked waiting for work:
   read from /proc/self/task/*/syscall), at most `EXIT_WAIT_S` seconds: an operation still running finishes, or
   fails at once if its peer already exited, and its worker frees its tensors now;
3. then destroys the process groups: every group, in torch's order (subgroups before the world group), with one
   `dist.destroy_process_group()`, which waits for nothing on gloo. Groups the plugin still references are freed
   later, at finalization, with idle workers (their destructors only join them).
It never waits for another rank: step 2 is bounded, step 3 is local. A script that destroyed the process group
itself gets steps 1 and 2 only (its subgroups held by the plugin still have workers). A script that ends with an
uncaught exception, or on a rank that published its own failure, gets step 1 only: it exits at once, so that its
peers see its connections close. Set `HYBRID_PARALLEL_CLEAN_EXIT=0` to skip the hook.

Without the hook the abort was rare in library jobs (2 of 60 runs in the issue): the other atexit work (the
failure guard's join among it) usually hands a waiting worker the GIL in time, but not a worker the OS has not run
yet on a loaded machine. A bare 2-rank script whose last statement is a collective on a temporary aborts a rank in
about half of its runs (tests/test_clean_exit.py).
"""
from __future__ import annotations

import atexit
import os
import platform
import sys
import time
from typing import List, Optional

__all__ = ["register", "quiesce_gloo_workers", "EXIT_WAIT_S"]

EXIT_WAIT_S = 5.0     # the longest the hook waits for gloo operations still running at exit
_GLOO_WORKER = "pt_gloo_runloop"
_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_registered = False


def register() -> None:
    """Register the exit hook (once per process; `booster_plugin` does it on import)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_at_exit)


def _gloo_workers() -> Optional[List[List[str]]]:
    """The /proc syscall fields of each of this process's gloo worker threads; None where /proc cannot tell (not
    Linux, or the file unreadable)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    workers = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
        except OSError:
            continue  # the thread ended
        try:
            with open(f"/proc/self/task/{tid}/syscall") as f:
                workers.append(f.read().split())
        except OSError:
            if os.path.exists(f"/proc/self/task/{tid}"):
                return None
    return workers


def _idle(fields: List[str]) -> bool:
    """A worker waiting for work: in a condition-variable wait without a timeout. One that runs, waits for the GIL (a
    timed wait), for a peer (gloo waits with a timeout) or for a mutex is not idle."""
    if _FUTEX is None or len(fields) < 5 or fields[0] != str(_FUTEX):
        return False
    try:
        op, timeout = int(fields[2], 16) & 0x7F, int(fields[4], 16)
    except ValueError:
        return False
    # FUTEX_WAIT_BITSET without a timeout: glibc's condition-variable wait (a mutex wait is a plain FUTEX_WAIT: the
    # worker may be about to free a finished operation's tensors)
    return op == 9 and timeout == 0


def quiesce_gloo_workers(timeout_s: float = EXIT_WAIT_S) -> Optional[bool]:
    """Wait, with the GIL released, until every gloo worker thread of this process is idle (twice in a row, 10 ms
    apart), at most `timeout_s` seconds. True: idle; False: some still busy at the deadline; None: this platform
    cannot tell (then it only releases the GIL for a moment, which lets a worker that waits for it finish)."""
    workers = _gloo_workers() if _FUTEX is not None else None
    if workers is None or (not workers and _initialized()):  # cannot tell (or a torch that names no threads)
        time.sleep(0.2)
        return None
    if not workers:
        return True
    deadline = time.monotonic() + timeout_s
    calm = 0
    while True:
        workers = _gloo_workers() or []
        calm = calm + 1 if all(_idle(fields) for fields in workers) else 0
        if calm >= 2:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _stop_threads() -> None:
    """The failure guard's watchdog and the background checkpoint savers (both joined, bounded)."""
    failure = sys.modules.get("booster_plugin.guards.failure")
    guard = getattr(getattr(failure, "FailureGuard", None), "_shared", None)
    if guard is not None:
        guard.close()
    jobs = sys.modules.get("booster_plugin.checkpoint.jobs")
    if jobs is not None:
        jobs.report_unsynchronized()


def _failed() -> bool:
    """The script ends with an uncaught exception, or this rank published its failure (failure.py): then the hook
    waits for nothing (its peers see its connections close). A failure seen from another rank does not count: a
    watchdog also reports the store's host (rank 0 without torchrun) exiting after a successful job."""
    if getattr(sys, "last_value", None) is not None:
        return True
    failure = sys.modules.get("booster_plugin.guards.failure")
    guard = getattr(getattr(failure, "FailureGuard", None), "_shared", None)
    text = getattr(guard, "_failure", None)
    return bool(text) and text.startswith(f"rank {guard.rank} ")


def _at_exit() -> None:
    if os.environ.get("HYBRID_PARALLEL_CLEAN_EXIT", "1") == "0":
        return
    try:
        _stop_threads()
        if _failed():
            return
        idle = quiesce_gloo_workers()
        if idle is False:
            print(f"[hybrid-parallel] at exit: gloo operations still running after {EXIT_WAIT_S:.0f} s (an "
                  f"asynchronous operation never waited for?); process groups left as they are",
                  file=sys.stderr, flush=True)
        elif _initialized():
            sys.modules["torch.distributed"].destroy_process_group()
    except Exception as error:  # never turn a finished job into a failed one
        print(f"[hybrid-parallel] at exit: cleanup failed ({type(error).__name__}: {error})", file=sys.stderr,
              flush=True)


register()

"""Run a function on N gloo/CPU ranks, one thread each, and re-raise the first rank failure in pytest.

Start-up of a process group costs seconds here, so a test module spawns one group and runs many cases in it.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(*args)
    except BaseException:  # report every rank's failure to the parent
        errors.put((rank, traceback.format_exc()))
        os._exit(1)
    finally:
        from booster_plugin.failure import FailureGuard
        if FailureGuard._shared is not None:  # its watchdog polls the group's store: stop it first
            FailureGuard._shared.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 480) -> None:
    """Spawn `world_size` gloo ranks running `fn(*args)`; fail with the ranks' tracebacks if any rank fails, and
    kill them all if they have not finished after `timeout` seconds (a hang fails the test instead of CI)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):  # a rank failed: the others get 30 s to report theirs
            deadline = min(deadline, time.monotonic() + 30)
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures or hung or any(p.exitcode != 0 for p in procs):
        msgs = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures))
        stuck = f"; ranks {hung} hung and were killed" if hung else ""
        raise AssertionError(f"distributed test failed (exit codes {[p.exitcode for p in procs]}{stuck}):\n{msgs}")

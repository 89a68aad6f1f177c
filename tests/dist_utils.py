"""Run a function on N gloo/CPU ranks, one thread each, and re-raise the first rank failure in pytest.

Start-up of a process group costs seconds here (N interpreters importing torch and transformers on 2 cores), so
ranks are forked from a server that imported them once, and the ranks of each world size are started once per
pytest session and kept as a pool: every `run_distributed` call with that world size runs its function in the same
processes and process group. A pool is replaced by a fresh one after any failure or hang, and after a task that
left a published rank failure in the group's store (the failure guard of booster_plugin would refuse the next
task's steps). `fresh=True` runs in a one-off group instead, for
tests that leave the group unusable on purpose (e.g. a collective called on one rank only).
"""
from __future__ import annotations

import atexit
import gc
import os
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks start from a fork server that has imported torch, transformers and the test helpers once: a freshly spawned
# interpreter spends about 11 s of CPU importing them, which on 2 cores was a minute of the suite's wall time.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "transformers", "booster_plugin", "tests.model_utils"])
_STOP = None  # the task that ends a worker
# HP_TEST_DEVICE=cuda: a world of one runs on the GPU in an NCCL world group ("nccl" alone, as GPU scripts create it);
# several ranks need as many GPUs (NCCL refuses two ranks on one GPU), so those tests skip, saying so
TEST_DEVICE = os.environ.get("HP_TEST_DEVICE", "cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_task() -> bool:
    """Per-task cleanup on a rank: stop the failure guard's watchdog and destroy the task's subgroups (each gloo
    group keeps threads and connections); True if a rank failure was published."""
    from torch.distributed.distributed_c10d import _world

    from booster_plugin.guards.failure import _KEY, FailureGuard, default_store
    if FailureGuard._shared is not None:
        FailureGuard._shared.close()
        FailureGuard._shared = None
    for group in list(_world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
    gc.collect()
    store = default_store()
    return bool(store is not None and store.check([_KEY]))


def _worker(rank: int, world_size: int, port: int, backend: str, tasks, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    if backend == "nccl":  # the references of tests.model_utils run on this rank's GPU too
        from tests import model_utils
        model_utils.DEVICE = torch.device("cuda", rank)
    try:
        while (task := tasks.get()) is not _STOP:
            fn, args = task
            try:
                fn(*args)
            except BaseException:  # report this rank's failure; the pool is discarded after it
                results.put((rank, "failed", traceback.format_exc()))
                os._exit(1)
            results.put((rank, "dirty" if _end_task() else "ok", ""))
    finally:
        _end_task()
        if dist.is_initialized():
            dist.destroy_process_group()


class _Pool:
    """`world_size` ranks of one world group made with `backend`, each looping over the tasks it is sent."""

    def __init__(self, world_size: int, backend: str) -> None:
        self.world_size = world_size
        self.results = _CTX.SimpleQueue()
        self.tasks = [_CTX.SimpleQueue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [_CTX.Process(target=_worker, args=(r, world_size, port, backend, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, timeout: float) -> Tuple[List[Tuple[int, str]], List[int], bool]:
        """Run fn(*args) on every rank: (failures as (rank, traceback), hung ranks, whether the group is dirty)."""
        for q in self.tasks:
            q.put((fn, args))
        done: Dict[int, str] = {}
        failures: List[Tuple[int, str]] = []
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size and time.monotonic() < deadline:
            while not self.results.empty():
                rank, status, tb = self.results.get()
                done[rank] = status
                if status == "failed":
                    failures.append((rank, tb))
            if failures or any(p.exitcode is not None for p in self.procs):  # the others get 30 s to report theirs
                deadline = min(deadline, time.monotonic() + 30)
            if len(done) < self.world_size:
                time.sleep(0.05)
        hung = [r for r in range(self.world_size) if r not in done]
        return failures, hung, "dirty" in done.values()

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(_STOP)
            deadline = time.monotonic() + 20
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: Dict[Tuple[int, str], _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 480,
                    fresh: bool = False, backend: str = "gloo") -> None:
    """Run `fn(*args)` on `world_size` gloo ranks; fail with the ranks' tracebacks if any rank fails, and kill them
    all if they have not finished after `timeout` seconds (a hang fails the test instead of CI).

    Args:
        world_size: number of ranks.
        fn: a module-level function (sent to the ranks by reference).
        timeout: seconds before the ranks are declared hung and killed.
        fresh: run in a new group that is discarded afterwards, instead of the session's pooled group.
        backend: the world group's backend, as a script passes it to `init_process_group`; `"cuda:gloo"` makes a
            world group without a CPU backend, as `"nccl"` is on a GPU (see `pipeline.groups`). Under
            HP_TEST_DEVICE=cuda: "nccl", on GPUs (skipped where there are fewer GPUs than ranks).
    """
    if TEST_DEVICE == "cuda":
        import pytest
        gpus = torch.cuda.device_count()
        if world_size > gpus:
            pytest.skip(f"{world_size} ranks need {world_size} GPUs under HP_TEST_DEVICE=cuda (NCCL runs one rank per "
                        f"GPU); this machine has {gpus}")
        backend = "nccl"
    key = (world_size, backend)
    pool: Optional[_Pool] = None if fresh else _POOLS.get(key)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = _Pool(world_size, backend)
        if not fresh:
            _POOLS[key] = pool
    failures, hung, dirty = pool.run(fn, args, timeout)
    broken = bool(failures or hung or not pool.alive())
    if fresh or broken or dirty:
        pool.close(kill=broken)
        if _POOLS.get(key) is pool:
            del _POOLS[key]
    if failures or hung:
        msgs = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures))
        stuck = f"; ranks {hung} hung and were killed" if hung else ""
        codes = [p.exitcode for p in pool.procs]
        raise AssertionError(f"distributed test failed (exit codes {codes}{stuck}):\n{msgs}")

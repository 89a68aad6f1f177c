"""Run a function on N CPU processes (gloo, one thread each).

- `run_standalone` (the checker): through torchrun's own launcher in standalone mode (`elastic_launch` with a c10d
  rendezvous on localhost:0, what `torchrun --standalone` does): the rendezvous store picks its port itself, so no
  port is chosen here that another process could take first; a crash, hang or start-up failure raises LaunchFailed.
- `spawn` (long sweeps, e.g. benchmarks/coverage.py): plain processes on a free port, returning the reports of the
  ranks that finished even when others crashed or hung (a sweep keeps its partial results)."""
from __future__ import annotations

import datetime
import os
import uuid
from typing import Any, Callable, Dict, List

import socket

import torch
import torch.multiprocessing as mp


def _standalone_worker(timeout_s: float, fn: Callable, args: tuple) -> tuple:
    """One rank (torchrun set RANK, WORLD_SIZE, MASTER_ADDR/PORT): ("ok", value) or ("error", message)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        return "ok", fn(*args)
    except BaseException as error:  # noqa: BLE001  (report any failure)
        return "error", f"{type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()


def run_standalone(world: int, fn: Callable, *args: Any, timeout_s: float = 300.0) -> List[tuple]:
    """`fn(*args)` on `world` ranks; returns [(rank, "ok" | "error", value or message)] of every rank, or raises
    LaunchFailed when a rank crashed, hung past `timeout_s` in a collective or could not start (nothing compared)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"hp_check-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
                          rdzv_configs={"timeout": int(timeout_s)})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        results: Dict[int, tuple] = elastic_launch(config, _standalone_worker)(timeout_s, fn, args)
    except ChildFailedError as failed:
        raise LaunchFailed(_first_failure(failed)) from None
    except Exception as error:  # noqa: BLE001  (rendezvous or start-up)
        raise LaunchFailed(f"{type(error).__name__}: {error}") from None
    return [(rank, *results[rank]) for rank in sorted(results)]


class LaunchFailed(RuntimeError):
    """The ranks could not run to the end (a crash, a hang, a start-up failure): nothing was compared."""


def _first_failure(failed) -> str:
    rank, failure = min(failed.failures.items())
    return f"rank {rank} exited with {failure.exitcode} ({failure.message or 'no message'})"



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout_s: float, fn: Callable, args: tuple, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        out = fn(*args)
        results.put((rank, "ok", out))
    except BaseException as error:  # noqa: BLE001  (report any failure, then leave)
        results.put((rank, "error", f"{type(error).__name__}: {error}"))
        os._exit(1)
    dist.destroy_process_group()


def spawn(world: int, fn: Callable, *args: Any, timeout_s: float = 300.0, total_s: float | None = None) -> List[tuple]:
    """`fn(*args)` on `world` ranks; returns [(rank, "ok" | "error", value or message)] of the ranks that reported.

    A collective waits at most `timeout_s`; the processes are ended after `total_s` (default timeout_s + 60)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, timeout_s, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(total_s or timeout_s + 60)
    for p in procs:
        if p.is_alive():  # stuck: end the processes this function started
            p.kill()
            p.join()
    out = []
    while not results.empty():
        out.append(results.get())
    return sorted(out, key=lambda r: r[0])

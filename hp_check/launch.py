"""Run a function on N CPU processes (gloo, one thread each) without torchrun; results come back through a queue."""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp


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

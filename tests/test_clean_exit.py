"""A finished job exits 0 on every rank without `destroy_process_group()` (booster_plugin/guards/clean_exit.py).

The race it closes: a gloo worker thread frees the tensors of the script's last collective after the main thread has
started finalizing the interpreter, and aborts the process (`terminate called without an active exception`). The
full soak is benchmarks/exit_soak.py; this test runs the smallest form of the race: 2 processes, the exit hook loaded
alone (the rest of the library is not needed), 200 all-reduces of temporaries, then the end of the script. Without
the hook a rank aborts in about half of such runs here; with it, never."""
import os
import socket
import subprocess
import sys

import pytest

from booster_plugin.guards import clean_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RACE = r'''
import importlib.util, os, sys
if os.environ["HOOK"]:
    spec = importlib.util.spec_from_file_location("clean_exit_alone", os.environ["HOOK"])
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
for _ in range(200):
    dist.all_reduce(torch.ones(100))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_race(hook: bool, ranks: int = 2) -> list:
    port = _free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   HOOK=os.path.join(ROOT, "booster_plugin", "guards", "clean_exit.py") if hook else "")
        procs.append(subprocess.Popen([sys.executable, "-c", RACE], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        results.append((p.returncode, out.decode(errors="replace")[-2000:]))
    return results


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the hook reads /proc to see idle gloo workers")
def test_last_collective_then_exit_exits_zero():
    results = _run_race(hook=True)
    assert [code for code, _ in results] == [0, 0], results


def test_idle_reads_futex_waits_without_timeout():
    assert clean_exit._registered  # by `import booster_plugin`
    nr = clean_exit._FUTEX
    if nr is None:
        pytest.skip("unknown architecture")
    assert clean_exit._idle([str(nr), "0x55", "0x189", "0x0", "0x0", "0x0", "0xffffffff", "0x7f", "0x7f"])
    assert not clean_exit._idle([str(nr), "0x55", "0x189", "0x0", "0x7ffc", "0x0", "0x0", "0x7f", "0x7f"])  # timed
    assert not clean_exit._idle([str(nr), "0x55", "0x80", "0x2", "0x0", "0x0", "0x0", "0x7f", "0x7f"])  # a mutex
    assert not clean_exit._idle(["running"])
    assert not clean_exit._idle(["232", "0x6", "0x7f", "0x40", "0xa", "0x0", "0x0", "0x7f", "0x7f"])  # epoll

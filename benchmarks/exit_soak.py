"""Clean-exit soak: launch the same short multi-rank job many times and count every rank's exit status.

A job that finished must exit 0 on every rank, every time: no `terminate called without an active exception`
(SIGABRT, status -6) after the last step, no rank hanging at exit. The job (JOB below) is what user scripts do:
boost a tiny GPT-2 with tp2 x pp2 (4 ranks; x dp2 with ZeRO-1 on 8), train 2 steps, and end WITHOUT
`synchronize()` or `dist.destroy_process_group()`, in one of these ways (`--endings`):
  sync       a background optimizer save, then a plain model save (its last collective has a temporary tensor)
  allreduce  the script's own all-reduce of a temporary (e.g. a mean loss to log) as its last statement
  async      background model and optimizer saves still writing when the script ends
  step       nothing after the last step
  bare       no plugin: `import booster_plugin`, then 200 all-reduces of temporaries (the race's smallest form)

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/exit_soak.py --runs 10 --ranks 4 8
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/exit_soak.py --runs 3 --ranks 4 --launcher direct

Each rank runs under a small shell wrapper that records its own exit status in a file (torchrun reports only the
first failure and kills the other ranks), with `PYTHONFAULTHANDLER=1` so a rank that aborts prints every Python
thread's stack. `--launcher torchrun` (default) is what users run: the ranks share torchrun's agent store;
`--launcher direct` starts the ranks itself (rank 0 then hosts the store, as with a bare `init_process_group`).
Prints one line per run and a table of exit statuses per world size and ending; failing runs keep their logs under
`--keep`. Exit status 0 iff every rank of every run exited 0. Without booster_plugin/guards/clean_exit.py the abort is
rare in these jobs (the library's other exit work usually gives the gloo worker the GIL in time); the test
tests/test_clean_exit.py runs the race where it is frequent.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# the job every rank runs (python -c); argv: layout "tp,pp", steps, checkpoint dir, ending
JOB = r'''
import os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from booster_plugin import Booster, HybridParallelPlugin
from tests import model_utils as mu

tp, pp = map(int, sys.argv[1].split(","))
steps, out, ending = int(sys.argv[2]), sys.argv[3], sys.argv[4]
world = int(os.environ["WORLD_SIZE"])
if ending == "bare":  # no plugin: the library imported, then plain collectives on temporaries, the last one at exit
    dist.init_process_group("gloo")
    for i in range(200):
        dist.all_reduce(torch.ones(100))
    sys.exit(0)
plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=2 if pp > 1 else None,
                              zero_stage=1 if world // (tp * pp) > 1 else 0)
booster = Booster(plugin=plugin)
model = mu.build("gpt2_lm", 4)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, *_ = booster.boost(model, optimizer)
for i in range(steps):
    batch = mu.make_batch("gpt2_lm", 4, i)
    loss = booster.execute_pipeline(iter([batch]), model, mu.criterion, optimizer, return_loss=True)["loss"]
    optimizer.step()
    optimizer.zero_grad()
print(f"rank {os.environ['RANK']} trained, loss {float(loss):.4f}", flush=True)
if ending == "async":    # background saves, never synchronized: the saver threads are still running at exit
    booster.save_model(model, os.path.join(out, "model"), shard=True, use_async=True)
    booster.save_optimizer(optimizer, os.path.join(out, "optim"), shard=True, use_async=True)
elif ending == "sync":   # a background save, then a plain one (it joins the first): the last call is a collective
    booster.save_optimizer(optimizer, os.path.join(out, "optim"), shard=True, use_async=True)
    booster.save_model(model, os.path.join(out, "model"), shard=True)
elif ending == "allreduce":  # the script's own last collective, on a temporary (e.g. a mean loss to log)
    dist.all_reduce(torch.tensor([float(loss)]))
# "step": the script ends right after its last step
# no synchronize(), no destroy_process_group(): as user scripts end
'''

WRAPPER = r'''#!/bin/sh
"$SOAK_PYTHON" -c "$SOAK_JOB" "$@" >"$SOAK_DIR/rank$RANK.log" 2>&1
rc=$?
echo $rc >"$SOAK_DIR/rank$RANK.rc"
exit $rc
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout(ranks: int) -> str:
    """tp x pp for a world size: 4 -> tp2 pp2; 8 -> tp2 pp2 dp2; 2 -> pp2."""
    return {1: "1,1", 2: "1,2"}.get(ranks, "2,2")


def one_run(ranks: int, ending: str, args, work: str) -> tuple:
    """(per-rank statuses, seconds, launcher status, run dir)."""
    run_dir = tempfile.mkdtemp(prefix=f"run{ranks}_", dir=work)
    wrapper = os.path.join(run_dir, "rank.sh")
    with open(wrapper, "w") as f:
        f.write(WRAPPER)
    os.chmod(wrapper, 0o755)
    env = dict(os.environ, SOAK_DIR=run_dir, SOAK_JOB=JOB, SOAK_PYTHON=sys.executable, PYTHONFAULTHANDLER="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job_args = [layout(ranks), str(args.steps), os.path.join(run_dir, "ckpt"), ending]
    started = time.monotonic()
    if args.launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={free_port()}", "--no-python", wrapper, *job_args]
        with open(os.path.join(run_dir, "launcher.log"), "w") as log:
            try:
                launcher = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                          timeout=args.limit).returncode
            except subprocess.TimeoutExpired:
                launcher = "timeout"
    else:
        port, procs = free_port(), []
        for rank in range(ranks):
            penv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen([wrapper, *job_args], env=penv, cwd=ROOT, start_new_session=True))
        deadline, launcher = time.monotonic() + args.limit, 0
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                launcher = "timeout"
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    seconds = time.monotonic() - started
    statuses = []
    for rank in range(ranks):
        try:
            with open(os.path.join(run_dir, f"rank{rank}.rc")) as f:
                rc = int(f.read().strip())
            statuses.append(rc - 256 if rc > 128 else rc)  # sh reports a signal N as 128+N; show -N as Python does
        except (OSError, ValueError):
            statuses.append("none")  # killed with its wrapper (hang, or the launcher stopped the job)
    return statuses, seconds, launcher, run_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per world size and ending")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8], help="world sizes")
    parser.add_argument("--endings", nargs="+", choices=["sync", "async", "step", "allreduce", "bare"],
                        default=["sync", "allreduce"],
                        help="how the job ends (see JOB)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--launcher", choices=["torchrun", "direct"], default="torchrun")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds before a run is killed")
    parser.add_argument("--keep", default=os.path.join(tempfile.gettempdir(), "exit_soak_failures"),
                        help="where the logs of failing runs are kept")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="exit_soak_")
    cells = [(ranks, ending) for ranks in args.ranks for ending in args.endings]
    counts = {cell: collections.Counter() for cell in cells}
    bad_runs = collections.Counter()
    try:
        for i in range(args.runs):
            for ranks, ending in cells:
                statuses, seconds, launcher, run_dir = one_run(ranks, ending, args, work)
                counts[ranks, ending].update(statuses)
                ok = all(s == 0 for s in statuses) and launcher == 0
                line = (f"run {i + 1:2d} ranks={ranks} ending={ending}: statuses {statuses} launcher {launcher} "
                        f"{seconds:5.1f}s")
                if not ok:
                    bad_runs[ranks, ending] += 1
                    os.makedirs(args.keep, exist_ok=True)
                    kept = os.path.join(args.keep, os.path.basename(run_dir))
                    shutil.copytree(run_dir, kept, ignore=shutil.ignore_patterns("ckpt"), dirs_exist_ok=True)
                    line += f"  FAILED (logs: {kept})"
                print(line, flush=True)
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nexit statuses per rank (status: count), over all runs:")
    for ranks, ending in cells:
        table = ", ".join(f"{k}: {v}" for k, v in sorted(counts[ranks, ending].items(), key=lambda kv: str(kv[0])))
        print(f"  {ranks} ranks, ending={ending}, {args.runs} runs ({args.launcher}): {table}; "
              f"runs with a failure: {bad_runs[ranks, ending]}")
    return 0 if not bad_runs else 1


if __name__ == "__main__":
    sys.exit(main())

"""Shared harness for the benchmark scripts: gloo setup (one thread per rank), a hang watchdog, interleaved timing,
the benchmark Llama and its data, tables and JSON results. Not a benchmark itself."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import copy
import datetime
import faulthandler
import json
import platform
import statistics
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")

# the benchmark model: small Llama, fp32
HIDDEN, LAYERS, HEADS, VOCAB, SEQ, BATCH, INTERMEDIATE = 256, 8, 4, 1024, 128, 8, 1024


# -- process group ------------------------------------------------------------------------------------------------
def init_dist(timeout_s: float = 120.0, world_size: Optional[int] = 2) -> int:
    """gloo from torchrun's environment, one intra-op thread; collectives give up after `timeout_s`.
    `world_size`: the number of ranks the script needs (None: any)."""
    if "RANK" not in os.environ:
        raise SystemExit(f"Launch with: torchrun --nproc_per_node={world_size or 2} " + " ".join(sys.argv))
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    if world_size is not None and dist.get_world_size() != world_size:
        raise SystemExit(f"This benchmark runs on exactly {world_size} ranks: torchrun --nproc_per_node={world_size} ...")
    return dist.get_rank()


def environment() -> Dict[str, Any]:
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "backend": "gloo", "world_size": dist.get_world_size(), "threads_per_rank": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "when": datetime.datetime.now().isoformat(timespec="seconds"),
            "loadavg_at_start": loadavg()}


def loadavg() -> str:
    """Other work on this (shared, 2-core) machine makes numbers noisy; record how busy it was."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


# -- hang detection -----------------------------------------------------------------------------------------------
class Watchdog:
    """Arm around anything that may hang. On expiry: report which variant hung, write the partial results with
    `hung` set, dump the stacks and exit this rank (the peer then fails on the gloo timeout or the same watchdog)."""

    def __init__(self, name: str, results: Dict[str, Any]) -> None:
        self.name, self.results = name, results
        self._lock = threading.Lock()
        self._deadline: Optional[float] = None
        self._what = ""
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, what: str, seconds: float) -> None:
        with self._lock:
            self._what, self._deadline = what, time.monotonic() + seconds

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if expired:
                rank = dist.get_rank() if dist.is_initialized() else -1
                print(f"[rank {rank}] HUNG: {what} did not finish in time; partial results written, exiting.",
                      file=sys.stderr, flush=True)
                self.results.setdefault("hung", []).append(what)
                if rank == 0:
                    write_results(self.name, self.results)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(3)


# -- timing -------------------------------------------------------------------------------------------------------
def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over rounds of num[r] / den[r]: both measured in the same round, so slow drifts in the machine's
    load cancel (more robust than a ratio of medians here)."""
    return median([a / b for a, b in zip(num, den)])


def compare(a: Sequence[float], b: Sequence[float], a_name: str, b_name: str) -> Dict[str, Any]:
    """Which of two interleaved time series is faster. Decided only when the paired median ratio and the ratio of
    minima (the least-disturbed runs) agree; otherwise 'inconclusive' (a busy machine can flip a median)."""
    paired, mins = paired_ratio(a, b), min(a) / min(b)
    wins = sum(x < y for x, y in zip(a, b))
    if paired < 1 and mins < 1:
        faster = a_name
    elif paired > 1 and mins > 1:
        faster = b_name
    else:
        faster = "inconclusive"
    text = (f"{faster if faster == 'inconclusive' else faster + ' is faster'}: {a_name}/{b_name} time = "
            f"{paired:.3f} (paired median), {mins:.3f} (ratio of minima); {a_name} faster in {wins} of {len(a)} rounds")
    return {"faster": faster, "paired_ratio": paired, "min_ratio": mins, "rounds_a_faster": wins, "rounds": len(a),
            "a": a_name, "b": b_name, "text": text}


def rotated(names: List[str], round_index: int) -> List[str]:
    """The variants in a different order every round, so no variant always runs first (or right after another)."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def sync_time(fn: Callable[[], Any], cpu: Optional[List[float]] = None) -> float:
    """Seconds for `fn` on all ranks: barrier, run, barrier. Every rank gets rank 0's number.

    With `cpu`, also appends this process's CPU seconds for the same span (all its threads). CPU time leaves out
    waiting (pipeline bubbles, being descheduled by other work on a busy machine), so it is far less noisy than
    wall time here and shows per-step overhead; it is not what a user waits for."""
    dist.barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    dist.broadcast(elapsed, src=0)
    return float(elapsed.item())


def interleaved_steps(steps: Dict[str, Callable[[Any], Any]], batches: Sequence[Any], rounds: int, dog: "Watchdog",
                      after_warmup: Optional[Callable[[], None]] = None):
    """One warm-up step of every variant (batch 0), then `rounds` timed rounds in rotated order, each step under
    the watchdog (180 s). Returns (times, cpu, losses) by variant: wall seconds and this rank's CPU seconds per
    timed step, and every step's return value (the loss, or None on ranks that do not have it)."""
    names = list(steps)
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}  # this rank's CPU seconds per timed step
    losses = {n: [] for n in names}  # per step, on the rank that has the loss

    def run(n, batch, timed):
        holder, cpu_local = [], []
        dog.arm(f"{n} ({'timed' if timed else 'warm-up'} step)", 180)
        t = sync_time(lambda: holder.append(steps[n](batch)), cpu_local)
        dog.disarm()
        losses[n].append(holder[0])
        if timed:
            times[n].append(t)
            cpu[n].append(cpu_local[0])

    for n in names:  # warm-up = step 1 (torch pipelining infers shapes here)
        run(n, batches[0], timed=False)
    if after_warmup is not None:
        after_warmup()
    for r in range(rounds):
        for n in rotated(names, r):
            run(n, batches[(r + 1) % len(batches)], timed=True)
    return times, cpu, losses


def gather_per_rank(local: Any) -> List[Any]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return out


# -- output -------------------------------------------------------------------------------------------------------
def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else f"{c}" for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def rank0_printer(rank: int) -> Callable[..., None]:
    """print (flushed) on rank 0, nothing elsewhere."""
    return (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)


def finish(name: str, results: Dict[str, Any], rank: int, t_start: float, say: Callable[..., None],
           watchdog: str, loadavg_label: str = " (1/5/15 min)") -> None:
    """A timed benchmark's epilogue: hung variants, total time and load average, the results (rank 0), then leave
    the process group. `watchdog` describes its limits for the 'none hung' line."""
    say("hung variants: " + (", ".join(results["hung"]) if results["hung"] else f"none (watchdog: {watchdog})"))
    results["total_s"] = time.perf_counter() - t_start
    results["loadavg_at_end"] = loadavg()
    say(f"total {results['total_s']:.0f} s; load average{loadavg_label} at start {results['env']['loadavg_at_start']}, "
        f"at end {results['loadavg_at_end']} on {os.cpu_count()} cores")
    if rank == 0:
        say("wrote " + write_results(name, results))
    dist.barrier()
    dist.destroy_process_group()


def write_results(name: str, results: Dict[str, Any]) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    return path


# -- the benchmark model and data ---------------------------------------------------------------------------------
def llama_config(**overrides):
    """The benchmark Llama's config; keyword arguments override LlamaConfig fields (e.g. num_key_value_heads)."""
    from transformers import LlamaConfig
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                  tie_word_embeddings=False, pad_token_id=0, attention_dropout=0.0)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_llama(seed: int = 0, **overrides):
    """Same weights on every rank and for every variant (deepcopy the result for each)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(**overrides))
    model.train()
    return model


def make_batches(n: int, seed: int = 1234, batch: int = BATCH, seq: int = SEQ,
                 vocab: int = VOCAB) -> List[Dict[str, torch.Tensor]]:
    """`n` batches of (batch, seq) token ids, no padding; labels = input_ids (HF shifts them for the causal loss)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def hf_criterion(outputs, batch) -> torch.Tensor:
    return outputs.loss


def boost_copy(booster, reference, lr: float = 1e-3):
    """A deep copy of `reference` and an AdamW over it, boosted; returns (model, optimizer)."""
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt, *_ = booster.boost(model, opt)
    return model, opt


# -- drivers: one command that runs a benchmark at several world sizes ----------------------------------------------
def launch(script: str, nproc: int, args: Sequence[str] = (), timeout_s: float = 600.0) -> int:
    """Run `torchrun --nproc_per_node=nproc script args` (a fresh process group of that size) and wait for it."""
    import subprocess
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), script, *args]
    print("$ " + " ".join(["torchrun", *cmd[3:]]), flush=True)
    return subprocess.run(cmd, timeout=timeout_s).returncode


def run_worlds(script: str, worlds: Sequence[int], timeout_s: float = 600.0) -> Dict[str, Any]:
    """Driver: `script --worker OUT_JSON` once per world size (ascending), each under torchrun; returns the merged
    results (exits if one fails)."""
    import tempfile
    merged: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted(worlds):
            path = os.path.join(tmp, f"world{world}.json")
            rc = launch(script, world, ["--worker", path], timeout_s=timeout_s)
            if rc != 0 or not os.path.exists(path):
                raise SystemExit(f"world {world} failed (exit code {rc})")
            with open(path) as f:
                merged.update(json.load(f))
    return merged


def worker_main(script: str, worlds: Sequence[int], worker: Callable[[str], None],
                report: Callable[[Dict[str, Any], float], None], order: Optional[Sequence[str]] = None) -> None:
    """main() of a benchmark that runs at several world sizes: with --worker OUT_JSON, run `worker(OUT_JSON)` (one
    world, under torchrun); otherwise run every world (run_worlds), `report(results, t_start)` (in `order` when
    given) and print the total time."""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", metavar="OUT_JSON", help="(internal) run the layouts of this world size")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    t_start = time.perf_counter()
    res = run_worlds(script, worlds)
    report({k: res[k] for k in order} if order is not None else res, t_start)
    print(f"total {time.perf_counter() - t_start:.0f} s, load average {loadavg()}")


def worker_done(rank: int, out_path: str, results: Dict[str, Any]) -> None:
    """End of a --worker run: rank 0 writes `results` to `out_path`, then every rank leaves the process group."""
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

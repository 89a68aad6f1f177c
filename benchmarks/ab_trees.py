"""Two trees of this repository side by side: a benchmark run alternately from an old and a new commit, on the same
machine in one session, its ratios printed next to each other (e.g. that a refactor left the speed unchanged).

Each commit is checked out into its own temporary git worktree (the working tree is not touched, its committed
results are not overwritten); the benchmark runs there under torchrun with that tree first on the path, the runs
alternate old, new, old, new, ... and each run's JSON is read back from its tree. Ratios inside one run (ours over
one process, ours over torch) cancel most of the machine's drift; alternating cancels the rest.

Run:  python benchmarks/ab_trees.py --old 68c63d2 --bench bench_tp.py [--new HEAD] [--pairs 2] [-- bench args]
Writes benchmarks/results/ab_<bench>.json (both trees' ratios per run, and their medians).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def _run(tree: str, bench: str, extra: List[str]) -> Dict[str, float]:
    """One run of `bench` in `tree`; its numeric ratios."""
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"benchmarks/{bench}", *extra]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(tree, "benchmarks", "results", bench.replace(".py", ".json"))) as f:
        ratios = json.load(f)["ratios"]
    found = {k: v for k, v in ratios.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**found, "loadavg_1min_at_end": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="the old commit")
    parser.add_argument("--new", default="HEAD", help="the new commit (default HEAD)")
    parser.add_argument("--bench", required=True, help="a torchrun benchmark writing 'ratios', e.g. bench_tp.py")
    parser.add_argument("--pairs", type=int, default=2, help="old/new pairs, alternating")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    revs = {"old": _git("rev-parse", "--short", args.old), "new": _git("rev-parse", "--short", args.new)}
    runs: Dict[str, List[Dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="ab_trees_") as tmp:
        trees = {side: os.path.join(tmp, side) for side in revs}
        for side, rev in revs.items():
            _git("worktree", "add", "--detach", trees[side], rev)
        try:
            for i in range(args.pairs):
                for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
                    runs[side].append(_run(trees[side], args.bench, extra))
                    print(f"pair {i + 1} {side} ({revs[side]}): " +
                          ", ".join(f"{k}={v:.3f}" for k, v in runs[side][-1].items()), flush=True)
        finally:
            for tree in trees.values():
                _git("worktree", "remove", "--force", tree)
    keys = [k for k in runs["old"][0] if k in runs["new"][0]]
    medians = {side: {k: statistics.median(r[k] for r in runs[side]) for k in keys} for side in runs}
    print(f"\n{'ratio':60s} {'old ' + revs['old']:>12s} {'new ' + revs['new']:>12s} {'new/old':>8s}")
    for k in keys:
        old, new = medians["old"][k], medians["new"][k]
        print(f"{k:60s} {old:12.3f} {new:12.3f} {new / old if old else float('nan'):8.3f}")
    out = os.path.join(ROOT, "benchmarks", "results", f"ab_{args.bench.replace('.py', '')}.json")
    with open(out, "w") as f:
        json.dump({"bench": args.bench, "args": extra, "revs": revs, "runs": runs, "medians": medians}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Fault-injection sweep: what a user sees for each bad input or fault (not part of CI).

    python benchmarks/faults.py              # every scenario; writes docs/faults.md and benchmarks/results/faults.json
    python benchmarks/faults.py 5 14         # only these, printed (nothing written)
    python benchmarks/faults.py --merge 5    # rerun these and update them in the written results

Each scenario (benchmarks/fault_scenarios.py) is a short script started on 2 (or 4) fresh processes with
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set, as torchrun would; per rank it records the exit status, the outcome the
script printed (`OUTCOME: <Type>: <first line>` or `OUTCOME: ok <detail>`) or what the runner saw instead (a watchdog
exit, a signal), and the wall time from the start to the rank's exit (and from the injected fault, where there is
one). A rank that stopped itself (SIGSTOP) is SIGKILLed once every other rank has exited."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fault_scenarios import SCENARIOS, Scenario, script  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "faults.json")
DOC = os.path.join(ROOT, "docs", "faults.md")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def _outcome(s: Scenario, code: Optional[int], out: str, err: str, killed: bool) -> Dict[str, str]:
    """What the rank ended with: `short` for the table, `full` (the whole message) for the expectation."""
    if s.command:
        last = next((l for l in reversed(out.splitlines()) if l.strip()), "") or \
            next((l for l in reversed(err.splitlines()) if l.strip()), "")
        text = f"exit {code} {last.strip()}"
        return {"short": text, "full": text}
    lines = [l[len("OUTCOME: "):] for l in out.splitlines() if l.startswith("OUTCOME: ")]
    details = [l[len("DETAIL: "):] for l in out.splitlines() if l.startswith("DETAIL: ")]
    if lines:
        kind = lines[-1].split(":", 1)[0]
        full = f"{kind}: {details[-1]}" if details and not lines[-1].startswith("ok") else lines[-1]
        return {"short": lines[-1], "full": full}
    if code is not None and code < 0:
        text = f"killed by {signal.Signals(-code).name}" + (" (by the runner)" if killed else "")
        return {"short": text, "full": text}
    stopping = [l.split("stopping: ", 1)[1] for l in err.splitlines() if "stopping: " in l]
    if stopping:
        return {"short": "stopping: " + stopping[-1], "full": "stopping: " + stopping[-1]}
    last = next((l for l in reversed(err.splitlines()) if l.strip()), "")
    text = f"exit {code} (no OUTCOME line)" + (f"; last stderr line: {last.strip()}" if last else "")
    return {"short": text, "full": text}


def run_scenario(s: Scenario) -> Dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"fault{s.name}-")
    path = os.path.join(work, "scenario.py")
    with open(path, "w") as f:
        f.write(script(s.source) if s.source else "")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(s.ranks),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FAULT_DIR": work, "PYTHONUNBUFFERED": "1"}
    procs, files = [], []
    start = time.time()
    for r in range(s.ranks):
        out, err = open(os.path.join(work, f"out{r}"), "w+"), open(os.path.join(work, f"err{r}"), "w+")
        files.append((out, err))
        argv = [sys.executable, *s.command] if s.command else [sys.executable, path]
        rank_env = env if s.command else {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=rank_env, stdout=out, stderr=err))
    ends: List[Optional[float]] = [None] * s.ranks
    killed, hung = set(), False
    while any(e is None for e in ends):
        now = time.time()
        for r, p in enumerate(procs):
            if ends[r] is None and p.poll() is not None:
                ends[r] = now
        for r, p in enumerate(procs):
            others_done = all(ends[o] is not None for o in range(s.ranks) if o != r)
            if ends[r] is None and others_done and _stopped(p.pid):
                p.kill()
                killed.add(r)
        if now - start > s.limit:
            hung = True
            for r, p in enumerate(procs):
                if ends[r] is None:
                    p.kill()
                    killed.add(r)
        time.sleep(0.1)
    ranks, fault_at = [], None
    for r, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close()
        err.close()
        faults = [float(l.split()[1]) for l in stdout.splitlines() if l.startswith("FAULT: ")]
        if faults:
            fault_at = min(faults + ([fault_at] if fault_at else []))
        ranks.append({"rank": r, "exit": p.returncode, **_outcome(s, p.returncode, stdout, stderr, r in killed),
                      "notes": [l[len("NOTE: "):] for l in stdout.splitlines() if l.startswith("NOTE: ")],
                      "seconds": round(ends[r] - start, 1), "killed_by_runner": r in killed,
                      "stderr_tail": stderr[-2500:]})
    shutil.rmtree(work, ignore_errors=True)
    for rank in ranks:
        rank["after_fault_s"] = round(start + rank["seconds"] - fault_at, 1) if fault_at else None
    held, why = _judge(s, ranks, hung)
    return {"name": s.name, "fault": s.fault, "ranks": s.ranks, "command": " ".join(s.command), "expect": s.expect, "as_expected": held, "why": why,
            "hung": hung, "wall_s": round(max(r["seconds"] for r in ranks), 1), "results": ranks}


def _judge(s: Scenario, ranks: List[Dict[str, Any]], hung: bool):
    if hung:
        return False, f"killed by the runner after {s.limit:.0f} s"
    for rank in ranks:
        pattern = s.match.get(rank["rank"], s.match.get(-1))
        if pattern and not re.search(pattern, rank["full"], re.S):
            return False, f"rank {rank['rank']}: outcome does not match /{pattern}/"
    for rank in ranks:  # a rank the runner did not kill but a signal ended (e.g. SIGABRT at exit)
        if rank["exit"] is not None and rank["exit"] < 0 and not rank["killed_by_runner"]:
            return False, f"rank {rank['rank']} was ended by {signal.Signals(-rank['exit']).name}"
    if s.within is not None:
        worst = max(r["after_fault_s"] if r["after_fault_s"] is not None else r["seconds"] for r in ranks)
        if worst > s.within:
            return False, f"the last rank exited {worst:.1f} s after the fault (bound {s.within:.0f} s)"
    return True, ""


def _cell(text: str, limit: int = 260) -> str:
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("|", "\\|").replace("\n", " ")


def _what(res: Dict[str, Any]) -> str:
    rs = res["results"]
    if res.get("command"):
        text = f"the command: `{_cell(rs[0]['short'])}`"
    elif len({(r["short"], r["exit"]) for r in rs}) == 1 and len(rs) > 1:
        text = f"every rank: `{_cell(rs[0]['short'])}` (exit {rs[0]['exit']})"
    else:
        text = "; ".join(f"rank {r['rank']}: `{_cell(r['short'])}` (exit {r['exit']})" for r in rs)
    if len({tuple(r["notes"]) for r in rs}) == 1:
        notes = list(rs[0]["notes"])
    else:
        notes = [f"r{r['rank']}: {n}" for r in rs for n in r["notes"]]
    if notes:
        text += "<br>notes: " + "; ".join(_cell(n, 200) for n in notes)
    return text


def _times(res: Dict[str, Any]) -> str:
    rs = res["results"]
    text = ", ".join(f"r{r['rank']} {r['seconds']:.1f} s" for r in rs)
    if any(r["after_fault_s"] is not None for r in rs):
        text += " (after the fault: " + ", ".join(f"r{r['rank']} {r['after_fault_s']:.1f} s" for r in rs) + ")"
    return text


def markdown(data: Dict[str, Any]) -> str:
    env = data["environment"]
    quick = sorted(r["wall_s"] for r in data["scenarios"] if r["results"][0]["after_fault_s"] is None)
    typical = f"{quick[len(quick) // 2]:.0f} s" if quick else "?"
    lines = [
        "# Fault injection: what a user sees",
        "",
        "Each row is a short script run on fresh processes (2 ranks, gloo on CPU, one thread each) with one bad input "
        "or fault; the table shows each rank's outcome (the exception type and the first line of its message, or what "
        "ended the process), the wall time from the start to each rank's exit (and from the injected fault, where "
        "there is one, e.g. the SIGSTOP), and whether that is what we expect now. The scenarios are in "
        "`benchmarks/fault_scenarios.py`; run them with `python benchmarks/faults.py` (outside CI; it writes this file "
        "and `benchmarks/results/faults.json`, which also holds every rank's stderr tail).",
        "",
        f"Run {env['when']} on {env['machine']} ({env['cpu_count']} CPU cores shared with other work, load average "
        f"{env['loadavg_at_start']} at the start), Python {env['python']}, torch {env['torch']}, transformers "
        f"{env['transformers']}; the whole sweep took {data['total_s']:.0f} s. Times include starting the interpreters "
        f"and importing torch and transformers (most of the {typical} a scenario without a timeout takes, median)."
        + (f" Rerun later (after a half-finished edit elsewhere in the checkout): {', '.join(data['rerun'])}."
           if data.get("rerun") else ""),
        "",
        "| # | input or fault | what happens now | time to exit | as expected? |",
        "|---|---|---|---|---|",
    ]
    for res in data["scenarios"]:
        if not res["as_expected"]:
            verdict = f"**no**: {_cell(res['why'], 200)}"
        elif res["expect"].startswith("report"):
            verdict = "reported (ended within the bound)"
        else:
            verdict = "yes"
        lines.append(f"| {res['name']} | {_cell(res['fault'], 400)} | {_what(res)} | {_times(res)} | {verdict} "
                     f"(expected: {_cell(res['expect'], 200)}) |")
    return "\n".join(lines) + "\n"


def environment() -> Dict[str, Any]:
    versions = subprocess.run([sys.executable, "-c", "import torch, transformers; print(torch.__version__, "
                               "transformers.__version__)"], capture_output=True, text=True).stdout.split()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return {"python": platform.python_version(), "torch": versions[0] if versions else "?",
            "transformers": versions[1] if len(versions) > 1 else "?", "cpu_count": os.cpu_count(),
            "machine": f"{platform.system()} {platform.machine()}", "loadavg_at_start": load,
            "when": datetime.datetime.now().isoformat(timespec="minutes")}


def _report(res: Dict[str, Any]) -> None:
    print(f"[{res['name']}] {'as expected' if res['as_expected'] else 'NOT as expected: ' + res['why']} "
          f"({res['wall_s']} s)", flush=True)
    for r in res["results"]:
        after = "" if r["after_fault_s"] is None else f" ({r['after_fault_s']} s after the fault)"
        print(f"    rank {r['rank']}: exit {r['exit']} at {r['seconds']} s{after}: {r['full'][:400]}", flush=True)
        for n in r["notes"]:
            print(f"        note: {n}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="scenario names to run (default: all, and write the results)")
    parser.add_argument("--merge", action="store_true", help="update the named scenarios in the written results")
    parser.add_argument("--render", action="store_true", help="only rewrite docs/faults.md from the results")
    parser.add_argument("--show-stderr", action="store_true", help="print each rank's stderr tail")
    args = parser.parse_args()
    if args.render:
        with open(RESULTS) as f:
            data = json.load(f)
        for res in data["scenarios"]:
            res.setdefault("command", " ".join(next(s.command for s in SCENARIOS if s.name == res["name"])))
        with open(DOC, "w") as f:
            f.write(markdown(data))
        return 0
    chosen = [s for s in SCENARIOS if not args.names or s.name in args.names]
    unknown = set(args.names) - {s.name for s in SCENARIOS}
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}")
    env, started = environment(), time.time()
    results = []
    for s in chosen:
        res = run_scenario(s)
        _report(res)
        if args.show_stderr:
            for r in res["results"]:
                print(f"    --- rank {r['rank']} stderr tail ---\n{r['stderr_tail']}")
        results.append(res)
    total = time.time() - started
    print(f"{len(results)} scenario(s) in {total:.0f} s; not as expected: "
          f"{[r['name'] for r in results if not r['as_expected']] or 'none'}")
    if args.names and not args.merge:
        return 0
    if args.merge:
        with open(RESULTS) as f:
            data = json.load(f)
        fresh = {r["name"]: r for r in results}
        data["scenarios"] = [fresh.get(r["name"], r) for r in data["scenarios"]]
        data["rerun"] = sorted(set(data.get("rerun", [])) | set(fresh), key=lambda n: (len(n), n))
    else:
        data = {"environment": env, "total_s": round(total, 1), "scenarios": results}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(data, f, indent=1)
    with open(DOC, "w") as f:
        f.write(markdown(data))
    print(f"wrote {os.path.relpath(RESULTS, ROOT)} and {os.path.relpath(DOC, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

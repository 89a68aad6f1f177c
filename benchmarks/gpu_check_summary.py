"""`make gpu-check`'s last step: one summary of its output directory, and its exit status.

Reads DIR/junit.xml (or, when pytest did not write it, the last line of DIR/tests.log), DIR/tests.rc, DIR/bench.rc and
DIR/gpu.json (bench_gpu.py's results), prints tests passed / failed / skipped and the bench table, and exits 1 if the
tests or the bench failed (0 otherwise). Standard library only (no torch import).

Run:  python benchmarks/gpu_check_summary.py DIR
"""
from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from typing import Dict, Optional


def read_rc(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def junit_counts(path: str) -> Optional[Dict[str, int]]:
    """{tests, passed, failed, errors, skipped, time} summed over the test suites; None without a readable file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    c = {k: sum(int(float(s.get(k, 0))) for s in suites) for k in ("tests", "failures", "errors", "skipped", "time")}
    return {"tests": c["tests"], "passed": c["tests"] - c["failures"] - c["errors"] - c["skipped"],
            "failed": c["failures"], "errors": c["errors"], "skipped": c["skipped"], "time": c["time"]}


def last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1] if lines else "(empty log)"
    except OSError:
        return "(no log)"


def rc_text(rc: Optional[int]) -> str:
    if rc is None:
        return "did not finish (no exit status)"
    return {0: "ok", 124: "TIMED OUT", 137: "KILLED (timeout or memory)"}.get(rc, f"exit status {rc}")


def main() -> int:
    if len(sys.argv) != 2:
        raise SystemExit("usage: gpu_check_summary.py DIR")
    out = sys.argv[1]
    tests_rc, bench_rc = read_rc(os.path.join(out, "tests.rc")), read_rc(os.path.join(out, "bench.rc"))
    print("\n================ gpu-check summary ================")
    counts = junit_counts(os.path.join(out, "junit.xml"))
    if counts is not None:
        print(f"tests: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
              f"{counts['skipped']} skipped of {counts['tests']} in {counts['time']} s (pytest: {rc_text(tests_rc)}; "
              f"-x stops at the first failure)")
    else:
        print(f"tests: no junit.xml; pytest: {rc_text(tests_rc)}; last line of tests.log: "
              f"{last_line(os.path.join(out, 'tests.log'))}")
    results_path = os.path.join(out, "gpu.json")
    bench_ok = bench_rc == 0
    try:
        with open(results_path) as f:
            results = json.load(f)
    except (OSError, ValueError):
        results = None
    if results is None:
        print(f"bench: no results ({rc_text(bench_rc)}); last line of bench.log: "
              f"{last_line(os.path.join(out, 'bench.log'))}")
    else:
        env = results.get("env", {})
        print(f"bench ({rc_text(bench_rc)}): {env.get('gpu', 'CPU')}, torch {env.get('torch')}, transformers "
              f"{env.get('transformers')}, {results.get('total_s', 0):.0f} s; "
              f"failed rows: {', '.join(results.get('failed') or []) or 'none'}")
        print(results.get("table", "(no table)"))
    print(f"files: {out}/ (tests.log, junit.xml, bench.log, gpu.json)")
    tests_ok = tests_rc == 0
    print("gpu-check: " + ("PASSED" if tests_ok and bench_ok else
                           "FAILED (" + ", ".join(w for w, ok in (("tests", tests_ok), ("bench", bench_ok))
                                                  if not ok) + ")"))
    return 0 if tests_ok and bench_ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Port ColossalAI's own plugin tests by the README's rule and run them: the count that pass, each failure's reason.

    python benchmarks/port_colossalai_tests.py --colossalai /path/to/ColossalAI [--timeout 600] [--only NAME ...]

`--colossalai` is a ColossalAI checkout, or a bare git directory (its HEAD is read with `git archive`). The files
ported are those of `tests/test_booster`, `tests/test_checkpoint_io` and `tests/test_shardformer` that build a
Booster plugin (`...Plugin(` or the shardformer model tests' `build_model_from_hybrid_plugin`); ColossalAI's test
kit (`tests/kit`, its model zoo) and the helper modules they import are copied with them.

The port, in a temporary directory:
1. the rule, on every copied .py file: `sed -i -E 's/\\bcolossalai\\b/booster_plugin.colossalai/g'`.
2. CPU-only environment changes, only where torch has no CUDA (the tests hard-code CUDA devices): `.cuda()` ->
   `.cpu()`, the string "cuda" -> "cpu", and a line that is only `torch.cuda.set_device(...)` -> `pass`.
3. Environment: every import in the model zoo's `__init__` files is guarded, so that model families whose library
   is not installed (diffusers, timm, torchaudio, torchvision, torchrec) or that need the model hub at import
   (ChatGLM2's remote config) are left out instead of failing every test, and the registry's `get_sub_registry`
   answers an empty registry for the families whose library is not installed (not for the others: a test of a
   family left out for another reason fails, it does not pass on no model); `tests/__init__.py` is created so that
   `tests.kit` is ColossalAI's and not this repository's `tests` package.
Before running, every ColossalAI name the three suites and the kit import is looked up in the mirror and counted:
present, refused (importable, raising with the reason when used) or missing.

Each file then runs alone (`python -m pytest -q -x FILE`, OMP_NUM_THREADS=1, FAST_TEST=1 as ColossalAI's CI sets it,
limited to `--timeout` seconds); the
reason of a failure is the last exception line pytest prints (that of the spawned rank that failed).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

ROOT = Path(__file__).resolve().parents[1]
RULE = re.compile(r"\bcolossalai\b")
SUITES = ("tests/test_booster", "tests/test_checkpoint_io", "tests/test_shardformer")
COPIED = ("tests", "pytest.ini")
LIBRARY_FAMILIES = ("diffusers", "timm", "torchaudio", "torchrec", "torchvision")  # the model zoo's non-HF families
BUILDS_PLUGIN = re.compile(r"Plugin\(|build_model_from_hybrid_plugin\(")
EXCEPTION_LINE = re.compile(r"^E\s+((?:[\w.]+(?:Error|Exception|Exit|Refused|Interrupt))\b.*|assert .*)$")


class Outcome(NamedTuple):
    file: str
    status: str  # passed | failed | timeout
    seconds: float
    counts: str  # pytest's summary line
    reason: str


def _extract(source: Path, dest: Path) -> None:
    """Copy ColossalAI's tests (a checkout, or a bare git directory's HEAD) into `dest`."""
    if (source / "tests").is_dir():
        for name in COPIED:
            src = source / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / name)
        return
    archive = subprocess.run(["git", "--git-dir", str(source), "archive", "HEAD", *COPIED], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)


def _guard_imports(text: str) -> str:
    """`from . import a, b` and `from .x import *` lines, each in try/except (the family is left out on failure)."""
    out = []
    for line in text.splitlines():
        match = re.match(r"^from \. import ([\w, ]+)$", line)
        names = [n.strip() for n in match.group(1).split(",")] if match else []
        if not names and re.match(r"^from \.\w+ import \*$", line):
            names = [None]
        for name in names:
            statement = line if name is None else f"from . import {name}"
            out += ["try:", f"    {statement}", "except Exception:  # port: family unavailable here", "    pass"]
        if not names:
            out.append(line)
    return "\n".join(out) + "\n"


def _cpu_only(text: str) -> str:
    text = text.replace(".cuda()", ".cpu()").replace('"cuda"', '"cpu"')
    return re.sub(r"(?m)^(\s*)torch\.cuda\.set_device\(.*\)\s*$", r"\1pass", text)


def port(source: Path, dest: Path) -> List[str]:
    """Copy and port; the test files that build a plugin, relative to `dest`."""
    import torch

    _extract(source, dest)
    (dest / "tests" / "__init__.py").touch()
    for path in dest.rglob("*.py"):
        text = RULE.sub("booster_plugin.colossalai", path.read_text())
        if not torch.cuda.is_available():
            text = _cpu_only(text)
        path.write_text(text)
    for init in (dest / "tests/kit/model_zoo/__init__.py", dest / "tests/kit/model_zoo/transformers/__init__.py"):
        init.write_text(_guard_imports(init.read_text()))
    missing = sorted(lib for lib in LIBRARY_FAMILIES if importlib.util.find_spec(lib) is None)
    registry = dest / "tests/kit/model_zoo/registry.py"
    text = registry.read_text().replace(
        "        if not allow_empty:",
        "        if not allow_empty and not any(kw.split('_')[0] in _NOT_INSTALLED for kw in keyword_list):")
    registry.write_text(f"_NOT_INSTALLED = {set(missing) or 'set()'}  # port: libraries missing here\n" + text)
    files = []
    for suite in SUITES:
        for path in sorted((dest / suite).rglob("test_*.py")):
            if BUILDS_PLUGIN.search(path.read_text()):
                files.append(str(path.relative_to(dest)))
    return files


def surface(dest: Path) -> List[Tuple[str, int, str, str]]:
    """(ColossalAI name, files importing it, "present" | "refused" | "missing", reason) for every name that the
    suites and the kit import from the mirror (after the port)."""
    sys.path[:0] = [str(dest), str(ROOT)]
    files: Dict[Tuple[str, str], set] = {}
    for suite in (*SUITES, "tests/kit"):
        for path in (dest / suite).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("booster_plugin.colossalai"):
                    for alias in node.names:
                        files.setdefault((node.module, alias.name), set()).add(path)
    rows = []
    for (module, name), users in sorted(files.items()):
        try:
            doc = getattr(getattr(importlib.import_module(module), name), "__doc__", None) or ""
            status, reason = ("refused", doc[len("Refused: "):]) if doc.startswith("Refused:") else ("present", "")
        except (ImportError, AttributeError) as error:
            status, reason = "missing", f"{type(error).__name__}: {error}"
        rows.append((f"{module}.{name}".replace("booster_plugin.colossalai", "colossalai", 1), len(users), status,
                     reason.split("\n")[0]))
    return rows


def _reason(output: str) -> str:
    lines = [m.group(1) for m in map(EXCEPTION_LINE.match, output.splitlines()) if m]
    if lines:
        return lines[-1][:300]
    tail = [line for line in output.splitlines() if line.strip()]
    return tail[-1][:300] if tail else ""


def run_one(dest: Path, file: str, timeout: float) -> Outcome:
    # FAST_TEST=1 as ColossalAI's CI runs them (build_on_pr.yml): the zoo's COMMON_MODELS subset
    env = dict(os.environ, OMP_NUM_THREADS="1", FAST_TEST="1", PYTHONPATH=os.pathsep.join([str(dest), str(ROOT)]))
    start = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", file],
                              cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return Outcome(file, "timeout", time.time() - start, "", f"over {timeout:.0f} s; {_reason(output)}".strip())
    output = proc.stdout + proc.stderr
    log = dest / "logs" / (file.replace("/", "__") + ".log")
    log.parent.mkdir(exist_ok=True)
    log.write_text(output)
    summary = next((line.strip("= ") for line in reversed(output.splitlines()) if " in " in line), "")
    status = "passed" if proc.returncode == 0 else "failed"
    return Outcome(file, status, time.time() - start, summary, "" if status == "passed" else _reason(output))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--colossalai", required=True, type=Path, help="ColossalAI checkout or bare git directory")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test file")
    parser.add_argument("--only", nargs="*", default=[], help="run only files whose path contains one of these")
    parser.add_argument("--keep", type=Path, help="port into this directory (kept) instead of a temporary one")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    args = parser.parse_args()
    dest = args.keep or Path(tempfile.mkdtemp(prefix="colossalai_port_"))
    if args.keep and dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    files = port(args.colossalai.resolve(), dest)
    names = surface(dest)
    for row in names:
        print("\t".join(map(str, row)))
    counts = {status: sum(r[2] == status for r in names) for status in ("present", "refused", "missing")}
    print(f"{len(names)} names imported by the suites and the kit: {counts}", flush=True)
    files = [f for f in files if not args.only or any(key in f for key in args.only)]
    print(f"{len(files)} files build a plugin; ported into {dest}", flush=True)
    outcomes: List[Outcome] = []
    for file in files:
        outcome = run_one(dest, file, args.timeout)
        outcomes.append(outcome)
        print(f"{outcome.status:8s} {outcome.seconds:6.0f} s  {file}  {outcome.counts}  {outcome.reason}", flush=True)
    passed = sum(o.status == "passed" for o in outcomes)
    print(f"\n{passed} of {len(outcomes)} files pass")
    if args.json:
        args.json.write_text(json.dumps({"names": names, "files": [o._asdict() for o in outcomes]}, indent=1))
    if not args.keep:
        shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Running the coverage rows: each (family, class) trained one step at (tp, pp) = (2, 2) on 4 CPU processes against
the unsharded model (hp_check.compare), its result and the source of the policy the plugin picked (choose_policy)
appended to a JSON-lines log; one process group runs the rows in turn and is restarted after a row that crashed a
rank or hung. The log is resumed: rows it holds a result for are not run again."""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional, Tuple

from hp_check.launch import spawn

from coverage_rows import Row

Key = Tuple[str, str]  # (model_type, model class)


def append(path: str, record: Dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def finished(path: str, default_class: Dict[str, str]) -> Dict[Key, Dict]:
    """The last result of each row; a line without `model_class` (older logs) is the family's tested class. A line
    carrying only a plan source (fill_sources) adds it to its row's result."""
    if not os.path.exists(path):
        return {}
    out: Dict[Key, Dict] = {}
    sources: Dict[Key, str] = {}
    with open(path) as f:
        for record in map(json.loads, f):
            key = (record["model_type"], record.get("model_class") or default_class.get(record["model_type"], "-"))
            if "result" in record:
                out[key] = record
            elif "plan_source" in record:
                sources[key] = record["plan_source"]
    for key, source in sources.items():
        if key in out and "plan_source" not in out[key]:
            out[key] = {**out[key], "plan_source": source}
    return out


def build(name: str):
    """(model class, tiny config) of a row, or (None, untested verdict): the same on every rank."""
    import transformers
    from hp_check.tiny import tiny_config
    if name == "-":
        return None, ("untested", "no model class for this config in transformers' auto mappings")
    cls = getattr(transformers, name, None)
    if cls is None:
        return None, ("untested", f"transformers exports no class {name}")
    try:
        return (cls, tiny_config(cls.config_class)), None
    except Exception as error:  # noqa: BLE001
        return None, ("untested", f"no tiny config: {type(error).__name__}: {_line(error)}")


def plan_source(cls, config) -> str:
    """How the plugin picks the policy of this model (shardformer.policies.choose_policy), else why it cannot be
    built or gets none."""
    from shardformer.policies import PlanRefused, choose_policy
    try:
        model = cls(config)
    except Exception as error:  # noqa: BLE001
        return f"- (no tiny model: {type(error).__name__})"
    try:
        return choose_policy(model).describe()
    except PlanRefused:
        return "none (refused)"
    except Exception as error:  # noqa: BLE001
        return f"- ({type(error).__name__} choosing it)"


def _verdict(row: Row) -> Tuple[Tuple[str, str], Optional[str]]:
    import torch.distributed as dist
    from hp_check.compare import compare
    built, verdict = build(row.model_class)
    if verdict is not None:
        return verdict, None
    cls, config = built
    try:
        cls(config)
    except Exception as error:  # noqa: BLE001  (same on every rank, before any collective)
        return ("untested", f"no tiny model: {cls.__name__}(tiny config) fails: {type(error).__name__}: "
                            f"{_line(error)}"), None
    source = plan_source(cls, config) if dist.get_rank() == 0 else None
    return tuple(compare(lambda: cls(config), 2, 2, lr=lr(cls.__name__)))[:2], source


def lr(name: str) -> float:
    """AdamW's learning rate for a class: 1e-4 for heads with a bias whose gradient is zero in exact arithmetic (a
    softmax over positions or choices ignores a shift they share), which Adam's first step moves by lr * rounding /
    eps, differently under tp (tests/test_task_heads.py does the same); else 1e-3."""
    return 1e-4 if name.endswith(("ForQuestionAnswering", "ForMultipleChoice", "DoubleHeadsModel")) else 1e-3


def _run_rows(todo: List[Row], path: str) -> None:
    import torch.distributed as dist
    for row in todo:
        key = {"model_type": row.family.model_type, "model_class": row.model_class}
        if dist.get_rank() == 0:
            append(path, {**key, "started": True})
        start = time.time()
        verdict, source = _verdict(row)
        if dist.get_rank() == 0:
            append(path, {**key, "result": verdict[0], "detail": verdict[1], "plan_source": source,
                          "seconds": round(time.time() - start, 1)})


def run(todo: List[Row], path: str, timeout: float, default_class: Dict[str, str]) -> None:
    """Every row of `todo` the log has no result for, on 4 processes."""
    keys = lambda rows: [(r.family.model_type, r.model_class) for r in rows]  # noqa: E731
    start = time.time()
    while True:
        done = finished(path, default_class)
        left = [r for r, k in zip(todo, keys(todo)) if k not in done]
        if not left:
            return
        reports = spawn(4, _run_rows, left, path, timeout_s=timeout, total_s=3 * 3600)
        done = finished(path, default_class)
        crashed = next((r for r, k in zip(left, keys(left)) if k not in done), None)
        if crashed is not None:  # the row in progress crashed a rank or hung: record it, go on after it
            errors = [r[2] for r in reports if r[1] == "error"]
            detail = errors[0].splitlines()[0][:300] if errors else "a rank hung or died"
            append(path, {"model_type": crashed.family.model_type, "model_class": crashed.model_class,
                          "result": "fail", "detail": detail})
        done = finished(path, default_class)
        print(f"{sum(k in done for k in keys(todo))}/{len(todo)} rows done ({time.time() - start:.0f} s)", flush=True)


def fill_sources(rows: List[Row], path: str, default_class: Dict[str, str]) -> None:
    """The plan source of each logged result without one (older logs), found in this process (no ranks)."""
    done = finished(path, default_class)
    for row in rows:
        record = done.get((row.family.model_type, row.model_class))
        if record is None or record.get("plan_source"):
            continue
        if str(record.get("detail", "")).startswith(("not run", "no tiny", "no model class", "transformers exports")):
            continue  # (no model to ask: too large to build here, or it cannot be built)
        if "seconds" not in record:  # (a row that crashed its ranks, e.g. out of memory: not built again here)
            continue
        built, verdict = build(row.model_class)
        source = plan_source(*built) if built else f"- ({verdict[1].split(':')[0]})"
        append(path, {"model_type": row.family.model_type, "model_class": row.model_class, "plan_source": source})


def _line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else ""

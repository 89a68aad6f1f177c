"""Coverage of the plan-derived policies (not a test): every model family of the installed transformers whose
config declares `base_model_tp_plan` or `base_model_pp_plan` is built from a tiny config with random weights and
trained one step with (tp, pp) = (2, 2) on 4 CPU processes against the unsharded model (loss, every gradient,
parameters after AdamW). Writes docs/coverage.md.

    python benchmarks/coverage.py [--only qwen3,gemma] [--kind "dense decoder"] [--out docs/coverage.md]
                                  [--log results.jsonl] [--table-only] [--note "how"]

With --log, results are appended to that file and families it already holds a result for are not run again
(resume; delete a family's lines to run it again). The table is written once the log holds every family
(--kind runs one kind only; --table-only writes the table from the log without running).

One process group runs the families in turn; when a family crashes a rank or hangs (gloo timeout), the group is
restarted after it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hp_check.launch import spawn  # noqa: E402

MOE_STYLES = ("moe_tp_experts", "moe_identity_expert")
MOE_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class Family(NamedTuple):
    model_type: str
    model_class: str
    kind: str  # "dense decoder", "MoE", "other"


def families(only: List[str]) -> List[Family]:
    import transformers
    from transformers.models.auto import configuration_auto as ca, modeling_auto as ma

    out = []
    for model_type in sorted(ca.CONFIG_MAPPING_NAMES):
        if only and model_type not in only:
            continue
        try:
            config_class = ca.CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001  (a family whose config cannot be imported here)
            continue
        tp_plan = getattr(config_class, "base_model_tp_plan", None) or {}
        if not tp_plan and not getattr(config_class, "base_model_pp_plan", None):
            continue
        causal = ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        name = causal or ma.MODEL_MAPPING_NAMES.get(model_type) or "-"
        if isinstance(name, (list, tuple)):
            name = name[0]
        moe = _is_moe(config_class)
        if causal:  # the class tested may take another config (llama4's causal LM is the MoE llama4_text's)
            try:
                moe = moe or _is_moe(getattr(transformers, name).config_class)
            except Exception:  # noqa: BLE001  (a class that cannot be imported here: judged by its family's config)
                pass
        kind = "MoE" if moe else ("dense decoder" if causal else "other")
        out.append(Family(model_type, name, kind))
    return out


def _is_moe(config_class) -> bool:
    try:
        defaults = config_class()
    except Exception:  # noqa: BLE001
        defaults = None
    tp_plan = getattr(config_class, "base_model_tp_plan", None) or {}
    return any(str(s) in MOE_STYLES for s in tp_plan.values()) or any(getattr(defaults, a, 0) for a in MOE_ATTRS)


def _run_families(todo: List[Family], path: str) -> None:
    import torch.distributed as dist
    import transformers

    from hp_check.compare import compare
    from hp_check.tiny import tiny_config

    for family in todo:
        if dist.get_rank() == 0:
            _append(path, {"model_type": family.model_type, "started": True})
        start = time.time()
        if family.model_class == "-":
            verdict = ("untested", "no model class for this config in transformers' auto mappings")
        else:
            cls = getattr(transformers, family.model_class)
            try:
                config = tiny_config(cls.config_class)
            except Exception as error:  # noqa: BLE001  (same on every rank, before any collective)
                verdict = ("untested", f"no tiny config: {type(error).__name__}: {str(error).splitlines()[0]}")
            else:
                verdict = tuple(compare(lambda: cls(config), 2, 2))[:2]
        if dist.get_rank() == 0:
            _append(path, {"model_type": family.model_type, "result": verdict[0], "detail": verdict[1],
                           "seconds": round(time.time() - start, 1)})


def _append(path: str, record: Dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _finished(path: str) -> Dict[str, Dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {r["model_type"]: r for r in records if "result" in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "coverage.md"))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait")
    parser.add_argument("--log", help="results file (JSON lines) to resume from and append to")
    parser.add_argument("--kind", default="", help="only families of this kind: 'dense decoder', 'MoE' or 'other'")
    parser.add_argument("--table-only", action="store_true", help="write the table from --log without running")
    parser.add_argument("--note", default="", help="how the log was produced (written under the table's title)")
    args = parser.parse_args()
    todo = families([t for t in args.only.split(",") if t])
    log = args.log or os.path.join(tempfile.mkdtemp(), "coverage.jsonl")
    if args.table_only:
        write_table(todo, _finished(log), args.out, args.note)
        return
    run = [f for f in todo if not args.kind or f.kind == args.kind]
    results = {k: v for k, v in _finished(log).items() if k in {f.model_type for f in run}}
    start = time.time()
    while len(results) < len(run):
        left = [f for f in run if f.model_type not in results]
        reports = spawn(4, _run_families, left, log, timeout_s=args.timeout, total_s=3 * 3600)
        results = _finished(log)
        crashed = next((f for f in left if f.model_type not in results), None)
        if crashed is not None:  # the family in progress crashed a rank or hung: record it, go on after it
            errors = [r[2] for r in reports if r[1] == "error"]
            detail = errors[0].splitlines()[0][:300] if errors else "a rank hung or died"
            _append(log, {"model_type": crashed.model_type, "result": "fail", "detail": detail})
            results = {k: v for k, v in _finished(log).items() if k in {f.model_type for f in run}}
        print(f"{len(results)}/{len(run)} families done ({time.time() - start:.0f} s)", flush=True)
    results = _finished(log)
    if all(f.model_type in results for f in todo):
        write_table(todo, results, args.out, args.note or f"one run of {(time.time() - start) / 60:.0f} min")
    else:
        print(f"{log} lacks some families: no table written (run the others, or give --only)")


def write_table(todo: List[Family], results: Dict[str, Dict], out: str, note: str) -> None:
    def result(f: Family) -> str:  # logs of older runs called the harness's own failures "refused"
        r = results[f.model_type]
        detail = str(r.get("detail", ""))
        return "untested" if detail.startswith(("no tiny config", "no model class")) else r["result"]

    dense = [f for f in todo if f.kind == "dense decoder"]
    passed = [f for f in dense if result(f) == "pass"]
    built = [f for f in dense if result(f) != "untested"]
    lines = [
        "# Coverage of plan-derived policies",
        "",
        "Every model family of the installed transformers whose config declares `base_model_tp_plan` or "
        "`base_model_pp_plan`, built from a tiny config (`hp_check/tiny.py`: hidden 32, 4 layers, 4 heads, "
        "2 kv heads, head_dim 8, vocab 100, sliding window 4, the family's layer kinds in turn, small sub-configs and "
        "expert sizes; random weights) and trained one step with (tp, pp) = (2, 2) on 4 CPU processes against the "
        "unsharded model: loss, every gradient and every parameter after AdamW (lr 1e-3, eps 1e-6) at 1e-5, fp32.",
        "",
        "- pass: equal to the unsharded model; refused: a clear error before any collective (the reason); "
        "fail: a mismatch (the loss, else the first gradient by parameter order, else the first parameter after "
        "the step) or an error while training; untested: this script "
        "could not build a tiny model of the family (its config rejects the small sizes, or no auto class), or the "
        "unsharded model itself fails on the script's text-only batch.",
        "- A fail naming only a parameter after AdamW, where its gradient is near zero and differs in the 8th "
        "decimal (e.g. 1.31e-06 vs 1.37e-06 unsharded), is fp32 rounding of that gradient (summation order "
        "differs under tp) amplified by Adam's first step, which moves an element by lr * g / (|g| + eps): up to "
        "lr / eps = 1000 times the gradient's difference. Gradients are reported first, so every gradient of such a "
        "family matched at 1e-5; the check is kept strict, so these stay counted as fails.",
        "- A family is MoE when its config or the tested class's config declares experts (a `moe_*` tp style or "
        "an expert count), dense decoder when it has a causal-LM class, other otherwise.",
        f"- Produced by `python benchmarks/coverage.py --log benchmarks/results/coverage.jsonl` ({note}).",
        "",
        f"**Dense text decoders: {len(passed)} of {len(dense)} pass ({100 * len(passed) / max(len(dense), 1):.0f}%); "
        f"{len(passed)} of the {len(built)} this script could build ({100 * len(passed) / max(len(built), 1):.0f}%).**",
        "",
    ]
    for kind in ("dense decoder", "MoE", "other"):
        rows = [f for f in todo if f.kind == kind]
        counts = {r: sum(result(f) == r for f in rows) for r in ("pass", "refused", "fail", "untested")}
        lines += [f"## {kind} ({len(rows)}: " + ", ".join(f"{n} {r}" for r, n in counts.items()) + ")", "",
                  "| family | model class | result | reason / first mismatch |", "|---|---|---|---|"]
        for f in rows:
            detail = str(results[f.model_type].get("detail", "")).replace("|", "\\|").replace("\n", " ")[:240]
            lines.append(f"| {f.model_type} | {f.model_class} | {result(f)} | {detail} |")
        lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {out}: dense decoders {len(passed)}/{len(dense)} pass ({len(built)} built)")


if __name__ == "__main__":
    main()

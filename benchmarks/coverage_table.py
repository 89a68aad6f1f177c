"""docs/coverage.md from the coverage logs: one row per (family, class), by section (dense decoder, MoE with its
expert parallel columns, other, families without transformers plans), with the source of the plugin's policy and
whether ColossalAI's shardformer lists the class; a summary of ColossalAI's classes; the vision-language section."""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Sequence

from coverage_ep import layout_key
from coverage_rows import KINDS, NO_PLANS, ColossalClass, Family, Row

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
EP_MATRIX = os.path.join(RESULTS, "coverage_ep_matrix.json")
MULTIMODAL = os.path.join(RESULTS, "coverage_multimodal.md")  # the vision-language section (tests/test_multimodal.py)
OUTCOMES = ("pass", "refused", "fail", "untested", "not run")


def cell(text, n: int = 240) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")[:n]


def outcome(record: Optional[Dict]) -> str:
    """A logged result (older logs called the harness's own failures "refused"), "not run" without one."""
    if record is None:
        return "not run"
    detail = str(record.get("detail", ""))
    return "untested" if detail.startswith(("no tiny config", "no tiny model", "no model class")) else record["result"]


def counts(results: Sequence[str]) -> str:
    return ", ".join(f"{results.count(r)} {r}" for r in OUTCOMES if results.count(r) or r != "not run")


def write_table(rows: List[Row], results: Dict, out: str, note: str, colossal: List[ColossalClass],
                ep_results: Dict = None, layouts: Sequence[tuple] = (), ep_note: str = "",
                missing: Sequence[Family] = ()) -> None:
    get = lambda r: results.get((r.family.model_type, r.model_class))  # noqa: E731
    tested = [r for r in rows if r.family.kind == "dense decoder" and r.model_class == r.family.model_class]
    passed = [r for r in tested if outcome(get(r)) == "pass"]
    built = [r for r in tested if outcome(get(r)) not in ("untested", "not run")]
    lines = _intro(note) + _colossal_summary(rows, results, colossal) + [
        f"**Dense text decoders' causal LMs: {len(passed)} of {len(tested)} pass "
        f"({100 * len(passed) / max(len(tested), 1):.0f}%); {len(passed)} of the {len(built)} this script could "
        f"build ({100 * len(passed) / max(len(built), 1):.0f}%).**", ""]
    keys = [layout_key(x) for x in layouts if any(k[1] == layout_key(x) for k in ep_results or {})]
    for kind in KINDS:
        lines += _section(kind, [r for r in rows if r.family.kind == kind], results, colossal,
                          [f.model_type for f in missing if f.kind == kind], ep_results or {}, keys, ep_note)
    lines += _remote(colossal)
    if os.path.exists(MULTIMODAL):
        with open(MULTIMODAL) as f:
            lines += [f.read().rstrip(), ""]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {out}: dense decoders' causal LMs {len(passed)}/{len(tested)} pass; rows: "
          + counts([outcome(get(r)) for r in rows]))


def _intro(note: str) -> List[str]:
    return [
        "# Coverage of the plugin's policies, every task head",
        "",
        "Every model family of the installed transformers whose config declares `base_model_tp_plan` or "
        "`base_model_pp_plan`, and the families without plans that ColossalAI's shardformer covers or a hand-written "
        "policy serves; per family, every class transformers' auto mappings give it (causal LM, base model, sequence / "
        "token classification, question answering, multiple choice, pretraining, ...) and those ColossalAI's policy "
        "list names. Each is built from a tiny config (`hp_check/tiny.py`: hidden 32, 4 layers, 4 heads, 2 kv heads, "
        "head_dim 8, vocab 100, sliding window 4, the family's layer kinds in turn, small sub-configs and expert "
        "sizes; random weights) and trained one step with (tp, pp) = (2, 2) on 4 CPU processes against the unsharded "
        "model: loss, every gradient and every parameter after AdamW (lr 1e-3, eps 1e-6) at 1e-5, fp32. The batch "
        "is the head's (`hp_check/batches.py`: labels, a class per sequence or token, answer spans, choices, "
        "next-sentence labels; pixel values for image models, log-mel features for speech encoders).",
        "",
        "- pass: equal to the unsharded model; refused: a clear error before any collective (the reason); "
        "fail: a mismatch (the loss, else the first gradient by parameter order, else the first parameter after "
        "the step) or an error while training; untested: this script could not build a tiny model of the class "
        "(its config rejects the small sizes, the constructor fails on them, or no auto class), the model needs "
        "inputs the script does not build (named), or the unsharded model itself fails on the script's batch; "
        "not run: no result in the log yet.",
        "- plan source: how the plugin picks the policy (`shardformer.policies.choose_policy`): `transformers` "
        "(derived from the plans transformers declares; `MultimodalPolicy`: a multimodal model's text decoder), "
        "`inferred` (from the model's structure, proven by one forward when sharded), `hand-written` (the policy "
        "named), `none (refused)` (no policy: the result gives the reason).",
        "- ColossalAI: `yes` when ColossalAI's shardformer policy list names the class.",
        "- A fail naming only a parameter after AdamW, where its gradient is near zero and differs in the 8th "
        "decimal (e.g. 1.31e-06 vs 1.37e-06 unsharded), is fp32 rounding of that gradient (summation order "
        "differs under tp) amplified by Adam's first step, which moves an element by lr * g / (|g| + eps): up to "
        "lr / eps = 1000 times the gradient's difference. The check is kept strict, so these stay counted as fails "
        "(a question-answering head's span bias has a zero gradient in exact arithmetic: the same).",
        "- A family is MoE when its config or the tested class's config declares experts (a `moe_*` tp style or "
        "an expert count), dense decoder when it has a causal-LM class, other otherwise.",
        f"- Produced by `python benchmarks/coverage.py --log benchmarks/results/coverage.jsonl` ({note}).",
        "",
    ]


def _colossal_summary(rows: List[Row], results: Dict, colossal: List[ColossalClass]) -> List[str]:
    """ColossalAI's classes: those transformers 5 has by result (the reasons of the others), the remote-code ones."""
    row_of = {r.model_class: r for r in rows}
    get = lambda c: results.get((row_of[c].family.model_type, c)) if c in row_of else None  # noqa: E731
    have = [c for c in colossal if c.in_transformers]
    by = {o: [c for c in have if outcome(get(c.name)) == o] for o in OUTCOMES}
    lines = [f"**ColossalAI's shardformer policy list: {len(colossal)} classes; of the {len(have)} transformers 5 "
             f"still has: " + ", ".join(f"{len(v)} {'exact' if o == 'pass' else o}" for o, v in by.items()
                                        if v or o != "not run")
             + f"; {len(colossal) - len(have)} are remote code (below).**", ""]
    for o in ("refused", "fail", "untested", "not run"):
        reasons: Dict[str, List[str]] = {}
        for c in by[o]:
            reason = re.sub(r"\b\w+(For\w+|Model)\b", "…", str((get(c.name) or {}).get("detail", "")))[:160]
            reasons.setdefault(reason, []).append(c.name)
        lines += [f"- {o}: " + "; ".join(f"{', '.join(names)}" + (f" ({cell(r, 160)})" if r else "")
                                         for r, names in reasons.items())] if reasons else []
    return lines + [""]


def _colossal_cell(name: str, colossal: List[ColossalClass]) -> str:
    direct = any(c.in_transformers and c.name == name for c in colossal)
    remote = [c.path for c in colossal if not c.in_transformers and c.counted_as == name]
    return "yes" if direct else (f"remote code `{remote[0]}`, same architecture" if remote else "")


def _section(kind: str, rows: List[Row], results: Dict, colossal: List[ColossalClass], absent: List[str],
             ep_results: Dict, keys: List[str], ep_note: str) -> List[str]:
    get = lambda r: results.get((r.family.model_type, r.model_class))  # noqa: E731
    families = list(dict.fromkeys(r.family.model_type for r in rows))
    title = "families without transformers plans (ColossalAI's or hand-written)" if kind == NO_PLANS else kind
    lines = [f"## {title} ({len(families)} families, {len(rows)} classes: "
             + counts([outcome(get(r)) for r in rows]) + ")", ""]
    if absent:
        lines += [f"Not in this table: {len(absent)} {kind} families the installed transformers lists that the log "
                  f"has no result for (`--only` them to add): " + ", ".join(absent) + ".", ""]
    ep_here = kind == "MoE" and keys
    if ep_here:
        lines += _ep_intro([r for r in rows if r.model_class == r.family.model_class], ep_results, keys, ep_note)
    head = "| family | class | task | plan source | ColossalAI | (tp, pp) = (2, 2) | reason / first mismatch |"
    ep_head = " aux loss | " + " | ".join(f"ep (ep,tp,pp)=({k})" for k in keys) + " | ep reason / first mismatch |"
    lines += [head + (ep_head if ep_here else ""), "|---" * (7 + (len(keys) + 2 if ep_here else 0)) + "|"]
    for r in rows:
        record = get(r) or {}
        line = (f"| {r.family.model_type} | {r.model_class} | {r.task} | {cell(record.get('plan_source') or '-')} | "
                f"{_colossal_cell(r.model_class, colossal)} | {outcome(get(r))} | {cell(record.get('detail', ''))} |")
        if ep_here:
            line += _ep_cells(r, record, ep_results, keys)
        lines.append(line)
    lines.append("")
    return lines + (_ep_matrix_note() if ep_here else [])


def _ep_cells(row: Row, record: Dict, ep_results: Dict, keys: List[str]) -> str:
    if row.model_class != row.family.model_class:  # (the ep columns test the family's causal LM)
        return " - |" + " - |" * len(keys) + "  |"
    recs = [ep_results.get((row.family.model_type, k), {}) for k in keys]
    aux = "on" if any(r.get("aux_loss") for r in recs) else "-"
    why = _ep_reasons(keys, recs, str(record.get("detail", "")))
    return f" {aux} | " + " | ".join(r.get("result", "not run") for r in recs) + f" | {cell(why, 400)} |"


def _remote(colossal: List[ColossalClass]) -> List[str]:
    remote = [c for c in colossal if not c.in_transformers]
    if not remote:
        return []
    lines = ["## ColossalAI's remote-code classes", "",
             "ColossalAI's policies for models loaded with `trust_remote_code` (`transformers_modules.*`): "
             "transformers 5 has no such class. DeepSeek-V3's architecture is transformers' own `deepseek_v3` "
             "(its rows in the MoE section stand for them); ChatGLM (2/3) and DeepSeek (V1, MoE 16B) have no "
             "transformers counterpart (transformers' `glm` is GLM-4, another architecture).", "",
             "| ColossalAI class | in this table as |", "|---|---|"]
    for c in remote:
        lines.append(f"| `{c.path}` | {c.counted_as + ' (deepseek_v3)' if c.counted_as else 'remote code, not in transformers 5'} |")
    return lines + [""]


def previous_note(out: str) -> str:
    """The '(how)' of the 'Produced by' line of an existing table, else ''."""
    if not os.path.exists(out):
        return ""
    with open(out) as f:
        found = re.search(r"^- Produced by `[^`]*` \((.*)\)\.$", f.read(), re.M)
    return found.group(1) if found else ""


def _ep_reasons(keys: List[str], recs: List[Dict], tp_pp_detail: str) -> str:
    """Each distinct reason of the ep layouts that did not pass, with the layouts it applies to; one the (tp, pp)
    column gives as well is not repeated."""
    canon = lambda d: re.sub(r"rank \d+", "rank #", re.sub(r"-?\d{6,}", "#", d))[:80]  # noqa: E731  (digests)
    reasons: Dict[str, List[str]] = {}
    for k, r in zip(keys, recs):
        if r.get("result", "pass") != "pass" and r.get("detail"):
            detail = str(r["detail"])
            text = "as the (tp, pp) column" if tp_pp_detail and canon(detail) == canon(tp_pp_detail) else detail
            reasons.setdefault(text, []).append(k)
    if len(reasons) == 1 and len(next(iter(reasons.values()))) == len(keys):
        return next(iter(reasons))
    return "; ".join(f"{' '.join(f'({k})' for k in ks)}: {text}" if len(keys) > 1 else text
                     for text, ks in reasons.items())


def _ep_intro(rows: List[Row], ep_results: Dict[tuple, Dict], keys: List[str], note: str) -> List[str]:
    """The MoE section's lines on its ep columns: what they check and their counts."""
    counts = []
    for k in keys:
        got = [ep_results.get((r.family.model_type, k), {}).get("result", "not run") for r in rows]
        counts.append(f"({k}): " + ", ".join(f"{got.count(r)} {r}" for r in ("pass", "refused", "fail", "untested",
                                                                         "not run") if got.count(r)))
    return [
        "Expert parallel columns, ep (ep,tp,pp): the family trained one step with `HybridParallelPlugin(ep_size=ep, "
        "tp_size=tp, pp_size=pp)` on ep x tp x pp CPU processes (dp = ep: each rank holds num_experts / ep whole "
        "experts, tokens travel to them by all-to-all) against the unsharded model, with the router's "
        "load-balancing loss on where the config has one (aux loss `on`: output_router_logits=True, "
        "router_aux_loss_coef=1.0): loss, every gradient (expert parameters gathered over ep) and every parameter "
        "after AdamW at 1e-5, fp32. `python benchmarks/coverage.py --ep --kind MoE --log "
        "benchmarks/results/coverage.jsonl` (log benchmarks/results/coverage_ep.jsonl"
        + (f"; {note}" if note else "") + "). Refused: the plugin's error before any collective (e.g. a family "
        "whose experts are not stacked 3-D weights, or whose expert count ep does not divide); untested as in the "
        "(tp, pp) column.",
        "",
        "- A plan style we cannot apply (packed row-wise, an all-reduce after shared experts, identity experts) is "
        "refused under tensor parallelism only: with tp = 1 such a family trains under ep, pp and dp (Aria, Inkling), "
        "unless its experts cannot be split over ep (LongCat-Flash's experts stack no `num_experts`).",
        "- A fail naming only a parameter after AdamW where its gradient is near zero is the fp32 rounding described "
        "above: under ep the experts' outputs are summed per rank before they are sent back, so the gradients "
        "reaching the layers below (attention too) differ from one process's in the last bits (e.g. beam's v_proj "
        "gradient: 3e-08 apart on a tensor whose largest element is 0.08).",
        "",
        "**ep " + "; ".join(counts) + ".**",
        "",
    ]


def _ep_matrix_note() -> List[str]:
    """The one-off expert parallel matrix (benchmarks/ep_matrix.py), from its results file, if present."""
    if not os.path.exists(EP_MATRIX):
        return []
    with open(EP_MATRIX) as f:
        matrix = json.load(f)
    layouts = matrix["layouts"]
    lines = ["### Expert parallel matrix", "", matrix["note"], "",
             "| model | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
    for model, by_layout in matrix["results"].items():
        lines.append(f"| {model} | " + " | ".join(
            (lambda r: r["result"] + (f": {r['detail']}" if r.get("detail") else ""))(by_layout[k]).replace(
                "|", "\\|").replace("\n", " ")[:200] if k in by_layout else "not run" for k in layouts) + " |")
    lines.append("")
    return lines

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

Expert parallelism (the MoE section's ep columns): with --ep, every MoE family is trained one step under each
layout of --ep-layouts ("ep,tp,pp" triples, ';'-separated; default "2,1,1": ep=2 alone on 2 processes, dp 2 = ep 2)
against the unsharded model, with the router's load-balancing loss on where the config has one
(output_router_logits=True, router_aux_loss_coef=1.0): the same loss, every gradient (expert parameters gathered
over ep) and every parameter after AdamW. A layout runs on ep * tp * pp processes (dp = ep). Results go to --ep-log
(default benchmarks/results/coverage_ep.jsonl, one line per family and layout, resumed like --log), then the table
is rewritten from both logs (families the --log lacks are named under their section, not tabulated).

    python benchmarks/coverage.py --ep [--ep-layouts "2,1,1;2,2,1;2,1,2"] --log benchmarks/results/coverage.jsonl
    python benchmarks/coverage.py --table-only --ep-layouts "2,1,1;2,2,1;2,1,2" --log benchmarks/results/coverage.jsonl

The one-off ep matrix of five families (benchmarks/ep_matrix.py) is rendered under the MoE section from its results.
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
                verdict = _unbuildable(cls, config) or tuple(compare(lambda: cls(config), 2, 2))[:2]
        if dist.get_rank() == 0:
            _append(path, {"model_type": family.model_type, "result": verdict[0], "detail": verdict[1],
                           "seconds": round(time.time() - start, 1)})


EP_LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "coverage_ep.jsonl")


def _layout(text: str) -> tuple:
    ep, tp, pp = (int(x) for x in text.split(","))
    return ep, tp, pp


def _layout_key(layout: tuple) -> str:
    return ",".join(str(x) for x in layout)


def _moe_config(config_class):
    """The tiny config with the router's load-balancing loss on where the family has one; (config, aux_on)."""
    from hp_check.tiny import tiny_config
    defaults = config_class()
    extra = {}
    if hasattr(defaults, "output_router_logits"):
        extra["output_router_logits"] = True
    if getattr(defaults, "router_aux_loss_coef", None) is not None:
        extra["router_aux_loss_coef"] = 1.0
    aux = "output_router_logits" in extra and "router_aux_loss_coef" in extra
    return tiny_config(config_class, **extra), aux


def compare_ep(build, ep: int, tp: int, pp: int, tol: float = 1e-5):
    """One step under HybridParallelPlugin(tp_size=tp, pp_size=pp, ep_size=ep) (dp = world / (tp * pp)) against
    the unsharded model: hp_check.compare's check with expert parameters gathered over ep. Returns (result,
    detail) alike on every rank."""
    import copy

    import torch
    import torch.distributed as dist

    from booster_plugin import Booster, HybridParallelPlugin
    import importlib
    hc = importlib.import_module("hp_check.compare")  # (the package exports its function `compare` too)

    torch.manual_seed(0)
    reference = build().float()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    world = dist.get_world_size()
    dp = world // (tp * pp)
    nmb = max(pp, 2)
    local_size = hc.MICROBATCH * nmb
    data = hc.batch(local_size * dp, seed=1)
    reference.train()
    try:  # the unsharded step first: a model that fails on its own fails on every rank, before any collective
        ref_losses = []
        for r in range(dp):
            for m in range(0, local_size, hc.MICROBATCH):
                mb = {k: v[r * local_size + m:r * local_size + m + hc.MICROBATCH] for k, v in data.items()}
                ref_losses.append(hc.criterion(reference(**mb), mb))
        torch.stack(ref_losses).mean().backward()
    except Exception as error:  # noqa: BLE001
        return "untested", f"the unsharded model fails: {type(error).__name__}: {str(error).splitlines()[0]}"
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, ep_size=ep, num_microbatches=nmb)
    try:
        model, opt, *_ = Booster(plugin=plugin).boost(model, opt, hc.criterion)
    except (NotImplementedError, ValueError) as refused:  # raised on every rank before any collective
        return "refused", str(refused).splitlines()[0].split(" Supported models:")[0]
    except TypeError as refused:  # the experts' forward lacks the routing arguments expert parallelism needs
        if "expert parallelism" not in str(refused):
            raise
        return "refused", str(refused).splitlines()[0]
    model.train()
    local = {k: v[plugin.dp_rank * local_size:(plugin.dp_rank + 1) * local_size] for k, v in data.items()}
    per = len(ref_losses) // dp
    ref_loss = torch.stack(ref_losses[plugin.dp_rank * per:(plugin.dp_rank + 1) * per]).mean()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters(remove_duplicate=False)
                 if p.grad is not None}
    loss = plugin.execute_pipeline(iter([local]), model, hc.criterion, opt, return_loss=True)["loss"]
    opt.step()
    ref_opt.step()
    found = []  # (0 loss/gradient, 1 parameter after the step; model order; message)
    got, want = loss.detach().float().item(), ref_loss.detach().item()
    if not abs(got - want) <= tol * (1 + abs(want)):
        found.append((0, -1, f"loss {got:.6g} != {want:.6g}"))
    experts = model.info.expert_params
    tp_group = plugin.tp_group if tp > 1 else None
    ep_group = plugin.ctx.ep.group
    order = {n: i for i, (n, _) in enumerate(reference.named_parameters(remove_duplicate=False))}
    ref_params = dict(reference.named_parameters(remove_duplicate=False))

    def full(name, p, tensor):  # over tp, then over ep for expert parameters (collective: same order on the group)
        t = hc._full(p, tensor, tp_group)
        if name not in experts:
            return t
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.contiguous(), group=ep_group)
        return torch.cat(parts)

    for name, p in model.unwrap().named_parameters():
        grad, want_grad = p.grad, ref_grads.get(name)
        grad = full(name, p, grad) if grad is not None else None  # (None alike on the ep group: same stage)
        if (grad is None) != (want_grad is None):
            found.append((0, order[name], f"gradient of {name}: {'missing' if grad is None else 'unexpected'}"))
        elif grad is not None and not hc._close(grad, want_grad, tol):
            found.append((0, order[name], f"gradient of {name} differs by {hc._error(grad, want_grad)}"))
        value, expected = full(name, p, p.data), ref_params[name].data
        if not hc._close(value, expected, tol):
            found.append((1, order[name], f"parameter {name} after AdamW differs by {hc._error(value, expected)}"
                          + hc._at_gradient(value, expected, grad, want_grad)))
    everyone = [None] * world
    dist.all_gather_object(everyone, min(found) if found else None)
    found = sorted(m for m in everyone if m is not None)
    return ("fail", found[0][2]) if found else ("pass", "")


def _run_ep_families(todo: List[Family], path: str, layout: tuple) -> None:
    import torch.distributed as dist
    import transformers

    key = _layout_key(layout)
    for family in todo:
        if dist.get_rank() == 0:
            _append(path, {"model_type": family.model_type, "layout": key, "started": True})
        start = time.time()
        aux = False
        if family.model_class == "-":
            verdict = ("untested", "no model class for this config in transformers' auto mappings")
        else:
            cls = getattr(transformers, family.model_class)
            try:
                config, aux = _moe_config(cls.config_class)
            except Exception as error:  # noqa: BLE001  (same on every rank, before any collective)
                verdict = ("untested", f"no tiny config: {type(error).__name__}: {str(error).splitlines()[0]}")
            else:
                verdict = _unbuildable(cls, config) or compare_ep(lambda: cls(config), *layout)
        if dist.get_rank() == 0:
            _append(path, {"model_type": family.model_type, "layout": key, "result": verdict[0],
                           "detail": verdict[1], "aux_loss": aux, "seconds": round(time.time() - start, 1)})


def _finished_ep(path: str) -> Dict[tuple, Dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {(r["model_type"], r["layout"]): r for r in records if "result" in r}


def run_ep(todo: List[Family], layouts: List[tuple], path: str, timeout: float, skip: set) -> None:
    """Every MoE family of `todo` under each layout (resumed from `path`)."""
    moe = [f for f in todo if f.kind == "MoE"]
    for layout in layouts:
        key, world = _layout_key(layout), layout[0] * layout[1] * layout[2]
        for f in moe:  # not run (see --skip): carried as untested with the reason
            if f.model_type in skip and (f.model_type, key) not in _finished_ep(path):
                _append(path, {"model_type": f.model_type, "layout": key, "result": "untested",
                               "detail": "not run: its tiny config still allocates a 32 GiB tensor (a size this "
                                         "script does not shrink)"})
        start = time.time()
        while True:
            done = _finished_ep(path)
            left = [f for f in moe if (f.model_type, key) not in done]
            if not left:
                break
            reports = spawn(world, _run_ep_families, left, path, layout, timeout_s=timeout, total_s=3 * 3600)
            done = _finished_ep(path)
            crashed = next((f for f in left if (f.model_type, key) not in done), None)
            if crashed is not None:  # crashed a rank or hung: record it, go on after it
                errors = [r[2] for r in reports if r[1] == "error"]
                detail = errors[0].splitlines()[0][:300] if errors else "a rank hung or died"
                _append(path, {"model_type": crashed.model_type, "layout": key, "result": "fail", "detail": detail})
            print(f"ep {key}: {sum((f.model_type, key) in _finished_ep(path) for f in moe)}/{len(moe)} families "
                  f"done ({time.time() - start:.0f} s)", flush=True)


def _unbuildable(cls, config):
    """("untested", why) when the family's model cannot be built from its tiny config (the same on every rank,
    before any collective: not a failure of the parallel layout), else None."""
    try:
        cls(config)
    except Exception as error:  # noqa: BLE001
        return "untested", f"no tiny model: {cls.__name__}(tiny config) fails: {type(error).__name__}: " \
                           f"{str(error).splitlines()[0] if str(error) else ''}"
    return None


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
    parser.add_argument("--ep", action="store_true", help="run the MoE families under the --ep-layouts (ep columns)")
    parser.add_argument("--ep-layouts", default="2,1,1", help="';'-separated ep,tp,pp layouts for --ep")
    parser.add_argument("--ep-log", default=EP_LOG, help="results file (JSON lines) of the ep runs")
    parser.add_argument("--ep-note", default="", help="how the ep log was produced (written in the MoE section)")
    parser.add_argument("--skip", default="muse_spark,muse_spark_text",
                        help="model types --ep does not run (recorded as untested)")
    args = parser.parse_args()
    todo = families([t for t in args.only.split(",") if t])
    log = args.log or os.path.join(tempfile.mkdtemp(), "coverage.jsonl")
    layouts = [_layout(t) for t in args.ep_layouts.split(";") if t.strip()]
    if (args.table_only or args.ep) and not args.note:  # keep the note of the table being rewritten
        args.note = _previous_note(args.out)
    if args.ep:
        run_ep(todo, layouts, args.ep_log, args.timeout, {t for t in args.skip.split(",") if t})
    ep_results = _finished_ep(args.ep_log)
    if args.table_only or args.ep:  # the families the log has no result for are named, not tabulated
        done = _finished(log)
        missing = [f for f in todo if f.model_type not in done]
        if missing:
            print(f"{log} lacks {len(missing)} families (named under their sections): "
                  + ", ".join(f.model_type for f in missing))
        write_table([f for f in todo if f.model_type in done], done, args.out, args.note, ep_results, layouts,
                    args.ep_note, missing)
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
        write_table(todo, results, args.out, args.note or f"one run of {(time.time() - start) / 60:.0f} min",
                    _finished_ep(args.ep_log), layouts, args.ep_note)
    else:
        print(f"{log} lacks some families: no table written (run the others, or give --only)")


def write_table(todo: List[Family], results: Dict[str, Dict], out: str, note: str,
                ep_results: Dict[tuple, Dict] = None, layouts: List[tuple] = (), ep_note: str = "",
                missing: List[Family] = ()) -> None:
    def result(f: Family) -> str:  # logs of older runs called the harness's own failures "refused"
        r = results[f.model_type]
        detail = str(r.get("detail", ""))
        return "untested" if detail.startswith(("no tiny config", "no tiny model", "no model class")) else r["result"]

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
        "could not build a tiny model of the family (its config rejects the small sizes, the model's constructor fails "
        "on them, or no auto class), or the "
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
    ep_results = ep_results or {}
    keys = [_layout_key(x) for x in layouts if any(k[1] == _layout_key(x) for k in ep_results)]
    cell = lambda text, n=240: str(text).replace("|", "\\|").replace("\n", " ")[:n]  # noqa: E731
    for kind in ("dense decoder", "MoE", "other"):
        rows = [f for f in todo if f.kind == kind]
        counts = {r: sum(result(f) == r for f in rows) for r in ("pass", "refused", "fail", "untested")}
        lines += [f"## {kind} ({len(rows)}: " + ", ".join(f"{n} {r}" for r, n in counts.items()) + ")", ""]
        absent = [f.model_type for f in missing if f.kind == kind]
        if absent:
            lines += [f"Not in this table: {len(absent)} {kind} families the installed transformers lists that the log "
                      f"has no result for (its run was made with an earlier transformers; `--only` them to add): "
                      + ", ".join(absent) + ".", ""]
        ep_here = kind == "MoE" and keys
        if not ep_here:
            lines += ["| family | model class | result | reason / first mismatch |", "|---|---|---|---|"]
            for f in rows:
                lines.append(f"| {f.model_type} | {f.model_class} | {result(f)} | "
                             f"{cell(results[f.model_type].get('detail', ''))} |")
            lines.append("")
            continue
        lines += _ep_intro(rows, ep_results, keys, ep_note)
        lines += ["| family | model class | (tp, pp) = (2, 2) | reason / first mismatch | aux loss | "
                  + " | ".join(f"ep (ep,tp,pp)=({k})" for k in keys) + " | ep reason / first mismatch |",
                  "|---|---|---|---|---|" + "---|" * len(keys) + "---|"]
        for f in rows:
            recs = [ep_results.get((f.model_type, k), {}) for k in keys]
            aux = "on" if any(r.get("aux_loss") for r in recs) else "-"
            why = _ep_reasons(keys, recs, str(results[f.model_type].get("detail", "")))
            lines.append(f"| {f.model_type} | {f.model_class} | {result(f)} | "
                         f"{cell(results[f.model_type].get('detail', ''))} | {aux} | "
                         + " | ".join(r.get("result", "not run") for r in recs) + f" | {cell(why, 400)} |")
        lines.append("")
        lines += _ep_matrix_note()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {out}: dense decoders {len(passed)}/{len(dense)} pass ({len(built)} built)")


EP_MATRIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "coverage_ep_matrix.json")


def _previous_note(out: str) -> str:
    """The '(how)' of the 'Produced by' line of an existing table, else ''."""
    import re
    if not os.path.exists(out):
        return ""
    with open(out) as f:
        found = re.search(r"^- Produced by `[^`]*` \((.*)\)\.$", f.read(), re.M)
    return found.group(1) if found else ""


def _ep_reasons(keys: List[str], recs: List[Dict], tp_pp_detail: str) -> str:
    """Each distinct reason of the ep layouts that did not pass, with the layouts it applies to; one the (tp, pp)
    column gives as well is not repeated."""
    import re
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


def _ep_intro(rows: List[Family], ep_results: Dict[tuple, Dict], keys: List[str], note: str) -> List[str]:
    """The MoE section's lines on its ep columns: what they check and their counts."""
    counts = []
    for k in keys:
        got = [ep_results.get((f.model_type, k), {}).get("result", "not run") for f in rows]
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
        "- A family refused for a style of its tp plan is refused under ep as well, also with tp = 1 (and with dp "
        "alone): the plugin derives its policy from the plan whatever the tp size.",
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


if __name__ == "__main__":
    main()

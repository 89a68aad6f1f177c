"""Coverage of the plugin's policies (not a test): every model family of the installed transformers whose config
declares `base_model_tp_plan` or `base_model_pp_plan`, and the families without plans that ColossalAI's shardformer
covers or a hand-written policy serves, each of their classes (every task head of transformers' auto mappings, and
those ColossalAI lists) built from a tiny config with random weights and trained one step with (tp, pp) = (2, 2) on 4
CPU processes against the unsharded model (loss, every gradient, parameters after AdamW). Writes docs/coverage.md.

    python benchmarks/coverage.py [--only qwen3,gemma] [--kind "dense decoder"] [--heads] [--out docs/coverage.md]
                                  [--log results.jsonl] [--table-only] [--note "how"]

Without --heads only each family's tested class runs (its causal LM, else its base model); with it, every class.
With --log, results are appended to that file and rows it already holds a result for are not run again (resume;
delete a row's lines to run it again). The table is written from the log (rows without a result: "not run");
--table-only writes it without running. Module layout: coverage_rows.py (families, classes, ColossalAI's list),
coverage_run.py (the (tp, pp) runs, the log), coverage_ep.py (expert parallelism), coverage_table.py (the table).

Expert parallelism (the MoE section's ep columns): with --ep, every MoE family's tested class is trained one step
under each layout of --ep-layouts ("ep,tp,pp" triples, ';'-separated; default "2,1,1": ep=2 alone on 2 processes,
dp 2 = ep 2) against the unsharded model, with the router's load-balancing loss on where the config has one
(output_router_logits=True, router_aux_loss_coef=1.0). A layout runs on ep * tp * pp processes (dp = ep). Results go
to --ep-log (default benchmarks/results/coverage_ep.jsonl, one line per family and layout, resumed like --log).

    python benchmarks/coverage.py --ep [--ep-layouts "2,1,1;2,2,1;2,1,2"] --log benchmarks/results/coverage.jsonl
    python benchmarks/coverage.py --table-only --ep-layouts "2,1,1;2,2,1;2,1,2" --log benchmarks/results/coverage.jsonl

The one-off ep matrix of five families (benchmarks/ep_matrix.py) is rendered under the MoE section from its results.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import coverage_ep  # noqa: E402
import coverage_run  # noqa: E402
from coverage_rows import colossalai_classes, families, rows  # noqa: E402
from coverage_table import previous_note, write_table  # noqa: E402


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--out", default=os.path.join(HERE, "..", "docs", "coverage.md"))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait")
    parser.add_argument("--log", help="results file (JSON lines) to resume from and append to")
    parser.add_argument("--kind", default="", help="only families of this kind: 'dense decoder', 'MoE', 'other' or "
                                                   "'no transformers plans'")
    parser.add_argument("--heads", action="store_true", help="run every class of each family, not only its tested one")
    parser.add_argument("--table-only", action="store_true", help="write the table from --log without running")
    parser.add_argument("--note", default="", help="how the log was produced (written under the table's title)")
    parser.add_argument("--ep", action="store_true", help="run the MoE families under the --ep-layouts (ep columns)")
    parser.add_argument("--ep-layouts", default="2,1,1", help="';'-separated ep,tp,pp layouts for --ep")
    parser.add_argument("--ep-log", default=coverage_ep.EP_LOG, help="results file (JSON lines) of the ep runs")
    parser.add_argument("--ep-note", default="", help="how the ep log was produced (written in the MoE section)")
    parser.add_argument("--skip", default="muse_spark,muse_spark_text",
                        help="model types not run (their tiny config is too large; recorded as untested)")
    return parser.parse_args()


def main() -> None:
    args = _args()
    todo = families([t for t in args.only.split(",") if t])
    colossal = colossalai_classes()
    table = rows(todo, colossal)
    default_class = {f.model_type: f.model_class for f in todo}
    log = args.log or os.path.join(tempfile.mkdtemp(), "coverage.jsonl")
    layouts = [coverage_ep.parse_layout(t) for t in args.ep_layouts.split(";") if t.strip()]
    skip = {t for t in args.skip.split(",") if t}
    note = args.note or previous_note(args.out)  # keep the note of the table being rewritten
    start = time.time()
    if args.ep:
        coverage_ep.run_ep(todo, layouts, args.ep_log, args.timeout, skip)
    elif not args.table_only:
        run = [r for r in table if (not args.kind or r.family.kind == args.kind) and r.family.model_type not in skip
               and (args.heads or r.model_class == r.family.model_class)]
        coverage_run.run(run, log, args.timeout, default_class)
        note = args.note or f"one run of {(time.time() - start) / 60:.0f} min"
    coverage_run.fill_sources(table, log, default_class)
    done = coverage_run.finished(log, default_class)
    missing = [f for f in todo if (f.model_type, f.model_class) not in done]
    if missing:
        print(f"{log} lacks {len(missing)} families' tested class (named under their sections): "
              + ", ".join(f.model_type for f in missing))
    shown = [r for r in table if r.family not in missing]
    write_table(shown, done, args.out, note, colossal, coverage_ep.finished_ep(args.ep_log), layouts, args.ep_note,
                missing)


if __name__ == "__main__":
    main()

"""Expert parallel matrix (a one-off check, not CI): five MoE families trained under ep combined with tp, pp and
moe_dp, against one process, with tests/model_utils.check_training (2 AdamW steps: the loss with the router's
load-balancing loss on, every gradient with expert parameters gathered over ep, every parameter after each step, at
1e-5, fp32) and the tiny MoE builders of tests/test_expert_parallel.py (4 layers, 4 experts, top-2,
output_router_logits=True, router_aux_loss_coef=1.0; DeepSeek-V3 with its first layer dense). The router loss is
on in every cell: a builder with it off is refused, and each cell records `aux_loss`, whether the family's own forward
adds it (false for DeepSeek-V3 only: transformers records its router logits but computes no aux loss).

Layouts (ep, tp, pp) and ranks:
  (2,1,1) on 4 ranks: dp 4 = moe_dp 2 x ep 2 (expert gradients averaged over moe_dp)
  (2,2,1) on 4 ranks: dp 2 = ep 2, each expert split over tp inside
  (2,1,2) on 4 ranks: dp 2 = ep 2, 2 stages, 2 microbatches
  (2,2,2) on 8 ranks: dp 2 = ep 2, tp 2, 2 stages, 2 microbatches

    python benchmarks/ep_matrix.py [--only qwen3moe_lm,...] [--layouts "2,1,1;2,2,2"]

Writes benchmarks/results/coverage_ep_matrix.json, which benchmarks/coverage.py renders under the MoE section of
docs/coverage.md ("Expert parallel matrix").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

OUT = os.path.join(HERE, "results", "coverage_ep_matrix.json")
MODELS = {"qwen3moe_lm": "Qwen3-MoE", "mixtral_lm": "Mixtral", "olmoe_lm": "OLMoE", "gptoss_lm": "GPT-OSS",
          "deepseekv3_lm": "DeepSeek-V3"}
LAYOUTS = {"2,1,1": 4, "2,2,1": 4, "2,1,2": 4, "2,2,2": 8}  # (ep, tp, pp): ranks


def label(layout: str, world: int) -> str:
    ep, tp, pp = (int(x) for x in layout.split(","))
    dp = world // (tp * pp)
    return f"({layout}) {world} ranks" + (f", moe_dp {dp // ep}" if dp > ep else "")


def router_loss(kind: str) -> bool:
    """Raise unless `kind`'s builder records router logits with the load-balancing loss at coefficient 1.0; whether
    the family's own forward adds that loss (transformers computes none for DeepSeek-V3, which records the logits
    only)."""
    import tests.test_expert_parallel  # noqa: F401  (registers the MoE builders in model_utils.MODELS)
    from tests import model_utils as mu
    model = mu.build(kind, layers=2)
    if not (model.config.output_router_logits and getattr(model.config, "router_aux_loss_coef", None) == 1.0):
        raise ValueError(f"{kind}: the matrix runs with the router loss on (output_router_logits=True, "
                         f"router_aux_loss_coef=1.0); its builder has it off")
    return getattr(model(**mu.make_batch(kind, 2, seed=0)), "aux_loss", None) is not None


def cell(kind: str, layout: str) -> None:
    """On every rank: check_training of `kind` under `layout` (raises on the first mismatch); main checked that the
    builder has the router loss on."""
    import tests.test_expert_parallel  # noqa: F401  (registers the MoE builders in model_utils.MODELS)
    from tests import model_utils as mu
    ep, tp, pp = (int(x) for x in layout.split(","))
    kwargs = dict(ep_size=ep, tp_size=tp, pp_size=pp)
    if pp > 1:
        kwargs["num_microbatches"] = 2
    mu.check_training(kind, steps=2, **kwargs)


def first_error(message: str) -> str:
    """The exception line of the first rank's traceback in run_distributed's AssertionError."""
    lines = [line for line in message.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("--- rank"):
            block = []
            for nxt in lines[i + 1:]:
                if nxt.startswith("--- rank"):
                    break
                block.append(nxt)
            errors = [b for b in block if not b.startswith(" ") and ("Error" in b or "Exception" in b)]
            if not block:
                return line
            found = errors[-1] if errors else block[-1]
            worst = [b for b in block if b.startswith("Greatest absolute difference")]
            return (found + (" " + worst[0] if worst else ""))[:400]
    return lines[0][:300] if lines else "failed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model kinds (of tests/test_expert_parallel.py)")
    parser.add_argument("--layouts", default=";".join(LAYOUTS), help="';'-separated ep,tp,pp")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one cell may take")
    args = parser.parse_args()
    import ep_matrix  # this module by name: the ranks unpickle `ep_matrix.cell`, not `__main__.cell`
    from tests.dist_utils import run_distributed

    kinds = [k for k in args.only.split(",") if k] or list(MODELS)
    layouts = [t for t in args.layouts.split(";") if t]
    matrix = {"layouts": [label(t, LAYOUTS[t]) for t in LAYOUTS], "results": {}}
    if os.path.exists(OUT):  # keep the cells not run this time
        with open(OUT) as f:
            matrix["results"] = json.load(f).get("results", {})
    start = time.time()
    for layout in layouts:
        for kind in kinds:
            t0, aux = time.time(), router_loss(kind)
            try:
                run_distributed(LAYOUTS[layout], ep_matrix.cell, kind, layout, timeout=args.timeout)
                result = {"result": "pass"}
            except AssertionError as error:
                result = {"result": "fail", "detail": first_error(str(error))}
            result.update(aux_loss=aux, seconds=round(time.time() - t0, 1))
            matrix["results"].setdefault(MODELS[kind], {})[label(layout, LAYOUTS[layout])] = result
            print(f"{MODELS[kind]:12s} {label(layout, LAYOUTS[layout]):28s} {result['result']} "
                  f"{result.get('detail', '')} ({result['seconds']} s)", flush=True)
    matrix["results"] = {MODELS[k]: matrix["results"][MODELS[k]] for k in MODELS if MODELS[k] in matrix["results"]}
    matrix["note"] = (
        "A one-off run of `python benchmarks/ep_matrix.py` (not in CI): five MoE families (the tiny builders of "
        "tests/test_expert_parallel.py: 4 layers, 4 experts, top-2, router load-balancing loss on with coefficient "
        "1.0 in every cell; DeepSeek-V3 records router logits but transformers adds no aux loss for it: aux_loss "
        "false) trained 2 AdamW steps with tests/model_utils.check_training against one process (loss, every "
        "gradient, every parameter after each step, 1e-5, fp32) under (ep, tp, pp) layouts; dp = world / (tp x pp), "
        "ep carved out of dp (moe_dp = dp / ep), microbatches 2 where pp = 2. "
        f"transformers {_version()}, gloo on this 2-core CPU machine.")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(matrix, f, indent=2)
    print(f"wrote {OUT} ({time.time() - start:.0f} s)")


def _version() -> str:
    import transformers
    return transformers.__version__


if __name__ == "__main__":
    main()

"""What one pipeline chunk costs: our stage (the HF model's own forward, pruned to the chunk: stage.py) vs the
hand-built torch.distributed.pipelining chunk of bench_pipeline.py (the same HF layers called directly), forward and
backward, for each of the two V chunks of each rank (pp=2, 4 chunks of 2 layers: rank 0 holds the embedding chunk and
the head + loss chunk, rank 1 two middle chunks). Same microbatch (2 x 128 tokens), one thread per rank, the two
implementations alternating on the same rank.

If ours cost more per chunk, a pipeline schedule could be beaten by a worse order of cheaper actions; equal costs mean
the schedules compare orders only (bench_pipeline.py's work bound).

Run:  torchrun --nproc_per_node=2 benchmarks/bench_stage_cost.py   [--reps N]
Writes benchmarks/results/bench_stage_cost.json.
"""
from __future__ import annotations

import argparse
import copy
import time

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch

from bench_pipeline import Chunk, shifted_ce
from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.core.stage_calls import chunk_calls, running_step

NAME = "bench_stage_cost"
PER = C.LAYERS // 4  # layers per chunk


def _timed(fn):
    """(forward seconds, backward seconds) of fn() -> (output, its gradient)."""
    start = time.perf_counter()
    out, grad = fn()
    mid = time.perf_counter()
    torch.autograd.backward([out], [grad] if grad is not None else None)
    return mid - start, time.perf_counter() - mid


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    rank = C.init_dist()
    say = C.rank0_printer(rank)
    t_start = time.perf_counter()
    results = {"benchmark": NAME, "env": C.environment(), "hung": []}
    reference = C.build_llama(seed=0)
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=4, pp_style="zbv", num_model_chunks=2)
    model, _ = C.boost_copy(Booster(plugin=plugin), reference)
    sm = plugin.stage_manager
    mb = {k: v[:C.BATCH // 4] for k, v in C.make_batches(1)[0].items()}
    hidden = torch.randn(C.BATCH // 4, C.SEQ, C.HIDDEN)
    grad = torch.randn_like(hidden)
    torch_model = copy.deepcopy(reference)
    calls = chunk_calls(model, sm.num_model_chunks)
    rows, per_rank = [], {}
    for chunk_id, stage in enumerate(sm.layout.stages_of(sm.stage)):
        chunk = Chunk(torch_model, stage * PER, (stage + 1) * PER)
        first, last = stage == 0, stage == sm.layout.num_stages - 1

        def ours():
            with running_step(sm):  # the calls the schedule makes
                received = {} if first else {"hidden_states": hidden.clone().requires_grad_()}
                out = calls[chunk_id](**mb, **received)
            return (C.hf_criterion(out, mb), None) if last else (out["hidden_states"], grad)

        def theirs():
            out = chunk(mb["input_ids"] if first else hidden.clone().requires_grad_())
            return (shifted_ce(out, mb["labels"]), None) if last else (out, grad)

        times = {"ours": [], "torch": []}
        for i in range(args.reps + 5):  # 5 warm-up repetitions, then alternating order
            for name, fn in ((("ours", ours), ("torch", theirs)) if i % 2 else (("torch", theirs), ("ours", ours))):
                t = _timed(fn)
                if i >= 5:
                    times[name].append(t)
            model.zero_grad(set_to_none=True)
            chunk.zero_grad(set_to_none=True)
        entry = {}
        for part, k in (("forward", 0), ("backward", 1)):
            o, t = [x[k] for x in times["ours"]], [x[k] for x in times["torch"]]
            entry[part] = {"ours_median_ms": C.median(o) * 1e3, "torch_median_ms": C.median(t) * 1e3,
                           "ours_min_ms": min(o) * 1e3, "torch_min_ms": min(t) * 1e3,
                           "ours_over_torch_paired": C.paired_ratio(o, t)}
        per_rank[f"virtual stage {stage}"] = entry
    gathered = C.gather_per_rank(per_rank)
    for r, stages in enumerate(gathered):
        for stage, entry in stages.items():
            for part, e in entry.items():
                rows.append([f"rank {r}, {stage}", part, f"{e['ours_median_ms']:.2f}", f"{e['torch_median_ms']:.2f}",
                             f"{e['ours_min_ms']:.2f}", f"{e['torch_min_ms']:.2f}", f"{e['ours_over_torch_paired']:.3f}"])
    results["per_rank"] = gathered
    say(f"\nLlama h{C.HIDDEN}, chunks of {PER} layers, microbatch {C.BATCH // 4} x {C.SEQ}, {args.reps} alternating "
        f"repetitions; load at start {results['env']['loadavg_at_start']}")
    say(C.table(["chunk", "pass", "ours median ms", "torch median ms", "ours min", "torch min", "ours / torch (paired)"],
                rows))
    C.finish(NAME, results, rank, t_start, say, watchdog="none needed: no collective while timing")


if __name__ == "__main__":
    main()

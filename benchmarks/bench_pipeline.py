"""Our schedules (HybridParallelPlugin, pp=2: 1F1B, interleaved with 2 chunks per rank, zero-bubble V, DualPipeV) vs
torch.distributed.pipelining (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble,
ScheduleDualPipeV) vs one process, on the same small Llama, same init, same data, one thread per rank, 2 gloo/CPU
ranks.

Llama: hidden 256, 8 layers, 4 heads, vocab 1024, seq 128, batch 8, AdamW, 4 microbatches. Single-chunk schedules
split 4+4; the multi-chunk ones (ours and torch's) use the same 4 chunks of 2 layers, placed in a loop
(interleaved: rank 0 holds chunks 0 and 2) or a V (zbv, dualpipev: rank 0 holds chunks 0 and 3).
The torch-pipelining chunks are hand-built from the HF modules (embedding on the first, norm + lm_head on the last,
rotary from model.model.rotary_emb, causal mask from transformers' own create_causal_mask) with a shifted
cross-entropy loss_fn, i.e. the same math as LlamaForCausalLM(labels=...).
One-process training runs on rank 0 while rank 1 waits: whole batch, and 4-microbatch gradient accumulation.
All variants run in one process group, interleaved in rounds (rotating order); every variant sees the same batch
sequence, so their losses must agree at every step (checked).

Run:  torchrun --nproc_per_node=2 benchmarks/bench_pipeline.py   [--quick]
Writes benchmarks/results/bench_pipeline.json and, after the timed rounds, a traced step of each of our schedules
to benchmarks/results/trace/<style>/ (timeline.png, trace.json, bubble.json).
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                         ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
from transformers.masking_utils import create_causal_mask

from booster_plugin import Booster, HybridParallelPlugin

NAME = "bench_pipeline"
M = 4  # microbatches
P = 2  # stages
SPLIT = C.LAYERS // 2


# -- torch.distributed.pipelining baseline: hand-built stage modules ----------------------------------------------
def _positions(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


class _LayersMixin:
    def run_layers(self, h: torch.Tensor) -> torch.Tensor:
        pos = _positions(h)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                                  position_ids=pos)
        pe = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return h


class Chunk(nn.Module, _LayersMixin):
    """Layers [start, end) of the HF Llama, with the embedding on the first chunk and norm + head on the last."""

    def __init__(self, model, start: int, end: int) -> None:
        super().__init__()
        self.config = model.config
        self.embed_tokens = model.model.embed_tokens if start == 0 else None
        self.layers = nn.ModuleList(model.model.layers[start:end])
        self.rotary_emb = model.model.rotary_emb
        last = end == C.LAYERS
        self.norm, self.lm_head = (model.model.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.run_layers(self.embed_tokens(x) if self.embed_tokens is not None else x)
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


def shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM's loss: predict token t+1 from position t, mean over tokens."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build_torch_pipelining(reference, schedule_cls, layout: str = "single"):
    """layout: "single" (one 4-layer stage per rank), "loop" or "v" (two 2-layer chunks per rank)."""
    rank = dist.get_rank()
    model = copy.deepcopy(reference)
    if layout == "single":
        indices = [rank]
    else:
        indices = [rank, 2 * P - 1 - rank] if layout == "v" else [rank, P + rank]
    per = C.LAYERS // (P if layout == "single" else 2 * P)
    num_stages = P if layout == "single" else 2 * P
    chunks = [Chunk(model, i * per, (i + 1) * per) for i in indices]
    del model
    stages = [PipelineStage(c, stage_index=i, num_stages=num_stages, device=torch.device("cpu"))
              for c, i in zip(chunks, indices)]
    schedule = schedule_cls(stages[0] if layout == "single" else stages, n_microbatches=M, loss_fn=shifted_ce)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-3)
    has_first, has_last = 0 in indices, num_stages - 1 in indices

    def step(batch):
        losses = []
        args = (batch["input_ids"],) if has_first else ()
        kwargs = {"target": batch["labels"], "losses": losses} if has_last else {}
        schedule.step(*args, **kwargs, return_outputs=False)
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).mean().item() if losses else None  # loss lives with the last stage
    return step


# -- ours ---------------------------------------------------------------------------------------------------------
def build_ours(reference, **style):
    plugin = HybridParallelPlugin(tp_size=1, pp_size=P, num_microbatches=M, **style)
    booster = Booster(plugin=plugin)
    model, opt = C.boost_copy(booster, reference)
    if not style:
        assert plugin.stage_manager.get_stage_index(plugin.stage_manager.distribute_layers(C.LAYERS, P)) == \
            ((0, SPLIT) if dist.get_rank() == 0 else (SPLIT, C.LAYERS))

    def step(batch):
        out = booster.execute_pipeline(iter([batch]), model, C.hf_criterion, opt, return_loss=True)
        opt.step()
        opt.zero_grad()
        return out["loss"].item() if plugin.stage_manager.is_last_stage() else None
    return step


def trace_ours(reference, batches, out_dir: str, **style):
    """Two traced steps of one of our schedules; the timeline of the last goes to out_dir (rank 0 writes)."""
    plugin = HybridParallelPlugin(tp_size=1, pp_size=P, num_microbatches=M, trace=True, **style)
    booster = Booster(plugin=plugin)
    model, opt = C.boost_copy(booster, reference)
    for batch in batches[:2]:
        booster.execute_pipeline(iter([batch]), model, C.hf_criterion, opt)
        opt.step()
        opt.zero_grad()
    return plugin.write_trace(out_dir)


# -- one process (rank 0; rank 1 waits) ----------------------------------------------------------------------------
def _trace_dir(style) -> str:
    return style.get("pp_style", "1f1b") + ("_measured" if style.get("pp_schedule_costs") == "measured" else "")


def build_single(reference, accumulate: bool):
    if dist.get_rank() != 0:
        return lambda batch: None
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        if accumulate:  # the same microbatches as the pipelines, one after another
            size = C.BATCH // M
            total = 0.0
            for i in range(M):
                mb = {k: v[i * size:(i + 1) * size] for k, v in batch.items()}
                loss = model(**mb).loss / M
                loss.backward()
                total += loss.item()
        else:
            loss = model(**batch).loss
            loss.backward()
            total = loss.item()
        opt.step()
        opt.zero_grad()
        return total
    return step


OURS = {"ours 1F1B": {}, "ours interleaved (v=2)": {"pp_style": "interleaved", "num_model_chunks": 2},
        "ours zbv": {"pp_style": "zbv", "num_model_chunks": 2},
        # re-planned for the costs measured in the warm-up step
        "ours zbv, measured costs": {"pp_style": "zbv", "num_model_chunks": 2, "pp_schedule_costs": "measured"},
        "ours dualpipev": {"pp_style": "dualpipev", "num_model_chunks": 2},
        "ours dualpipev, measured costs": {"pp_style": "dualpipev", "num_model_chunks": 2,
                                           "pp_schedule_costs": "measured"}}
TORCH = {"torch Schedule1F1B": (Schedule1F1B, "single"), "torch ScheduleGPipe": (ScheduleGPipe, "single"),
         "torch ScheduleInterleaved1F1B": (ScheduleInterleaved1F1B, "loop"),
         "torch ScheduleZBVZeroBubble": (ScheduleZBVZeroBubble, "v"), "torch ScheduleDualPipeV": (ScheduleDualPipeV, "v")}
SINGLE, SINGLE_ACC = "one process, batch 8", f"one process, {M}x accumulation"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timed rounds")
    parser.add_argument("--quick", action="store_true", help="2 rounds, to check that it runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 2
    rank = C.init_dist()
    results = {"benchmark": NAME, "env": C.environment(), "hung": [],
               "model": {"hidden": C.HIDDEN, "layers": C.LAYERS, "heads": C.HEADS, "vocab": C.VOCAB, "seq": C.SEQ,
                         "batch": C.BATCH, "intermediate": C.INTERMEDIATE, "microbatches": M, "stages": P,
                         "split": [SPLIT, C.LAYERS - SPLIT], "chunks_multi": [C.LAYERS // (2 * P)] * (2 * P),
                         "optimizer": "AdamW(lr=1e-3)", "dtype": "fp32"}}
    dog = C.Watchdog(NAME, results)
    say = C.rank0_printer(rank)
    t_start = time.perf_counter()

    reference = C.build_llama(seed=0)
    batches = C.make_batches(4)
    steps = {name: build_ours(reference, **style) for name, style in OURS.items()}
    steps.update({name: build_torch_pipelining(reference, cls, layout) for name, (cls, layout) in TORCH.items()})
    steps[SINGLE] = build_single(reference, accumulate=False)
    steps[SINGLE_ACC] = build_single(reference, accumulate=True)
    names = list(steps)
    times, cpu, losses = C.interleaved_steps(steps, batches, args.rounds, dog)

    # losses: gather from whichever rank has them
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    per_step = {n: [next(g[n][s] for g in gathered if g[n][s] is not None) for s in range(len(losses[n]))]
                for n in names}
    max_diff = max(max(per_step[n][s] for n in names) - min(per_step[n][s] for n in names)
                   for s in range(len(per_step[names[0]])))
    results["losses_per_step"] = per_step
    cpu_ranks = C.gather_per_rank(cpu)  # [rank][variant] -> list of CPU seconds
    cpu_med = {n: [C.median(cpu_ranks[r][n]) for r in range(len(cpu_ranks))] for n in names}
    results["max_loss_spread_any_step"] = max_diff

    med = {n: C.median(times[n]) for n in names}
    best_ours = min(OURS, key=lambda n: med[n])
    best_torch = min(TORCH, key=lambda n: med[n])
    tokens = C.BATCH * C.SEQ
    pr = lambda a, b: C.paired_ratio(times[a], times[b])  # noqa: E731  median over rounds of time[a] / time[b]
    rows = [[n, f"{med[n] * 1e3:.1f}", f"{min(times[n]) * 1e3:.1f}", f"{tokens / med[n]:.0f}",
             f"{pr(n, best_ours):.3f}", f"{pr(SINGLE, n):.3f}", f"{per_step[n][0]:.6f}"] for n in names]
    ratios = {  # tokens/s ratio x/y = time y / time x
        "best_ours": best_ours, "best_torch": best_torch,
        "best_ours_over_best_torch_tokens_per_s": pr(best_torch, best_ours),
        "best_ours_speedup_over_one_process_batch8": pr(SINGLE, best_ours),
        "best_ours_fraction_of_bubble_free_speedup_p": pr(SINGLE, best_ours) / P,
        "best_torch_speedup_over_one_process_batch8": pr(SINGLE, best_torch),
        "rounds_best_ours_beat_best_torch": sum(a < b for a, b in zip(times[best_ours], times[best_torch])),
        "ours_1f1b_over_Schedule1F1B_tokens_per_s": pr("torch Schedule1F1B", "ours 1F1B"),
        "ours_interleaved_over_ScheduleInterleaved1F1B_tokens_per_s":
            pr("torch ScheduleInterleaved1F1B", "ours interleaved (v=2)"),
        "ours_zbv_over_ScheduleZBVZeroBubble_tokens_per_s": pr("torch ScheduleZBVZeroBubble", "ours zbv"),
        "ours_dualpipev_over_ScheduleDualPipeV_tokens_per_s": pr("torch ScheduleDualPipeV", "ours dualpipev"),
        "ours_zbv_measured_over_unit_cost_order_tokens_per_s": pr("ours zbv", "ours zbv, measured costs"),
        "ours_dualpipev_measured_over_unit_cost_order_tokens_per_s":
            pr("ours dualpipev", "ours dualpipev, measured costs"),
        # no schedule beats the busiest rank's work: its CPU time per step in 1F1B (no split backward, idle excluded)
        "work_bound_speedup_over_one_process": med[SINGLE] / max(cpu_med["ours 1F1B"]),
        # how far each best schedule is from its own busiest rank's work: the idle share of its step
        "best_ours_busiest_rank_idle_fraction": 1 - max(cpu_med[best_ours]) / med[best_ours],
        "best_torch_busiest_rank_idle_fraction": 1 - max(cpu_med[best_torch]) / med[best_torch],
    }
    results["variants"] = [{"name": n, "median_ms": med[n] * 1e3, "min_ms": min(times[n]) * 1e3,
                            "tokens_per_s": tokens / med[n], "paired_time_vs_best_ours": pr(n, best_ours),
                            "speedup_over_one_process_batch8": pr(SINGLE, n),
                            "cpu_ms_median_per_rank": [c * 1e3 for c in cpu_med[n]],
                            "first_step_loss": per_step[n][0], "samples_ms": [t * 1e3 for t in times[n]]}
                           for n in names]
    results["ratios"] = ratios

    say(f"\nLlama h{C.HIDDEN} L{C.LAYERS} heads {C.HEADS} vocab {C.VOCAB} seq {C.SEQ} batch {C.BATCH}, AdamW, m={M}, "
        f"p={P}, fp32, 1 thread/rank, gloo; median of {args.rounds} interleaved steps; load at start "
        f"{results['env']['loadavg_at_start']}")
    say(C.table(["variant", "median ms", "min ms", "tokens/s", "time/best ours", "speedup vs 1 proc",
                 "step-1 loss"], rows))
    say("\n(ratios: median over rounds of the ratio of wall times measured in the same round)")
    say(C.table(["ratio", "value"], [
        [f"best ours ({best_ours}) / best torch ({best_torch}) tokens/s",
         f"{ratios['best_ours_over_best_torch_tokens_per_s']:.3f}"],
        ["rounds where best ours beat best torch", f"{ratios['rounds_best_ours_beat_best_torch']} of {args.rounds}"],
        ["best ours speedup over one process (batch 8)", f"{ratios['best_ours_speedup_over_one_process_batch8']:.3f}"],
        [f"  as a fraction of the bubble-free speedup p={P}",
         f"{ratios['best_ours_fraction_of_bubble_free_speedup_p']:.3f}"],
        ["best torch speedup over one process (batch 8)", f"{ratios['best_torch_speedup_over_one_process_batch8']:.3f}"],
        ["ours 1F1B / torch Schedule1F1B", f"{ratios['ours_1f1b_over_Schedule1F1B_tokens_per_s']:.3f}"],
        ["ours interleaved / torch ScheduleInterleaved1F1B",
         f"{ratios['ours_interleaved_over_ScheduleInterleaved1F1B_tokens_per_s']:.3f}"],
        ["ours zbv / torch ScheduleZBVZeroBubble", f"{ratios['ours_zbv_over_ScheduleZBVZeroBubble_tokens_per_s']:.3f}"],
        ["ours dualpipev / torch ScheduleDualPipeV",
         f"{ratios['ours_dualpipev_over_ScheduleDualPipeV_tokens_per_s']:.3f}"],
        ["ours zbv: measured-cost / unit-cost order",
         f"{ratios['ours_zbv_measured_over_unit_cost_order_tokens_per_s']:.3f}"],
        ["ours dualpipev: measured-cost / unit-cost order",
         f"{ratios['ours_dualpipev_measured_over_unit_cost_order_tokens_per_s']:.3f}"],
        ["bound: one process / busiest rank's CPU per step in ours 1F1B (no bubble, no split)",
         f"{ratios['work_bound_speedup_over_one_process']:.3f}"],
        ["idle share of the step on its busiest rank (1 - CPU / wall): best ours",
         f"{ratios['best_ours_busiest_rank_idle_fraction']:.3f}"],
        ["  best torch", f"{ratios['best_torch_busiest_rank_idle_fraction']:.3f}"],
    ]))
    verdict = C.compare(times[best_ours], times[best_torch], best_ours, best_torch)
    results["verdict_best_ours_vs_best_torch"] = verdict
    say("\n" + verdict["text"])
    say(f"losses: max spread across the {len(names)} variants at any of {len(per_step[names[0]])} steps = "
        f"{max_diff:.2e} (same init, same batches)")
    traces = {}
    for name, style in OURS.items():  # one traced run per schedule, after the timing (the tracer adds barriers)
        traces[name] = trace_ours(reference, batches, os.path.join(C.RESULTS_DIR, "trace", _trace_dir(style)), **style)
    if rank == 0:
        results["trace_bubbles"] = {_trace_dir(OURS[n]): v for n, v in traces.items()}
        # a traced step's work bound: the shortest any order of its actions (as timed in that step) could take
        at_bound = traces[best_ours]["work_bound_ms"] / traces[best_ours]["step_ms"]
        ratios["best_ours_work_bound_over_best_torch_tokens_per_s"] = med[best_torch] / (med[best_ours] * at_bound)
        say(C.table(["schedule", "measured bubble", "own bubble (simulated; *_measured: under measured costs)",
                     "traced step ms", "its work bound ms"],
                    [[_trace_dir(OURS[k]), f"{v['measured_bubble']:.1%}", f"{v['theoretical_bubble']:.1%}",
                      f"{v['step_ms']:.1f}", f"{v['work_bound_ms']:.1f}"] for k, v in traces.items()]))
        say(f"best ours at its traced work bound ({at_bound:.3f} of its traced step), against best torch: "
            f"{ratios['best_ours_work_bound_over_best_torch_tokens_per_s']:.3f} (no order of the same actions does better)")
    C.finish(NAME, results, rank, t_start, say, watchdog="180 s per step")


if __name__ == "__main__":
    main()

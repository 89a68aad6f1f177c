"""Our 1F1B (HybridParallelPlugin, pp=2) vs torch.distributed.pipelining (Schedule1F1B, ScheduleGPipe) vs one
process, on the same small Llama, same init, same data, one thread per rank, 2 gloo/CPU ranks.

Llama: hidden 256, 8 layers (4+4), 4 heads, vocab 1024, seq 128, batch 8, AdamW, 4 microbatches.
The torch-pipelining stages are hand-built from the HF modules (embed + layers 0-3 | layers 4-7 + norm + lm_head,
rotary from model.model.rotary_emb, causal mask from transformers' own create_causal_mask) with a shifted
cross-entropy loss_fn, i.e. the same math as LlamaForCausalLM(labels=...).
One-process training runs on rank 0 while rank 1 waits: whole batch, and 4-microbatch gradient accumulation.
All variants run in one process group, interleaved in rounds (rotating order); every variant sees the same batch
sequence, so their losses must agree at every step (checked).

Run:  torchrun --nproc_per_node=2 benchmarks/bench_pipeline.py   [--quick]
Writes benchmarks/results/bench_pipeline.json.
"""
from __future__ import annotations

import argparse
import copy
import time

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
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


class FirstStage(nn.Module, _LayersMixin):
    def __init__(self, model) -> None:
        super().__init__()
        self.config = model.config
        self.embed_tokens = model.model.embed_tokens
        self.layers = nn.ModuleList(model.model.layers[:SPLIT])
        self.rotary_emb = model.model.rotary_emb

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.run_layers(self.embed_tokens(input_ids))


class LastStage(nn.Module, _LayersMixin):
    def __init__(self, model) -> None:
        super().__init__()
        self.config = model.config
        self.layers = nn.ModuleList(model.model.layers[SPLIT:])
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.rotary_emb = model.model.rotary_emb

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.run_layers(hidden_states)))


def shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM's loss: predict token t+1 from position t, mean over tokens."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build_torch_pipelining(reference, schedule_cls):
    rank = dist.get_rank()
    model = copy.deepcopy(reference)
    module = FirstStage(model) if rank == 0 else LastStage(model)
    del model
    stage = PipelineStage(module, stage_index=rank, num_stages=P, device=torch.device("cpu"))
    schedule = schedule_cls(stage, n_microbatches=M, loss_fn=shifted_ce)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def step(batch):
        losses = []
        if rank == 0:
            schedule.step(batch["input_ids"], return_outputs=False)
        else:
            schedule.step(target=batch["labels"], losses=losses, return_outputs=False)
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).mean().item() if losses else None  # loss lives on the last stage
    return step


# -- ours ---------------------------------------------------------------------------------------------------------
def build_ours(reference):
    plugin = HybridParallelPlugin(tp_size=1, pp_size=P, num_microbatches=M)
    booster = Booster(plugin=plugin)
    model, opt = C.boost_copy(booster, reference)
    assert plugin.stage_manager.get_stage_index(plugin.stage_manager.distribute_layers(C.LAYERS, P)) == \
        ((0, SPLIT) if dist.get_rank() == 0 else (SPLIT, C.LAYERS))

    def step(batch):
        out = booster.execute_pipeline(iter([batch]), model, C.hf_criterion, opt, return_loss=True)
        opt.step()
        opt.zero_grad()
        return out["loss"].item() if dist.get_rank() == P - 1 else None
    return step


# -- one process (rank 0; rank 1 waits) ----------------------------------------------------------------------------
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
                         "split": [SPLIT, C.LAYERS - SPLIT], "optimizer": "AdamW(lr=1e-3)", "dtype": "fp32"}}
    dog = C.Watchdog(NAME, results)
    say = C.rank0_printer(rank)
    t_start = time.perf_counter()

    reference = C.build_llama(seed=0)
    batches = C.make_batches(4)
    steps = {
        "ours 1F1B (HybridParallelPlugin)": build_ours(reference),
        "torch Schedule1F1B": build_torch_pipelining(reference, Schedule1F1B),
        "torch ScheduleGPipe": build_torch_pipelining(reference, ScheduleGPipe),
        "one process, batch 8": build_single(reference, accumulate=False),
        f"one process, {M}x accumulation": build_single(reference, accumulate=True),
    }
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

    ours, t1f1b, gpipe = names[0], names[1], names[2]
    single, single_acc = names[3], names[4]
    med = {n: C.median(times[n]) for n in names}
    tokens = C.BATCH * C.SEQ
    rows = []
    for n in names:
        rows.append([n, f"{med[n] * 1e3:.1f}", f"{min(times[n]) * 1e3:.1f}", f"{tokens / med[n]:.0f}",
                     f"{C.paired_ratio(times[n], times[ours]):.3f}", f"{min(times[n]) / min(times[ours]):.3f}",
                     f"{per_step[n][0]:.6f}"])
    ideal = P * M / (M + P - 1)
    pr = lambda a, b: C.paired_ratio(times[a], times[b])  # median over rounds of time[a] / time[b], same round
    ratios = {  # tokens/s ratio x/y = time y / time x
        "ours_over_Schedule1F1B_tokens_per_s": pr(t1f1b, ours),
        "ours_over_ScheduleGPipe_tokens_per_s": pr(gpipe, ours),
        "speedup_over_one_process_batch8": pr(single, ours),
        "speedup_over_one_process_accum": pr(single_acc, ours),
        "Schedule1F1B_speedup_over_one_process_batch8": pr(single, t1f1b),
        "ours_over_Schedule1F1B_rounds_ours_faster": sum(a < b for a, b in zip(times[ours], times[t1f1b])),
        "ideal_speedup_p_m_over_m_plus_p_minus_1": ideal,
    }
    results["variants"] = [{"name": n, "median_ms": med[n] * 1e3, "min_ms": min(times[n]) * 1e3,
                            "tokens_per_s": tokens / med[n],
                            "paired_time_vs_ours": C.paired_ratio(times[n], times[ours]),
                            "cpu_ms_median_per_rank": [c * 1e3 for c in cpu_med[n]],
                            "cpu_ms_samples_per_rank": [[c * 1e3 for c in cpu_ranks[r][n]] for r in range(len(cpu_ranks))],
                            "first_step_loss": per_step[n][0], "samples_ms": [t * 1e3 for t in times[n]]}
                           for n in names]
    results["ratios"] = ratios

    say(f"\nLlama h{C.HIDDEN} L{C.LAYERS} ({SPLIT}+{C.LAYERS - SPLIT}) heads {C.HEADS} vocab {C.VOCAB} seq {C.SEQ} "
        f"batch {C.BATCH}, AdamW, m={M}, p={P}, fp32, 1 thread/rank, gloo; median of {args.rounds} interleaved steps")
    say(C.table(["variant", "median ms", "min ms", "tokens/s", "time/ours", "min/min ours", "step-1 loss"], rows))
    say("\nCPU time per step (process_time, all threads; leaves out bubbles and time descheduled by other load):")
    say(C.table(["variant", "rank 0 CPU ms", "rank 1 CPU ms", "sum CPU ms", "sum / ours"], [
        [n, f"{cpu_med[n][0] * 1e3:.1f}", f"{cpu_med[n][1] * 1e3:.1f}", f"{sum(cpu_med[n]) * 1e3:.1f}",
         f"{sum(cpu_med[n]) / sum(cpu_med[ours]):.3f}"] for n in names]))
    say("\n(time/ours above and the ratios below: median over rounds of the ratio of wall times measured in the "
        "same round; min/min: ratio of the fastest steps)")
    say(C.table(["ratio", "value"], [
        ["ours / Schedule1F1B tokens/s", f"{ratios['ours_over_Schedule1F1B_tokens_per_s']:.3f}"],
        ["rounds where ours beat Schedule1F1B", f"{ratios['ours_over_Schedule1F1B_rounds_ours_faster']} of {args.rounds}"],
        ["ours / ScheduleGPipe tokens/s", f"{ratios['ours_over_ScheduleGPipe_tokens_per_s']:.3f}"],
        ["ours speedup over one process (batch 8)", f"{ratios['speedup_over_one_process_batch8']:.3f}"],
        [f"ours speedup over one process ({M}x accumulation)", f"{ratios['speedup_over_one_process_accum']:.3f}"],
        ["Schedule1F1B speedup over one process (batch 8)",
         f"{ratios['Schedule1F1B_speedup_over_one_process_batch8']:.3f}"],
        [f"ideal p*m/(m+p-1) = {P}*{M}/{M + P - 1}", f"{ideal:.3f}"],
        ["ours efficiency vs ideal (batch-8 baseline)", f"{ratios['speedup_over_one_process_batch8'] / ideal:.3f}"],
    ]))
    verdict = C.compare(times[ours], times[t1f1b], "ours", "Schedule1F1B")
    results["verdict_ours_vs_Schedule1F1B"] = verdict
    say("\n" + verdict["text"])
    say(f"losses: max spread across the {len(names)} variants at any of {len(per_step[names[0]])} steps = "
        f"{max_diff:.2e} (same init, same batches)")
    C.finish(NAME, results, rank, t_start, say, watchdog="180 s per step")


if __name__ == "__main__":
    main()

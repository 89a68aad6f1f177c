"""Our tensor parallelism (HybridParallelPlugin, tp=2) vs PyTorch DTensor TP (parallelize_module) vs one process,
on the same Llama, same init, same data, one thread per rank, 2 gloo/CPU ranks.

Llama: hidden 256, 8 layers, 8 heads / 4 kv heads (GQA), intermediate 1024, vocab 1024, seq 128, batch 8, fp32,
AdamW(lr=1e-3) (PyTorch's default implementation on CPU, the per-tensor loop, for every variant).

Per-layer plans are the same Megatron split:
  ours:    q/k/v/gate/up ColumnParallelLinear, o/down RowParallelLinear; embed_tokens VocabParallelEmbedding
           (vocab rows split, output all-reduced); lm_head column-parallel over the vocab with the vocab-parallel
           cross-entropy (parallel_output=True, logits never gathered).
  DTensor: ColwiseParallel for q/k/v/gate/up, RowwiseParallel for o/down (use_local_output=True, so HF's attention
           sees local tensors and reshapes to 4 local heads / 2 local kv heads with its -1); embed_tokens
           RowwiseParallel(input Replicate, output Replicate) = vocab rows split + all-reduce; lm_head
           ColwiseParallel(output Shard(-1), DTensor logits) and forward+backward under loss_parallel(), so HF's own
           F.cross_entropy runs vocab-parallel. The same math as ours.
  Differences: DTensor all-reduces the input gradient once per column-parallel linear in backward (q, k, v and
  gate, up: 5 per layer), ours once per region (attention, MLP: 2 per layer, `enter_tp_regions_once`) while the
  region's weight gradients are computed (layer/deferred.py); our sums over the tp group are one send/receive with
  the partner and an add (layer/comm.py `start_sum`), DTensor's are gloo all-reduces; norms and rotary stay plain
  replicated tensors in both; DTensor parameters go through DTensor dispatch in AdamW.
One-process training runs on rank 0 while rank 1 waits. Variants run interleaved in rounds (rotating order) and see
the same batch sequence, so their losses agree at every step (checked). After the timed rounds one step of each TP
variant runs under torch.profiler to show where the time goes (collectives vs compute vs the rest).

Run:  torchrun --nproc_per_node=2 benchmarks/bench_tp.py   [--rounds N] [--quick]
Writes benchmarks/results/bench_tp.json.
"""
from __future__ import annotations

import argparse
import copy
import time
from collections import defaultdict

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from booster_plugin import Booster, HybridParallelPlugin
from shardformer.layer.comm import PendingSum, start_sum

NAME = "bench_tp"
TP = 2
MODEL = dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=1024)
OURS, DTENSOR, SINGLE = "ours tp=2 (HybridParallelPlugin)", "DTensor tp=2 (parallelize_module)", "one process"


class Phases:
    """Per-step wall and CPU time of forward (incl. loss), backward and optimizer on this rank (no barriers
    inside). CPU time (process_time: this process, all its threads) leaves out waiting for the peer."""

    def __init__(self) -> None:
        self.samples = defaultdict(list)
        self._t = self._c = 0.0

    def start(self) -> None:
        self._t, self._c = time.perf_counter(), time.process_time()

    def mark(self, phase: str) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self.samples[phase].append(now - self._t)
        self.samples[phase + " cpu"].append(cpu - self._c)
        self._t, self._c = now, cpu


def build_ours(reference, phases: Phases):
    booster = Booster(plugin=HybridParallelPlugin(tp_size=TP, pp_size=1))
    model, opt = C.boost_copy(booster, reference)

    def step(batch):
        phases.start()
        loss = model(**batch).loss
        phases.mark("forward")
        booster.backward(loss, opt)
        phases.mark("backward")
        opt.step()
        opt.zero_grad()
        phases.mark("optimizer")
        return loss.item()
    return step


def dtensor_plan(layers: int):
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(layers):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    return plan


def build_dtensor(reference, phases: Phases):
    mesh = DeviceMesh("cpu", list(range(TP)))
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh, dtensor_plan(reference.config.num_hidden_layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        phases.start()
        with loss_parallel():
            loss = model(**batch).loss  # a replicated DTensor
            phases.mark("forward")
            loss.backward()
            phases.mark("backward")
        opt.step()
        opt.zero_grad()
        phases.mark("optimizer")
        return loss.full_tensor().item()
    return step


def build_single(reference, phases: Phases):
    if dist.get_rank() != 0:
        return lambda batch: None
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        phases.start()
        loss = model(**batch).loss
        phases.mark("forward")
        loss.backward()
        phases.mark("backward")
        opt.step()
        opt.zero_grad()
        phases.mark("optimizer")
        return loss.item()
    return step


# -- where the time goes ------------------------------------------------------------------------------------------
def profile_step(step, batch):
    """One step under torch.profiler (record_shapes) with dist.all_reduce wrapped in a timer. Returns
    - the collectives gloo ran (its `gloo:*` records carry the shapes; both dist.* and DTensor's functional
      collectives end there): count, payload bytes and sizes;
    - wall ms the main thread spent in collectives, waiting for the peer included: for ours the wrapped blocking
      dist.all_reduce calls; for DTensor the profiler's _c10d_functional::all_reduce (launch) + wait_tensor;
    - the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    original, spent = dist.all_reduce, [0.0, 0]

    def timed_all_reduce(*a, **k):
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    original_wait = PendingSum.wait

    def timed_wait(self):  # our tp sums: from the wait's start (the exchange was posted just before)
        t0 = time.perf_counter()
        try:
            return original_wait(self)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    dist.barrier()
    dist.all_reduce, PendingSum.wait = timed_all_reduce, timed_wait
    t0 = time.perf_counter()
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step(batch)
    finally:
        dist.all_reduce, PendingSum.wait = original, original_wait
    wall = time.perf_counter() - t0
    sizes = defaultdict(list)
    for e in prof.events():
        if e.name.startswith("gloo:") and e.input_shapes:
            numel = 1
            for d in e.input_shapes[0]:
                numel *= d
            sizes[e.name].append(numel)
    events = prof.key_averages()
    functional = sum(e.cpu_time_total for e in events
                     if e.key in ("_c10d_functional::all_reduce", "_c10d_functional::wait_tensor")) / 1e3
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {"wall_ms_under_profiler": wall * 1e3,
            "collectives": {k: {"count": len(v), "bytes": 4 * sum(v), "numels": v} for k, v in sizes.items()},
            "ms_in_collectives": spent[0] * 1e3, "collective_calls": spent[1],
            "ms_in_functional_collectives": functional,
            "top_self_cpu": [[e.key, e.count, e.self_cpu_time_total / 1e3] for e in top]}


def replay_collectives(numels, reps: int = 3, exchange: bool = False) -> float:
    """Median ms for the same sequence of fp32 sums on their own (no compute between them): the cost of the step's
    collectives on this machine when both ranks arrive together. `exchange`: our tp sums (start_sum: one
    send/receive with the partner per sum), else all-reduces."""
    bufs = [torch.zeros(n) for n in numels]
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for b in bufs:
            if exchange:
                start_sum(b, None, in_place=True).wait()
            else:
                dist.all_reduce(b)
        out.append(time.perf_counter() - t0)
    return C.median(out) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=25, help="interleaved timed rounds")
    parser.add_argument("--quick", action="store_true", help="2 rounds, to check that it runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 2
    rank = C.init_dist()
    results = {"benchmark": NAME, "env": C.environment(), "hung": [],
               "model": {"hidden": C.HIDDEN, "layers": C.LAYERS, "heads": MODEL["num_attention_heads"],
                         "kv_heads": MODEL["num_key_value_heads"], "intermediate": MODEL["intermediate_size"],
                         "vocab": C.VOCAB, "seq": C.SEQ, "batch": C.BATCH, "optimizer": "AdamW(lr=1e-3)",
                         "dtype": "fp32", "tp": TP}}
    dog = C.Watchdog(NAME, results)
    say = C.rank0_printer(rank)
    t_start = time.perf_counter()

    reference = C.build_llama(seed=0, **MODEL)
    batches = C.make_batches(4)
    phases = {n: Phases() for n in (OURS, DTENSOR, SINGLE)}
    steps = {OURS: build_ours(reference, phases[OURS]), DTENSOR: build_dtensor(reference, phases[DTENSOR]),
             SINGLE: build_single(reference, phases[SINGLE])}
    names = list(steps)

    def clear_phases():  # the phase breakdown counts timed steps only
        for ph in phases.values():
            ph.samples.clear()
    times, cpu, losses = C.interleaved_steps(steps, batches, args.rounds, dog, after_warmup=clear_phases)

    # where the time goes: one profiled step, then one counted step, per TP variant (not timed, same batches)
    dog.arm("profiling", 300)
    prof = {}
    for n in (OURS, DTENSOR, OURS, DTENSOR):  # two profiled steps each, interleaved; keep the faster one
        p = profile_step(steps[n], batches[0])
        if n not in prof or p["wall_ms_under_profiler"] < prof[n]["wall_ms_under_profiler"]:
            prof[n] = p
    replay = {n: replay_collectives(prof[n]["collectives"].get("gloo:all_reduce", {"numels": []})["numels"])
              for n in (OURS, DTENSOR)}
    replay[OURS] += replay_collectives(prof[OURS]["collectives"].get("gloo:send", {"numels": []})["numels"],
                                       exchange=True)
    dog.disarm()

    gathered = C.gather_per_rank(losses)
    per_step = {n: [next(g[n][s] for g in gathered if g[n][s] is not None) for s in range(len(losses[n]))]
                for n in names}
    max_diff = max(max(per_step[n][s] for n in names) - min(per_step[n][s] for n in names)
                   for s in range(args.rounds + 1))
    first_diff = max(per_step[n][0] for n in names) - min(per_step[n][0] for n in names)
    cpu_ranks = C.gather_per_rank(cpu)
    phase_ranks = C.gather_per_rank({n: {k: C.median(v) for k, v in ph.samples.items()} for n, ph in phases.items()})
    prof_ranks = C.gather_per_rank(prof)

    tokens = C.BATCH * C.SEQ
    med = {n: C.median(times[n]) for n in names}
    rows = [[n, f"{med[n] * 1e3:.1f}", f"{min(times[n]) * 1e3:.1f}", f"{tokens / med[n]:.0f}",
             f"{C.paired_ratio(times[n], times[OURS]):.3f}", f"{min(times[n]) / min(times[OURS]):.3f}",
             f"{per_step[n][0]:.6f}"] for n in names]
    ratio = C.paired_ratio(times[DTENSOR], times[OURS])  # tokens/s ours / DTensor
    results.update({
        "variants": [{"name": n, "median_ms": med[n] * 1e3, "min_ms": min(times[n]) * 1e3,
                      "tokens_per_s": tokens / med[n], "paired_time_vs_ours": C.paired_ratio(times[n], times[OURS]),
                      "first_step_loss": per_step[n][0], "samples_ms": [t * 1e3 for t in times[n]],
                      "cpu_ms_median_per_rank": [C.median(cpu_ranks[r][n]) * 1e3 for r in range(TP)],
                      "phase_ms_median_per_rank": [{k: v * 1e3 for k, v in phase_ranks[r][n].items()}
                                                   for r in range(TP)]} for n in names],
        "losses_per_step": per_step, "first_step_loss_spread": first_diff, "max_loss_spread_any_step": max_diff,
        "ratios": {"ours_over_dtensor_tokens_per_s_paired": ratio,
                   "ours_over_dtensor_tokens_per_s_min": min(times[DTENSOR]) / min(times[OURS]),
                   "ours_speedup_over_one_process": C.paired_ratio(times[SINGLE], times[OURS]),
                   "dtensor_speedup_over_one_process": C.paired_ratio(times[SINGLE], times[DTENSOR]),
                   "target_ours_over_dtensor": 1.2},
        "profile_per_rank": prof_ranks, "replayed_all_reduces_ms_rank0": replay,
        "verdict": C.compare(times[OURS], times[DTENSOR], "ours", "DTensor"),
    })

    say(f"\nLlama h{C.HIDDEN} L{C.LAYERS} heads {MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']} kv, "
        f"ffn {MODEL['intermediate_size']}, vocab {C.VOCAB}, seq {C.SEQ}, batch {C.BATCH}, AdamW, fp32, tp={TP}, "
        f"1 thread/rank, gloo; median of {args.rounds} interleaved steps")
    say(C.table(["variant", "median ms", "min ms", "tokens/s", "time/ours", "min/min ours", "step-1 loss"], rows))
    say("\nPer phase, median ms on rank 0 | rank 1 (forward includes the loss); wall, then CPU (process_time, "
        "leaves out waiting); CPU ms of the whole step:")
    ph = lambda n, k: " | ".join(f"{phase_ranks[r][n].get(k, float('nan')) * 1e3:.0f}" for r in range(TP))
    say(C.table(["variant", "forward", "backward", "optimizer", "fwd CPU", "bwd CPU", "opt CPU", "step CPU"], [
        [n] + [ph(n, k) for k in ("forward", "backward", "optimizer", "forward cpu", "backward cpu",
                                   "optimizer cpu")]
        + [" | ".join(f"{C.median(cpu_ranks[r][n]) * 1e3:.0f}" for r in range(TP))] for n in names]))
    say("\nWhere the time goes, one profiled step (rank 0 | rank 1). 'in collectives' = wall ms inside them, waiting "
        "for the peer included; 'replayed' = the same all-reduces back to back on their own (rank 0):")
    rows = []
    for n in (OURS, DTENSOR):
        p0 = prof_ranks[0][n]
        colls = "; ".join(f"{k.removeprefix('gloo:')} x{v['count']} {v['bytes'] / 2 ** 20:.1f} MiB"
                          for k, v in p0["collectives"].items())
        key = "ms_in_collectives" if n == OURS else "ms_in_functional_collectives"
        rows.append([n, colls, " | ".join(f"{prof_ranks[r][n]['wall_ms_under_profiler']:.0f}" for r in range(TP)),
                     " | ".join(f"{prof_ranks[r][n][key]:.0f}" for r in range(TP)), f"{replay[n]:.0f}"])
    say(C.table(["variant", "collectives per step", "step ms", "in collectives ms", "replayed ms"], rows))
    say("Top ops by self CPU time in that step (rank 0; an autograd Function's self time includes the blocking "
        "wait of the dist call inside it):")
    for n in (OURS, DTENSOR):
        say(f"  {n}: " + "; ".join(f"{k} x{c} {ms:.0f} ms" for k, c, ms in prof_ranks[0][n]["top_self_cpu"][:8]))
    say("\n" + C.table(["ratio", "value"], [
        ["ours / DTensor tokens/s (paired median)", f"{ratio:.3f}"],
        ["ours / DTensor tokens/s (ratio of minima)", f"{results['ratios']['ours_over_dtensor_tokens_per_s_min']:.3f}"],
        ["target", ">= 1.2"],
        ["ours speedup over one process", f"{results['ratios']['ours_speedup_over_one_process']:.3f}"],
        ["DTensor speedup over one process", f"{results['ratios']['dtensor_speedup_over_one_process']:.3f}"],
    ]))
    say(results["verdict"]["text"])
    say(f"losses: step-1 spread {first_diff:.2e}, max spread at any of {args.rounds + 1} steps {max_diff:.2e}")
    C.finish(NAME, results, rank, t_start, say, watchdog="180 s per step", loadavg_label="")


if __name__ == "__main__":
    main()

"""Per-rank memory of HybridParallelPlugin layouts, against the ideal split of the unsharded figures (counts, no timing).

Model: Llama hidden 512, 8 layers, 8 heads (8 kv), ffn 1536, vocab 8192 (untied), seq 128, global batch 8, fp32,
AdamW. Layouts (tp, pp, dp): (1,1,1), (2,1,1), (1,2,1), (2,2,1), (1,1,2); pp layouts use 1F1B with m=4
microbatches; dp ranks get 8/dp samples each (as prepare_dataloader would). (2,1,1) and (2,2,1) also run with
sequence parallelism (enable_sequence_parallelism=True, sequence_parallelism_mode "split_gather" and "all_to_all";
all_to_all replicates the decoder layers' weights over tp by design, so only its activations are held to the
ideal). (1,1,1) also runs with m=4 gradient
accumulation (pp_size=1, num_microbatches=4: one microbatch at a time), the reference for pipelined activations.
HybridParallelPlugin uses the whole world, so there is one torchrun per world size (1, 2, 4).

Per rank, one training step:
  parameters   bytes of this rank's (unique) parameters after boosting;
  gradients    bytes of .grad after forward+backward (before optimizer.step);
  optimizer    bytes of the tensors in the optimizer's state after its first step (AdamW: exp_avg, exp_avg_sq,
               step);
  activations  peak of the bytes autograd keeps saved for backward, measured with
               torch.autograd.graph.saved_tensors_hooks around the whole forward/backward: every saved tensor is
               tracked by its storage (counted once however many views are saved; parameter storages excluded)
               from pack until autograd releases it, and the peak of the live sum is reported. This is the
               activation memory a training step holds for backward; it leaves out short-lived temporaries
               (allocator peaks inside one op), which torch.profiler(profile_memory=True) would include but on CPU
               only as an allocation trace.
Ideal: parameters, gradients and optimizer state = unsharded / (tp*pp) (dp replicates them; zero_stage=0);
activations = unsharded / (tp*pp*dp) for the whole batch, and for 1F1B = the m=4 reference (one microbatch of the
whole model) * in-flight microbatches on the stage (min(pp - stage, m)) / (tp*pp).

ZeRO rows (world 2, (1,1,2), bf16 so that fp32 master weights exist, zero_stage 0/1/2), per rank after one step:
  optimizer state  bytes of the tensors in the optimizer's state (AdamW exp_avg, exp_avg_sq, 0-dim steps);
  master weights   bytes of the fp32 tensors the optimizer steps (ZeRO: this rank's segments);
  gradients        bytes of the distinct gradient storages held at the step: the reduced bf16 gradients (bucket
                   buffers; ZeRO-2: this rank's reduce-scattered slice) and the fp32 master gradients.
  Target: zero_stage 1 and 2 hold 1/dp of zero_stage 0's optimizer state and master weights (ZeRO-2 also of the
  gradients), up to the padding of each bucket to a multiple of dp and the 0-dim step of split parameters.
Activation checkpointing rows (world 1, (1,1,1), fp32): peak memory of one forward+backward above what was allocated
before it, from torch.profiler(profile_memory=True) (each op's self allocations minus frees, in time order: all
allocations including temporaries, at op granularity), with gradient_checkpoint_config off and on (every layer).

Run:  python benchmarks/bench_memory.py        (launches torchrun --nproc_per_node=1, 2 and 4)
Writes benchmarks/results/bench_memory.json.
"""
from __future__ import annotations

import os
import time

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.distributed as dist

NAME = "bench_memory"
MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
             intermediate_size=1536, vocab_size=8192)
SEQ, BATCH, M = 128, 8, 4
# world size -> [(label, tp, pp, dp, num_microbatches, sequence_parallelism_mode)]
LAYOUTS = {1: [("(1,1,1)", 1, 1, 1, None, None), ("(1,1,1) m=4 accumulation", 1, 1, 1, M, None)],
           2: [("(2,1,1)", 2, 1, 1, None, None), ("(1,2,1) m=4", 1, 2, 1, M, None), ("(1,1,2)", 1, 1, 2, None, None),
               ("(2,1,1) sp split_gather", 2, 1, 1, None, "split_gather"),
               ("(2,1,1) sp all_to_all", 2, 1, 1, None, "all_to_all")],
           4: [("(2,2,1) m=4", 2, 2, 1, M, None), ("(2,2,1) m=4 sp split_gather", 2, 2, 1, M, "split_gather"),
               ("(2,2,1) m=4 sp all_to_all", 2, 2, 1, M, "all_to_all")]}
ZERO_ROWS = [f"(1,1,2) bf16 zero_stage={s}" for s in (0, 1, 2)]
CKPT_ROWS = ["(1,1,1) activation checkpointing off", "(1,1,1) activation checkpointing on"]
EXTRA_ROWS = {1: CKPT_ROWS, 2: ZERO_ROWS}
HERE = os.path.abspath(__file__)
MiB = 2 ** 20


class SavedTensorMeter:
    """Live and peak bytes of the storages autograd holds for backward (saved_tensors_hooks)."""

    def __init__(self, exclude_storages) -> None:
        self.exclude = set(exclude_storages)
        self.live = {}  # storage ptr -> [handles alive, nbytes]
        self.current = self.peak = self.packed = 0
        self.where = None  # callable -> the module path running now (attribution), or None
        self.by_module = {}  # module path (layer index -> *) -> bytes of the storages first saved there

    class _Handle:
        __slots__ = ("meter", "key", "tensor")

        def __del__(self):
            self.meter._release(self.key)

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return t.detach()
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [0, storage.nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
            if self.where is not None:
                kind = self.where()
                self.by_module[kind] = self.by_module.get(kind, 0) + entry[1]
        entry[0] += 1
        self.packed += 1
        h = SavedTensorMeter._Handle()
        h.meter, h.key, h.tensor = self, key, t.detach()  # detached alias: no reference cycle through grad_fn
        return h

    @staticmethod
    def unpack(h):
        return h.tensor if isinstance(h, SavedTensorMeter._Handle) else h

    def _release(self, key) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def measure(label, tp, pp, dp, m, sp, reference, batch):
    from booster_plugin import Booster, HybridParallelPlugin
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=m, enable_sequence_parallelism=sp is not None,
                                  sequence_parallelism_mode=sp)
    assert plugin.dp_size == dp, (label, plugin.dp_size)
    booster = Booster(plugin=plugin)
    model, opt = C.boost_copy(booster, reference)
    params = list(model.unwrap().parameters())
    per = BATCH // dp
    local = {k: v[plugin.dp_rank * per:(plugin.dp_rank + 1) * per] for k, v in batch.items()}
    meter = SavedTensorMeter(p.untyped_storage().data_ptr() for p in params)
    handles = []
    if m is None:  # attribute saved bytes to the module whose forward saved them (not with a pipeline's early exit)
        import re
        from torch.nn.modules import module as nn_module
        names = {id(mod): re.sub(r"\.\d+\.", ".*.", name) or "(model: loss)"
                 for name, mod in model.unwrap().named_modules()}
        stack = []
        handles = [nn_module.register_module_forward_pre_hook(lambda mod, a: stack.append(names.get(id(mod)))),
                   nn_module.register_module_forward_hook(lambda mod, a, o: stack.pop() and None)]
        meter.where = lambda: next((n for n in reversed(stack) if n is not None), "(outside modules)")
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            if m is not None:
                booster.execute_pipeline(iter([local]), model, C.hf_criterion, opt, return_loss=True)
            else:
                booster.backward(model(**local).loss, opt)
    finally:
        for h in handles:
            h.remove()
    leaked = meter.current  # should be 0: everything saved was released by backward
    grads = _bytes(p.grad for p in params)
    opt.step()
    state = _bytes(t for s in opt.optim.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    opt.zero_grad()
    inflight = min(pp - plugin.stage, m) if m is not None and pp > 1 else 1
    out = {"stage": plugin.stage, "tp_rank": plugin.tp_rank, "dp_rank": plugin.dp_rank, "params": _bytes(params),
           "grads": grads, "optimizer": state, "activations_peak": meter.peak, "saved_left_after_backward": leaked,
           "saved_tensors_packed": meter.packed, "inflight_microbatches": inflight,
           "peak_inflight_reported_by_schedule": getattr(plugin.schedule, "peak_inflight_microbatches", None),
           "batch_per_rank": per, "saved_bytes_by_module": meter.by_module}
    del model, opt, booster, plugin
    return out


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    storages = {}
    for t in tensors:
        if t is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def measure_zero(stage, reference, batch):
    from booster_plugin import Booster, HybridParallelPlugin
    plugin = HybridParallelPlugin(precision="bf16", zero_stage=stage)
    booster = Booster(plugin=plugin)
    model, opt = C.boost_copy(booster, reference)
    per = BATCH // plugin.dp_size
    local = {k: v[plugin.dp_rank * per:(plugin.dp_rank + 1) * per] for k, v in batch.items()}
    booster.backward(model(**local).loss, opt)
    opt.step()
    stepped = [q for group in opt.optim.param_groups for q in group["params"]]
    buckets = model.buckets
    grads = _storage_bytes([b.buffer for b in buckets] + [b.shard for b in buckets] + [q.grad for q in stepped]
                           + [p.grad for p in model.parameters()])
    out = {"dp_rank": plugin.dp_rank, "params": _bytes(model.parameters()),
           "optimizer": _bytes(t for st in opt.optim.state.values() for t in st.values() if isinstance(t, torch.Tensor)),
           "master_weights": _bytes(stepped), "gradients": grads}
    opt.zero_grad()
    del model, opt, booster, plugin
    return out


def measure_checkpointing(on, reference, batch):
    from booster_plugin import Booster, GradientCheckpointConfig, HybridParallelPlugin
    plugin = HybridParallelPlugin(gradient_checkpoint_config=GradientCheckpointConfig() if on else None)
    booster = Booster(plugin=plugin)
    model, opt = C.boost_copy(booster, reference)
    model.train()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        booster.backward(model(**batch).loss, opt)
        seconds = time.perf_counter() - t0
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    opt.zero_grad()
    del model, opt, booster, plugin
    return {"peak_bytes": peak, "held_after_backward": live, "forward_backward_s_profiled": seconds}


def worker(out_path: str) -> None:
    rank = C.init_dist(world_size=None)
    world = dist.get_world_size()
    reference = C.build_llama(seed=0, max_position_embeddings=SEQ, **MODEL)
    batch = C.make_batches(1, batch=BATCH, seq=SEQ, vocab=MODEL["vocab_size"])[0]
    results = {}
    for label, tp, pp, dp, m, sp in LAYOUTS[world]:
        t0 = time.perf_counter()
        local = measure(label, tp, pp, dp, m, sp, reference, batch)
        results[label] = {"tp": tp, "pp": pp, "dp": dp, "microbatches": m or 1, "world": world, "sp": sp,
                          "per_rank": C.gather_per_rank(local), "seconds": time.perf_counter() - t0}
        if rank == 0:
            print(f"[world {world}] {label}: {results[label]['seconds']:.0f} s", flush=True)
    for label in EXTRA_ROWS.get(world, []):
        if label in ZERO_ROWS:
            results[label] = {"per_rank": C.gather_per_rank(measure_zero(ZERO_ROWS.index(label), reference, batch))}
        else:
            results[label] = measure_checkpointing(label == CKPT_ROWS[1], reference, batch)
    C.worker_done(rank, out_path, results)


def report_extras(res) -> list:
    """Print the ZeRO and activation checkpointing rows; returns the ZeRO ratios off target (÷dp)."""
    base = res[ZERO_ROWS[0]]["per_rank"]
    rows, off = [], []
    for stage, label in enumerate(ZERO_ROWS):
        for pr, b in zip(res[label]["per_rank"], base):
            ratios = {k: pr[k] / b[k] for k in ("optimizer", "master_weights", "gradients")}
            rows.append([label, f"d{pr['dp_rank']}", *[f"{pr[k] / MiB:.2f} ({ratios[k]:.4f})"
                                                          for k in ("optimizer", "master_weights", "gradients")]])
            targets = {"optimizer": 0.5, "master_weights": 0.5, "gradients": 0.5 if stage == 2 else None}
            for k, target in targets.items():
                if stage and target is not None and abs(ratios[k] - target) > 0.01:
                    off.append(f"{label} d{pr['dp_rank']}: {k} {ratios[k]:.4f} x zero_stage=0, target {target}")
    print("\nZeRO at dp=2 (bf16, AdamW): MiB per rank (ratio to zero_stage=0; target 1/dp = 0.5)")
    print(C.table(["layout", "rank", "optimizer state", "fp32 master weights", "gradients held at step"], rows))
    off_, on_ = res[CKPT_ROWS[0]], res[CKPT_ROWS[1]]
    print("\nActivation checkpointing, (1,1,1) fp32: peak MiB of one forward+backward (profiler, above the start)")
    print(C.table(["checkpointing", "peak MiB", "held after backward MiB", "profiled fwd+bwd s"],
                  [[lab.rsplit(" ", 1)[1], f"{r['peak_bytes'] / MiB:.1f}", f"{r['held_after_backward'] / MiB:.1f}",
                    f"{r['forward_backward_s_profiled']:.2f}"] for lab, r in ((CKPT_ROWS[0], off_), (CKPT_ROWS[1], on_))]))
    print(f"peak with / without: {on_['peak_bytes'] / off_['peak_bytes']:.3f}")
    return off


def report_sequence_parallelism(res) -> None:
    """Activation bytes per rank with sequence parallelism against tp alone and the ideal 1/(tp*pp) (target <= 1.05x
    ideal); call after report() has put the ideals in."""
    rows = []
    for base in ("(2,1,1)", "(2,2,1) m=4"):
        for i, pr in enumerate(res[base]["per_rank"]):
            ideal = pr["ideal"]["activations_peak"]
            cells = [f"{res[label]['per_rank'][i]['activations_peak'] / MiB:.1f} "
                     f"({res[label]['per_rank'][i]['activations_peak'] / ideal:.3f})"
                     for label in (base, f"{base} sp split_gather", f"{base} sp all_to_all")]
            rows.append([base, f"r{i} s{pr['stage']} t{pr['tp_rank']}", f"{ideal / MiB:.1f}", *cells])
    print("\nSequence parallelism: activation MiB per rank (x ideal 1/(tp*pp) of the unsharded; target <= 1.05)")
    print(C.table(["layout", "rank", "ideal", "tp only", "sp split_gather", "sp all_to_all"], rows))


def report(res, t_start: float) -> None:
    extras = {k: res.pop(k) for k in ZERO_ROWS + CKPT_ROWS}
    ref = res["(1,1,1)"]["per_rank"][0]
    ref_mb = res["(1,1,1) m=4 accumulation"]["per_rank"][0]["activations_peak"]
    fmt = lambda b, ideal: f"{b / MiB:.1f} ({b / ideal:.2f})" if ideal else f"{b / MiB:.1f}"
    rows, excess = [], []
    for label, r in res.items():
        tp, pp, dp, m = r["tp"], r["pp"], r["dp"], r["microbatches"]
        for i, pr in enumerate(r["per_rank"]):
            ideal = {k: ref[k] / (tp * pp) for k in ("params", "grads", "optimizer")}
            if label.startswith("(1,1,1)"):
                ideal_act = ref["activations_peak"] if m == 1 else ref_mb
            elif pp > 1 or m > 1:
                ideal_act = ref_mb * pr["inflight_microbatches"] / (tp * pp)
            else:
                ideal_act = ref["activations_peak"] / (tp * pp * dp)
            pr["ideal"] = {**ideal, "activations_peak": ideal_act}
            total = sum(pr[k] for k in ("params", "grads", "optimizer", "activations_peak"))
            ideal_total = sum(pr["ideal"].values())
            pr["total"], pr["ideal_total"] = total, ideal_total
            rows.append([label, f"r{i} s{pr['stage']} t{pr['tp_rank']} d{pr['dp_rank']}",
                         fmt(pr["params"], ideal["params"]), fmt(pr["grads"], ideal["grads"]),
                         fmt(pr["optimizer"], ideal["optimizer"]),
                         f"{pr['activations_peak'] / MiB:.1f} / {ideal_act / MiB:.1f} ({pr['activations_peak'] / ideal_act:.2f})",
                         f"{pr['activations_peak'] / ref['activations_peak']:.3f}",
                         f"{total / MiB:.1f} ({total / ideal_total:.2f})",
                         f"{total / (ref['params'] + ref['grads'] + ref['optimizer'] + ref['activations_peak']):.3f}"])
            held_to_ideal = ("activations_peak",) if r.get("sp") == "all_to_all" else (  # replicated layer weights
                "params", "grads", "optimizer", "activations_peak")
            for k in held_to_ideal:
                if pr[k] > 1.05 * pr["ideal"][k] and not label.startswith("(1,1,1)"):
                    excess.append(f"{label} rank {i} (stage {pr['stage']}): {k} {pr[k] / MiB:.1f} MiB = "
                                  f"{pr[k] / pr['ideal'][k]:.2f} x ideal {pr['ideal'][k] / MiB:.1f} MiB")
            if pr["saved_left_after_backward"]:
                excess.append(f"{label} rank {i}: {pr['saved_left_after_backward'] / MiB:.1f} MiB of saved tensors "
                              f"still alive after the step")
    cfg = MODEL
    print(f"\nPer-rank memory, one training step; Llama h{cfg['hidden_size']} L{cfg['num_hidden_layers']} "
          f"ffn {cfg['intermediate_size']} vocab {cfg['vocab_size']} (untied), seq {SEQ}, global batch {BATCH}, "
          f"fp32, AdamW")
    print("MiB (measured / ideal); activations = peak of saved-for-backward tensors; ideal as in the file header")
    print(C.table(["layout (tp,pp,dp)", "rank", "params", "grads", "optimizer", "activations / ideal",
                   "act / unsharded", "total (x ideal)", "total / unsharded"], rows))
    report_sequence_parallelism(res)
    excess += report_extras(extras)
    print("\nAbove ideal by more than 5% (ZeRO: off 1/dp by more than 0.01): " + ("none" if not excess else ""))
    for e in excess:
        print("  - " + e)
    # which activations tensor parallelism does not split: saved bytes by module, unsharded vs tp=2 (per rank)
    labels = ["(1,1,1)", "(2,1,1)", "(2,1,1) sp split_gather", "(2,1,1) sp all_to_all"]
    by = [res[label]["per_rank"][0]["saved_bytes_by_module"] for label in labels]
    a = by[0]
    kinds = sorted(set().union(*by), key=lambda k: -a.get(k, 0))
    ratio = lambda b, k: f"{b.get(k, 0) / a[k]:.2f}" if a.get(k) else "-"  # noqa: E731
    rows = [[k, f"{a.get(k, 0) / MiB:.1f}", *[f"{b.get(k, 0) / MiB:.1f} ({ratio(b, k)})" for b in by[1:]]]
            for k in kinds if sum(b.get(k, 0) for b in by) >= MiB / 2]
    rows.append(["total", f"{sum(a.values()) / MiB:.1f}",
                 *[f"{sum(b.values()) / MiB:.1f} ({sum(b.values()) / sum(a.values()):.2f})" for b in by[1:]]])
    print("\nSaved-for-backward bytes by the module that saved them (first save of a storage; all layers summed; "
          "'*' = any layer): unsharded vs tp=2 rank 0 (ratio 0.50 = split, 1.00 = replicated)")
    print(C.table(["module", *[f"{label} MiB" for label in labels]], rows))
    out = {"benchmark": NAME, "model": {**MODEL, "seq": SEQ, "global_batch": BATCH, "dtype": "fp32",
                                        "optimizer": "AdamW", "tie_word_embeddings": False, "microbatches_with_pp": M},
           "method": "saved_tensors_hooks: peak live bytes of saved-for-backward storages (params excluded)",
           "env": {"torch": torch.__version__, "backend": "gloo", "cpu_count": os.cpu_count(),
                   "loadavg_at_end": C.loadavg()},
           "layouts": res, "zero": {k: extras[k] for k in ZERO_ROWS},
           "activation_checkpointing": {k: extras[k] for k in CKPT_ROWS}, "excess": excess, "total_s": time.perf_counter() - t_start}
    print("wrote " + C.write_results(NAME, out))


def main() -> None:
    C.worker_main(HERE, LAYOUTS, worker, report, order=[label for w in sorted(LAYOUTS) for label, *_ in LAYOUTS[w]]
                  + ZERO_ROWS + CKPT_ROWS)


if __name__ == "__main__":
    main()

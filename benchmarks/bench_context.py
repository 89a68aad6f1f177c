"""Long context on CPU: sequence parallelism over its own group (sp=2: ring_attn, all_to_all) against one process,
for activation memory per rank and for training speed, plus torch's own context parallel. Outside CI.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/bench_context.py
        [--lengths 1024 2048 4096 8192 16384] [--speed-length 8192] [--rounds 5] [--budgets-mib 64 96 ... 1024]
        [--vocab 1024] [--name context] [--skip-speed] [--skip-cp] [--ring-fallback]

Model: Llama hidden 256, 2 layers, 4 heads (4 kv heads), ffn 1024, vocabulary 1024 (--vocab; untied), fp32, sdpa, AdamW
(lr 1e-3); one row of L random tokens (labels = input ids: HF's shifted causal loss), no padding.

Variants, each rank one thread (gloo, 2 ranks):
  sp=1          the unsharded transformers model and torch AdamW on rank 0 alone: one process on one core doing the
                whole sequence (rank 1 waits in a barrier meanwhile; its CPU time is recorded to show it idles);
  sp=1 2 thr    the same with torch.set_num_threads(2) on rank 0 (both cores, one process), speed only;
  ring_attn     HybridParallelPlugin(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode=
                "ring_attn") over both ranks (each rank one core): dp 1, the row split over the two ranks;
  all_to_all    the same with sequence_parallelism_mode="all_to_all" (Ulysses);
  ring_attn hand-written blocks  (--ring-fallback, speed only) ring_attn with its hand-written fallback blocks instead
                of torch's fused CPU attention kernel (`ring_blocks.FUSED` emptied during its steps);
  torch CP      torch.distributed.tensor.experimental.context_parallel over a 2-rank CPU DeviceMesh (tried; when it
                fails the exact error is recorded; when it runs and matches the sp=1 loss it is timed too).

(1) Activations: the peak of the bytes autograd keeps saved for backward during one forward+backward, per rank
    (bench_memory.SavedTensorMeter: saved_tensors_hooks, each storage counted once, parameters excluded), at every
    length, sp=1 vs sp=2 (the larger of the two ranks). Target: sp=2 <= 0.55x sp=1. The longest power-of-two length
    whose activations fit a budget (several budgets; only measured lengths are reported). The same step checks that
    all variants give the same loss and logits (same weights: no optimizer step in this phase; rank 0's logits, which
    with sp=2 are those of rank 0's tokens: the LM head and loss run on each rank's tokens).
(2) Speed at --speed-length: forward + backward + AdamW step, all variants built side by side in this one run,
    interleaved rounds in rotated order (benchmarks/_common.interleaved_steps: one warm-up step each, then --rounds
    timed rounds, barrier-to-barrier wall time), medians; tokens/s = L / median step time (one row per step for every
    variant). Target: ring_attn >= 1.3x sp=1 (1 thread). Each rank's CPU seconds per step are recorded too: on a
    shared, busy machine wall time mostly measures the other work; sp=1's CPU seconds over the busier sp rank's is
    the speed-up the wall-time ratio approaches on idle cores (communication waits excluded).
(3) torch context parallel: see above.

Writes benchmarks/results/context.json (--name: another context*.json, e.g. for --vocab 32000 --skip-speed) and
prints the tables.
"""
from __future__ import annotations

import argparse
import copy
import re
import time
import traceback

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.distributed as dist

from bench_memory import SavedTensorMeter
from shardformer.sequence import ring_blocks

NAME = "context"
MODEL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=1024, vocab_size=1024)
MiB = 2 ** 20
SP_VARIANTS = ("ring_attn", "all_to_all")


def build_reference(max_length: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, max_position_embeddings=max_length, tie_word_embeddings=False, pad_token_id=0,
                         attention_dropout=0.0, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    model.train()
    return model


def row(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, MODEL["vocab_size"], (1, length), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def state_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


class Variants:
    """The models of every variant, built once from the same weights."""

    def __init__(self, reference, rank: int, ring_fallback: bool = False) -> None:
        from booster_plugin import Booster, HybridParallelPlugin
        self.rank = rank
        self.sp1 = copy.deepcopy(reference)
        self.sp1_opt = torch.optim.AdamW(self.sp1.parameters(), lr=1e-3)
        self.sp1_threads2 = copy.deepcopy(reference)
        self.sp1_threads2_opt = torch.optim.AdamW(self.sp1_threads2.parameters(), lr=1e-3)
        self.sp = {}
        for mode in SP_VARIANTS + (("ring_attn",) if ring_fallback else ()):
            plugin = HybridParallelPlugin(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode=mode)
            assert plugin.dp_size == 1 and plugin.ctx.sp.size == 2
            booster = Booster(plugin=plugin)
            model, opt = C.boost_copy(booster, reference)
            model.train()
            self.sp[mode if mode not in self.sp else f"{mode} hand-written blocks"] = (plugin, booster, model, opt)

    # one forward + backward (no optimizer step) under the saved-tensor meter: (peak bytes, loss, seconds)
    def measure(self, name: str, batch):
        if name == "sp=1":
            if self.rank != 0:
                return None
            params = list(self.sp1.parameters())
            meter = SavedTensorMeter(p.untyped_storage().data_ptr() for p in params)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                out = self.sp1(**batch)
                out.loss.backward()
            seconds = time.perf_counter() - t0
            self.sp1.zero_grad(set_to_none=True)
            return {"peak": meter.peak, "left": meter.current, "loss": out.loss.item(), "seconds": seconds,
                    "by_module": dict(meter.by_module), "state": 4 * state_bytes(params),
                    "logits": out.logits.detach()}
        plugin, booster, model, opt = self.sp[name]
        params = list(model.unwrap().parameters())
        meter = SavedTensorMeter(p.untyped_storage().data_ptr() for p in params)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            out = model(**batch)
            booster.backward(out.loss, opt)
        seconds = time.perf_counter() - t0
        opt.zero_grad()
        head = model.info.sequence_head  # in training with labels the head runs on this rank's tokens only
        return {"peak": meter.peak, "left": meter.current, "loss": out.loss.item(), "seconds": seconds,
                "by_module": dict(meter.by_module), "state": 4 * state_bytes(params),
                "logits": out.logits.detach(), "tokens": head.tokens if head is not None and head.active else None}

    # a whole training step (forward, backward, AdamW): the loss on rank 0 (None where a rank did nothing)
    def step_fn(self, name: str):
        if name.startswith("sp=1"):
            threads = 2 if "2 threads" in name else 1
            model, opt = (self.sp1_threads2, self.sp1_threads2_opt) if threads == 2 else (self.sp1, self.sp1_opt)

            def step(batch):
                if self.rank != 0:
                    return None
                torch.set_num_threads(threads)
                try:
                    loss = model(**batch).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                finally:
                    torch.set_num_threads(1)
                return loss.item()
            return step
        plugin, booster, model, opt = self.sp[name]
        kernels = {} if name.endswith("hand-written blocks") else ring_blocks.FUSED

        def step(batch):
            fused, ring_blocks.FUSED = ring_blocks.FUSED, kernels
            try:
                loss = model(**batch).loss
                booster.backward(loss, opt)
                opt.step()
                opt.zero_grad()
            finally:
                ring_blocks.FUSED = fused
            return loss.item()
        return step


def attribute_modules(model_roots):
    """Attribute saved bytes to the innermost module running (names with layer indices as '*'): returns
    (install(meter), remove)."""
    from torch.nn.modules import module as nn_module
    names = {}
    for root in model_roots:
        for name, mod in root.named_modules():
            names[id(mod)] = re.sub(r"\.\d+\.", ".*.", name) or "(model: head input / loss)"
    stack = []
    handles = [nn_module.register_module_forward_pre_hook(lambda mod, a: stack.append(names.get(id(mod)))),
               nn_module.register_module_forward_hook(lambda mod, a, o: stack.pop() and None)]
    where = lambda: next((n for n in reversed(stack) if n is not None), "(outside modules: loss)")  # noqa: E731
    return where, handles


# -- torch's context parallel ----------------------------------------------------------------------------------------
class TorchCP:
    """The reference model under torch.distributed.tensor.experimental.context_parallel on a CPU DeviceMesh of the 2
    ranks: input ids, pre-shifted labels and position ids sharded (torch's load-balanced layout), summed
    cross-entropy over the global label count, gradients all-reduced, AdamW."""

    def __init__(self, reference) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
        self.model = copy.deepcopy(reference)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def forward_backward(self, batch, backend=None):
        from torch.distributed.tensor.experimental import context_parallel
        ids = batch["input_ids"].clone()
        length = ids.shape[1]
        shifted = torch.cat([batch["labels"][:, 1:], torch.full((1, 1), -100)], dim=1)
        count = (shifted != -100).sum()
        positions = torch.arange(length)[None]
        buffers = [ids, shifted, positions]
        ctx = [context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers))]
        if backend is not None:
            from torch.nn.attention import sdpa_kernel
            ctx.insert(0, sdpa_kernel([backend]))
        from contextlib import ExitStack
        with ExitStack() as stack:
            for c in ctx:
                stack.enter_context(c)
            logits = self.model(input_ids=ids, position_ids=positions).logits
            total = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(),
                                                      ignore_index=-100, reduction="sum")
            (total / count).backward()
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        loss = total.detach().clone()
        dist.all_reduce(loss)
        return (loss / count).item()

    def step(self, batch):
        loss = self.forward_backward(batch)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def try_torch_cp(reference, batch, expected_loss, say):
    """Run torch CP once (default sdpa backend, then the math backend); the outcome with the exact error."""
    from torch.nn.attention import SDPBackend
    attempts = {}
    for label, backend in (("default sdpa (CPU flash)", None), ("sdpa_kernel(MATH)", SDPBackend.MATH)):
        try:
            cp = TorchCP(reference)
            loss = cp.forward_backward(batch, backend)
            ok = expected_loss is None or abs(loss - expected_loss) <= 1e-4 * max(1.0, abs(expected_loss))
            attempts[label] = {"result": "ran", "loss": loss, "sp1_loss": expected_loss, "loss_matches": ok}
            say(f"torch CP, {label}: ran, loss {loss:.6f} (sp=1 {expected_loss})")
            if ok and backend is None:
                cp.model.zero_grad(set_to_none=True)
                return attempts, cp
        except Exception as error:  # noqa: BLE001 (record whatever torch raises)
            tb = traceback.format_exc().strip().splitlines()
            where = [line.strip() for line in tb if line.strip().startswith("File")][-1:]
            attempts[label] = {"result": "error", "error": f"{type(error).__name__}: {error}",
                               "raised_at": where[0] if where else ""}
            say(f"torch CP, {label}: {type(error).__name__}: {error}")
        dist.barrier()
    return attempts, None


# -- main ------------------------------------------------------------------------------------------------------------
def longest_under(lengths, peaks, budget):
    fitting = [L for L in lengths if peaks.get(L) is not None and peaks[L] <= budget]
    if not fitting:
        return f"< {min(lengths)}"
    best = max(fitting)
    return f">= {best}" if best == max(lengths) else str(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--speed-length", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budgets-mib", type=int, nargs="+", default=[64, 96, 128, 192, 256, 384, 512, 768, 1024])
    parser.add_argument("--vocab", type=int, default=MODEL["vocab_size"], help="vocabulary size (head and loss)")
    parser.add_argument("--name", default=NAME, help="results file benchmarks/results/NAME.json (context*)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-cp", action="store_true", help="do not try torch's context_parallel")
    parser.add_argument("--ring-fallback", action="store_true",
                        help="also time ring_attn with its hand-written blocks (the fused kernel's baseline)")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/context.json")
    args = parser.parse_args()
    if not args.name.startswith("context"):
        raise SystemExit("--name must start with 'context'")
    MODEL["vocab_size"] = args.vocab
    rank = C.init_dist(timeout_s=600.0, world_size=2)
    say = C.rank0_printer(rank)
    t_start = time.perf_counter()
    results = {"env": C.environment(), "model": MODEL, "hung": [], "args": vars(args)}
    dog = C.Watchdog(args.name, results)
    import transformers
    transformers.logging.set_verbosity_error()

    max_length = max(args.lengths + [args.speed_length])
    reference = build_reference(max_length)
    variants = Variants(reference, rank, args.ring_fallback)
    say(f"Llama {MODEL}, {sum(p.numel() for p in reference.parameters()) / 1e6:.2f} M parameters; gloo, 2 ranks, "
        f"1 thread each; load average {C.loadavg()}")

    # (1) activations per rank
    names = ["sp=1"] + list(SP_VARIANTS)
    memory = {n: {} for n in names}
    for length in args.lengths:
        batch = row(length, seed=length)
        logits = {}
        for name in names:
            dog.arm(f"activations {name} L={length}", 900)
            local = variants.measure(name, batch)
            if local is not None:
                logits[name] = (local.pop("logits"), local.pop("tokens", None))
            dist.barrier()
            dog.disarm()
            per_rank = C.gather_per_rank(local)
            got = [r for r in per_rank if r is not None]
            memory[name][length] = {
                "activations_peak_per_rank": [r["peak"] for r in per_rank if r is not None],
                "activations_peak_max": max(r["peak"] for r in got),
                "saved_left_after_backward": max(r["left"] for r in got),
                "loss": got[0]["loss"], "seconds_one_fwd_bwd": max(r["seconds"] for r in got),
                "model_state_bytes_per_rank": got[0]["state"]}
            if name != "sp=1" and rank == 0:  # rank 0's logits against one process's (same weights, no step yet)
                mine, tokens = logits[name]
                expected = logits["sp=1"][0] if tokens is None else tokens.of(logits["sp=1"][0])  # rank 0's tokens
                memory[name][length]["logits_max_abs_diff_to_sp1_rank0"] = (mine - expected).abs().max().item()
        del logits
        base = memory["sp=1"][length]
        line = [f"L={length:6d}: sp=1 {base['activations_peak_max'] / MiB:8.1f} MiB ({base['seconds_one_fwd_bwd']:.1f} s)"]
        for name in SP_VARIANTS:
            m = memory[name][length]
            m["ratio_to_sp1"] = m["activations_peak_max"] / base["activations_peak_max"]
            m["loss_diff_to_sp1"] = abs(m["loss"] - base["loss"])
            diff = m.get("logits_max_abs_diff_to_sp1_rank0", float("nan"))
            line.append(f"{name} {m['activations_peak_max'] / MiB:8.1f} MiB = {m['ratio_to_sp1']:.3f}x "
                        f"(loss diff {m['loss_diff_to_sp1']:.1e}, logits {diff:.1e}, {m['seconds_one_fwd_bwd']:.1f} s)")
        say("; ".join(line))
    results["activations"] = {n: {str(k): v for k, v in memory[n].items()} for n in names}

    # attribution of the saved bytes at the longest length (second pass, same numbers, by module)
    longest = max(args.lengths)
    by_module = {}
    for name in names:
        roots = [variants.sp1] if name == "sp=1" else [variants.sp[name][2].unwrap()]
        where, handles = attribute_modules(roots)
        orig = SavedTensorMeter.__init__

        def init(self, exclude, _orig=orig, _where=where):
            _orig(self, exclude)
            self.where = _where
        SavedTensorMeter.__init__ = init
        try:
            dog.arm(f"attribution {name}", 900)
            local = variants.measure(name, row(longest, seed=longest))
            dog.disarm()
        finally:
            SavedTensorMeter.__init__ = orig
            for h in handles:
                h.remove()
        dist.barrier()
        if rank == 0 and local is not None:
            by_module[name] = {k: v for k, v in sorted(local["by_module"].items(), key=lambda kv: -kv[1])}
    results["saved_bytes_by_module_at_longest_rank0"] = {"length": longest, **by_module}

    budgets = {}
    for budget in args.budgets_mib:
        budgets[f"{budget} MiB"] = {n: longest_under(args.lengths, {L: memory[n][L]["activations_peak_max"]
                                                                     for L in args.lengths}, budget * MiB)
                                    for n in names}
    results["longest_length_under_activation_budget"] = budgets

    # (3) torch context parallel (tried before the speed phase: if it runs, it is timed too)
    attempts, cp = {}, None
    if not args.skip_cp:
        probe_length = min(args.lengths)
        expected = memory["sp=1"][probe_length]["loss"]
        dog.arm("torch context_parallel probe", 900)
        attempts, cp = try_torch_cp(reference, row(probe_length, seed=probe_length), expected, say)
        dog.disarm()
        results["torch_context_parallel"] = {"length": probe_length, "attempts": attempts,
                                             "torch": torch.__version__, "device_mesh": "cpu, gloo, 2 ranks"}

    # (2) speed
    if not args.skip_speed:
        length = args.speed_length
        steps = {"sp=1 (1 process, 1 thread)": variants.step_fn("sp=1"),
                 "sp=1 (1 process, 2 threads)": variants.step_fn("sp=1 2 threads"),
                 "ring_attn sp=2": variants.step_fn("ring_attn"),
                 "all_to_all sp=2": variants.step_fn("all_to_all")}
        if args.ring_fallback:
            steps["ring_attn sp=2 hand-written blocks"] = variants.step_fn("ring_attn hand-written blocks")
        if cp is not None:
            steps["torch CP sp=2"] = cp.step
        batches = [row(length, seed=1000 + i) for i in range(args.rounds + 1)]
        say(f"speed at L={length}: {len(steps)} variants, 1 warm-up + {args.rounds} interleaved rounds")
        times, cpu, losses = C.interleaved_steps(steps, batches, args.rounds, dog)
        cpu_all = C.gather_per_rank(cpu)
        speed = {}
        base = C.median(times["sp=1 (1 process, 1 thread)"])
        base_cpu = C.median(cpu_all[0]["sp=1 (1 process, 1 thread)"])
        for n in steps:
            med = C.median(times[n])
            busiest = max(C.median(cpu_all[0][n]), C.median(cpu_all[1][n]))  # the rank that computes longer
            speed[n] = {"median_s": med, "min_s": min(times[n]), "times_s": times[n], "tokens_per_s": length / med,
                        "speedup_vs_sp1_1thread": base / med,
                        "paired_speedup_vs_sp1_1thread": 1 / C.paired_ratio(times[n], times["sp=1 (1 process, 1 thread)"]),
                        "cpu_speedup_vs_sp1_1thread": base_cpu / busiest,
                        "cpu_s_per_step_rank0": C.median(cpu_all[0][n]), "cpu_s_per_step_rank1": C.median(cpu_all[1][n]),
                        "warmup_loss": losses[n][0]}
        speed["comparisons"] = {
            "ring_attn vs sp=1": C.compare(times["ring_attn sp=2"], times["sp=1 (1 process, 1 thread)"],
                                           "ring_attn", "sp=1"),
            "all_to_all vs sp=1": C.compare(times["all_to_all sp=2"], times["sp=1 (1 process, 1 thread)"],
                                            "all_to_all", "sp=1"),
            "ring_attn vs all_to_all": C.compare(times["ring_attn sp=2"], times["all_to_all sp=2"],
                                                 "ring_attn", "all_to_all"),
            "ring_attn vs sp=1 2 threads": C.compare(times["ring_attn sp=2"], times["sp=1 (1 process, 2 threads)"],
                                                     "ring_attn", "sp=1 2 threads")}
        if args.ring_fallback:
            speed["comparisons"]["ring_attn vs hand-written blocks"] = C.compare(
                times["ring_attn sp=2"], times["ring_attn sp=2 hand-written blocks"], "fused blocks", "hand-written")
        results["speed"] = {"length": length, "rounds": args.rounds, "variants": speed}

    # tables
    say("\nActivations per rank (saved-for-backward peak, MiB; sp=2: the larger rank), one row of L tokens")
    rows = []
    for L in args.lengths:
        r = [L, f"{memory['sp=1'][L]['activations_peak_max'] / MiB:.1f}"]
        for n in SP_VARIANTS:
            m = memory[n][L]
            r += [f"{m['activations_peak_max'] / MiB:.1f}", f"{m['ratio_to_sp1']:.3f}"]
        rows.append(r)
    say(C.table(["L", "sp=1", "ring_attn", "ring/sp1", "all_to_all", "a2a/sp1"], rows))
    say(f"model state per rank (params+grads+AdamW m,v): {memory['sp=1'][longest]['model_state_bytes_per_rank'] / MiB:.1f} MiB "
        "in every variant (sp replicates the weights)")
    say("\nLongest measured power-of-two length whose activations fit the budget (per rank)")
    say(C.table(["budget"] + names, [[b] + [v[n] for n in names] for b, v in budgets.items()]))
    if by_module:
        say(f"\nSaved bytes by module at L={longest} (rank 0, MiB; top entries)")
        for n, mods in by_module.items():
            top = ", ".join(f"{k} {v / MiB:.0f}" for k, v in list(mods.items())[:6])
            say(f"  {n}: {top}")
    if "speed" in results:
        sp = results["speed"]["variants"]
        say(f"\nTraining step (forward+backward+AdamW) at L={args.speed_length}, median of {args.rounds} interleaved rounds")
        say(C.table(["variant", "median s", "min s", "tokens/s", "x sp=1 (medians)", "x sp=1 (paired)",
                     "rank0 cpu s", "rank1 cpu s", "x sp=1 (cpu s)"],
                    [[n, f"{v['median_s']:.2f}", f"{v['min_s']:.2f}", f"{v['tokens_per_s']:.0f}",
                      f"{v['speedup_vs_sp1_1thread']:.2f}", f"{v['paired_speedup_vs_sp1_1thread']:.2f}",
                      f"{v['cpu_s_per_step_rank0']:.2f}", f"{v['cpu_s_per_step_rank1']:.2f}",
                      f"{v['cpu_speedup_vs_sp1_1thread']:.2f}"] for n, v in sp.items() if n != "comparisons"]))
        say("  x sp=1 (cpu s): sp=1's CPU seconds per step / the busier rank's (what the wall-time ratio approaches on "
            "idle cores; the 2-thread row's CPU counts both threads)")
        for c in sp["comparisons"].values():
            say("  " + c["text"])
    say("\ntorch context_parallel: " + ("not tried (--skip-cp)" if not attempts else "") + "; ".join(
        f"{k}: {v['result']}" + (f" ({v['error']})" if v["result"] == "error" else f" (loss {v['loss']:.6f}, "
                                                                                     f"matches sp=1: {v['loss_matches']})")
        for k, v in attempts.items()))
    if args.no_write:
        results["env"]["note"] = "not written (--no-write)"
        dist.barrier()
        dist.destroy_process_group()
        return
    C.finish(args.name, results, rank, t_start, say, "900 s per measurement, 180 s per timed step")


if __name__ == "__main__":
    main()

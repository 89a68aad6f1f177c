"""Regional compilation (`compile_layers=True`) against eager, side by side in one run: tokens/s of training steps
(forward, backward, AdamW) of the benchmark Llama (hidden 256, 8 layers, 8 heads / 4 kv heads, intermediate 1024,
vocab 1024, seq 128, batch 8, fp32) on this world's ranks as tensor parallel (tp = world size: 1 or 2), and the
compile time of its one decoder layer class (the first compiled step less a compiled step). At a world of one, also
plain torch (the model unwrapped, torch's AdamW; eager and with each decoder layer `.compile()`d), the calibration of
what regional compilation can give on this machine. The variants run interleaved in rounds on the same batches;
ours' losses agree at every step within 1e-5 (checked). `--checkpoint`: both of ours checkpoint every decoder layer
(GradientCheckpointConfig(gradient_checkpointing_ratio=1.0)), compiled+checkpointed against eager+checkpointed.

Run:  torchrun --nproc_per_node=1 benchmarks/bench_compile.py   (world of one)
      torchrun --nproc_per_node=2 benchmarks/bench_compile.py   (tp=2)
      torchrun --nproc_per_node=2 benchmarks/bench_compile.py --checkpoint   (tp=2, every layer checkpointed)
Writes benchmarks/results/bench_compile_tp{N}.json (`--checkpoint`: bench_compile_tp{N}_ckpt.json).
"""
from __future__ import annotations

import argparse
import copy
import time

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.core.activation_checkpoint import GradientCheckpointConfig

BATCH, SEQ, VOCAB = 8, 128, 1024


def _boosted(reference: LlamaForCausalLM, tp: int, compiled: bool, checkpoint: bool):
    model = copy.deepcopy(reference)
    config = GradientCheckpointConfig(gradient_checkpointing_ratio=1.0) if checkpoint else None
    plugin = HybridParallelPlugin(tp_size=tp, compile_layers=compiled, gradient_checkpoint_config=config)
    model, opt, *_ = Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, opt


def _plain(reference: LlamaForCausalLM, compiled: bool):
    model = copy.deepcopy(reference)
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, batch) -> float:
    loss = model(**batch).loss
    if hasattr(opt, "backward"):  # ours
        opt.backward(loss)
    else:
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--checkpoint", action="store_true", help="both variants checkpoint every decoder layer")
    args = parser.parse_args()
    load_start = C.loadavg()
    rank = C.init_dist(timeout_s=900.0, world_size=None)
    tp = dist.get_world_size()
    say = C.rank0_printer(rank)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024,
                                             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                             max_position_embeddings=SEQ, use_cache=False))
    g = torch.Generator().manual_seed(1)
    batches = [dict(input_ids=ids, labels=ids) for ids in
               (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(args.rounds * args.steps + 1))]
    variants = {"eager": _boosted(reference, tp, False, args.checkpoint),
                "compiled": _boosted(reference, tp, True, args.checkpoint)}
    if tp == 1 and not args.checkpoint:
        variants.update({"plain eager": _plain(reference, False), "plain compiled": _plain(reference, True)})
    first, first_s = {}, {}
    for name in ("compiled", *(n for n in variants if n != "compiled")):
        start = time.perf_counter()
        first[name] = _step(*variants[name], batches[0])
        first_s[name] = time.perf_counter() - start
    assert abs(first["compiled"] - first["eager"]) < 1e-5, first
    times = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in C.rotated(list(variants), r):
            chunk = batches[1 + r * args.steps: 1 + (r + 1) * args.steps]
            dist.barrier()
            t = time.perf_counter()
            losses = [_step(*variants[name], b) for b in chunk]
            times[name].append((time.perf_counter() - t) / args.steps)
            times.setdefault(f"losses {name}", []).append(losses)
    for a, b in zip(times["losses eager"], times["losses compiled"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    tokens = BATCH * SEQ
    rows = {name: dict(step_s=C.median(times[name]), tokens_per_s=tokens / C.median(times[name])) for name in variants}
    ratio = C.paired_ratio(times["eager"], times["compiled"])
    plain_ratio = C.paired_ratio(times["plain eager"], times["plain compiled"]) if "plain eager" in times else None
    # the first compiled step, less a compiled step: compiling the one layer class (LlamaDecoderLayer), forward and
    # backward graphs
    compile_s = first_s["compiled"] - rows["compiled"]["step_s"]
    results = dict(environment=C.environment(), loadavg_start=load_start, loadavg=C.loadavg(), tp=tp,
                   checkpointed=args.checkpoint, rounds=args.rounds, steps=args.steps,
                   first_step_s=first_s, compile_s_per_layer_class=compile_s, variants=rows, compiled_speedup=ratio,
                   plain_compiled_speedup=plain_ratio)
    say(C.table(["variant", "step s", "tokens/s"], [[n, f"{v['step_s']:.3f}", f"{v['tokens_per_s']:.0f}"]
                                                    for n, v in rows.items()]))
    layout = f"tp={tp}" + (" (every layer checkpointed)" if args.checkpoint else "")
    say(f"{layout}: compiled / eager tokens/s = {ratio:.2f}x (paired median); compile time (one layer class) "
        f"{compile_s:.1f} s; load {load_start} at start, {results['loadavg']} at end")
    if plain_ratio is not None:
        say(f"plain torch: compiled layers / eager tokens/s = {plain_ratio:.2f}x (paired median)")
    if rank == 0:
        C.write_results(f"bench_compile_tp{tp}{'_ckpt' if args.checkpoint else ''}", results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Data parallel: gradient all-reduce overlapped with the backward pass vs reduced at optimizer.step().

    torchrun --nproc_per_node=2 benchmarks/bench_dp.py [--quick]

Same Llama as the other benchmarks, dp=2, AdamW, one thread per rank, interleaved rounds. "at step" sets
`model.require_grad_sync = False` during backward, so every bucket is reduced by optimizer.step() (the library's
behaviour before the overlap). Prints a table and writes benchmarks/results/bench_dp.json.
"""
import argparse
import copy
import time

import torch
import torch.distributed as dist

import _common as C
from booster_plugin import Booster, HybridParallelPlugin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    C.init_dist()
    rounds = 3 if args.quick else 15
    reference = C.build_llama(0)
    variants = {}
    for name in ("overlapped", "at step"):
        booster = Booster(plugin=HybridParallelPlugin())  # dp = world
        model = copy.deepcopy(reference)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt, *_ = booster.boost(model, opt)
        variants[name] = (booster, model, opt)
    batches = C.make_batches(rounds + 2, batch=C.BATCH)
    times = {name: [] for name in variants}
    losses = {name: [] for name in variants}

    def step(name, batch):
        booster, model, opt = variants[name]
        model.require_grad_sync = name == "overlapped"
        loss = model(**batch).loss
        booster.backward(loss, opt)
        model.require_grad_sync = True
        opt.step()
        opt.zero_grad()
        losses[name].append(loss.item())

    for name in variants:  # warm-up
        step(name, batches[0])
    for r in range(rounds):
        for name in C.rotated(list(variants), r):
            times[name].append(C.sync_time(lambda: step(name, batches[r + 1])))
    ratio = C.paired_ratio(times["at step"], times["overlapped"])
    rows = [[name, f"{1e3 * C.median(t):.1f}", f"{1e3 * min(t):.1f}", f"{C.BATCH * C.SEQ * dist.get_world_size() / C.median(t):.0f}",
             f"{C.paired_ratio(t, times['overlapped']):.3f}"] for name, t in times.items()]
    spread = max(abs(a - b) for a, b in zip(losses["overlapped"], losses["at step"]))
    if dist.get_rank() == 0:
        print(f"Llama h{C.HIDDEN} L{C.LAYERS} seq {C.SEQ} batch {C.BATCH}/replica, dp={dist.get_world_size()}, AdamW, "
              f"{rounds} interleaved rounds")
        print(C.table(["variant", "median ms", "min ms", "tokens/s", "time/overlapped"], rows))
        print(f"reduce-at-step / overlapped step time (paired median): {ratio:.3f}; loss spread {spread:.2e}")
        C.write_results("bench_dp", {"times_s": times, "paired_ratio_at_step_over_overlapped": ratio,
                                     "loss_spread": spread, "env": C.environment(), "load": C.loadavg()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

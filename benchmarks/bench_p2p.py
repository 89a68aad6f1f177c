"""Pipeline P2P transports, "p2p" (batched isend/irecv) vs "broadcast" (two-rank broadcast), on 2 gloo/CPU ranks.

  (a) ping-pong round trip of one activation-sized tensor (as the {"hidden_states": t} dict the pipeline sends),
      metadata cache on/off, next to bare dist.send/recv and a single batch_isend_irecv op as floors;
  (b) the combined send_forward_recv_backward / send_backward_recv_forward exchange vs the same transfers as
      separate calls;
  (c) a full 1F1B training step (pp=2, 4 and 8 microbatches) of a small Llama through HybridParallelPlugin.

All variants of a part are measured in one run, interleaved in rounds (rotating order); medians and ratios.
Run:  torchrun --nproc_per_node=2 benchmarks/bench_p2p.py   [--quick]
Writes benchmarks/results/bench_p2p.json.
"""
from __future__ import annotations

import argparse
import time

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from pipeline import PipelineP2PCommunication, PipelineStageManager, ProcessGroupMesh

NAME = "bench_p2p"
SIZES = {"8x128x256 fp32 (1 MiB)": (8, 128, 256), "1x16x64 fp32 (4 KiB)": (1, 16, 64)}
ITERS = {"8x128x256 fp32 (1 MiB)": 15, "1x16x64 fp32 (4 KiB)": 40}  # round trips per timed block


def comm_variants(stage_manager):
    out = {}
    for transport in ("p2p", "broadcast"):
        for cache in (True, False):
            out[f"{transport}, cache {'on' if cache else 'off'}"] = PipelineP2PCommunication(
                stage_manager, "cpu", transport=transport, enable_metadata_cache=cache)
    return out


# -- (a) ping-pong ------------------------------------------------------------------------------------------------
def _block_median_us(per_iter_s) -> float:
    """Median µs of the timed iterations (rank 0's clock), given to every rank. Timing each iteration and taking
    the median keeps a single preemption by other work on this busy machine out of the number."""
    us = torch.tensor([C.median(per_iter_s) * 1e6], dtype=torch.float64)
    dist.broadcast(us, src=0)
    return float(us.item())


def pingpong_block(comm, shape, iters: int) -> float:
    """Median µs per round trip in a block of `iters` (rank 0 sends forward, rank 1 answers backward)."""
    rank = dist.get_rank()
    x = torch.randn(shape)
    buf = torch.empty(shape)
    if comm is None:  # bare dist.send/recv of the tensor into a preallocated buffer: the transport floor
        def trip():
            if rank == 0:
                dist.send(x, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
    elif comm == "batch":  # one batch_isend_irecv op per transfer, no header/metadata: what "p2p" could cost
        def one(op, t, peer):
            for w in dist.batch_isend_irecv([dist.P2POp(op, t, peer)]):
                w.wait()

        def trip():
            if rank == 0:
                one(dist.isend, x, 1)
                one(dist.irecv, buf, 1)
            else:
                one(dist.irecv, buf, 0)
                one(dist.isend, buf, 0)
    else:
        def trip():
            if rank == 0:
                comm.send_forward({"hidden_states": x})
                comm.recv_backward()
            else:
                got = comm.recv_forward()
                comm.send_backward({"hidden_states": got["hidden_states"].detach()})
    per_iter = []
    dist.barrier()
    if hasattr(comm, "new_step"):  # a block is one "step": one shape, the header goes once per link
        comm.new_step()
    for _ in range(iters):
        t0 = time.perf_counter()
        trip()
        per_iter.append(time.perf_counter() - t0)
    if hasattr(comm, "flush"):
        comm.flush()
    return _block_median_us(per_iter)


# -- (b) combined exchange ----------------------------------------------------------------------------------------
def exchange_block(comm, shape, iters: int, combined: bool) -> float:
    """Median µs per exchange (one forward + one backward transfer), as the 1F1B steady state does it."""
    rank = dist.get_rank()
    x = torch.randn(shape)
    per_iter = []
    dist.barrier()
    comm.new_step()
    if combined:  # the 1F1B steady state: stage 0 sfrb, stage 1 sbrf, with a prologue/epilogue that matches them
        if rank == 0:
            comm.send_forward({"hidden_states": x})
            for _ in range(iters):
                t0 = time.perf_counter()
                comm.send_forward_recv_backward({"hidden_states": x})
                per_iter.append(time.perf_counter() - t0)
            comm.recv_backward()
        else:
            got = comm.recv_forward()
            for _ in range(iters):
                got = comm.send_backward_recv_forward({"hidden_states": got["hidden_states"].detach()})
            comm.send_backward({"hidden_states": got["hidden_states"].detach()})
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            if rank == 0:
                comm.send_forward({"hidden_states": x})
                comm.recv_backward()
            else:
                got = comm.recv_forward()
                comm.send_backward({"hidden_states": got["hidden_states"].detach()})
            per_iter.append(time.perf_counter() - t0)
    comm.flush()
    return _block_median_us(per_iter if rank == 0 else [0.0])


# -- (c) training step --------------------------------------------------------------------------------------------
def build_step(reference, transport: str, m: int, cache: bool):
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=m, p2p_transport=transport,
                                  enable_metadata_cache=cache)
    booster = Booster(plugin=plugin)
    model, opt = C.boost_copy(booster, reference)
    model.train()

    def step(batch):
        out = booster.execute_pipeline(iter([batch]), model, C.hf_criterion, opt, return_loss=True)
        opt.step()
        opt.zero_grad()
        return float(out["loss"].item())
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds for (a) and (b)")
    parser.add_argument("--step-rounds", type=int, default=11, help="interleaved rounds for (c)")
    parser.add_argument("--quick", action="store_true", help="few rounds, to check that it runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.step_rounds = 3, 2
    rank = C.init_dist()
    results = {"benchmark": NAME, "env": C.environment(), "hung": []}
    dog = C.Watchdog(NAME, results)
    say = C.rank0_printer(rank)
    t_start = time.perf_counter()

    mesh = ProcessGroupMesh(1, 2, 1)
    sm = PipelineStageManager(mesh, pipeline_axis=1)
    comms = comm_variants(sm)

    # (a)
    floors = {"dist.send/recv (floor)": None, "batch_isend_irecv, 1 op (floor)": "batch"}
    names_a = list(floors) + list(comms)
    comm_of = lambda v: floors[v] if v in floors else comms[v]
    samples = {(s, v): [] for s in SIZES for v in names_a}
    for size, shape in SIZES.items():
        for v in names_a:  # warm-up: connections, metadata caches
            dog.arm(f"(a) warm-up {v} {size}", 60)
            pingpong_block(comm_of(v), shape, 3)
        for r in range(args.rounds):
            for v in C.rotated(names_a, r):
                dog.arm(f"(a) ping-pong {v} {size}", 60)
                samples[(size, v)].append(pingpong_block(comm_of(v), shape, ITERS[size]))
        dog.disarm()
    rows, part_a = [], []
    for size in SIZES:
        base = samples[(size, "p2p, cache on")]
        for v in names_a:
            med = C.median(samples[(size, v)])
            ratio = C.paired_ratio(samples[(size, v)], base)
            rows.append([size, v, f"{med:.1f}", f"{min(samples[(size, v)]):.1f}", f"{ratio:.2f}",
                         f"{min(samples[(size, v)]) / min(base):.2f}"])
            part_a.append({"size": size, "variant": v, "median_us": med, "min_us": min(samples[(size, v)]),
                           "paired_ratio_vs_p2p_cache_on": ratio, "samples_us": samples[(size, v)]})
    results["pingpong"] = part_a
    say(f"\n(a) ping-pong round trip, µs: each block times {'/'.join(map(str, ITERS.values()))} round trips one by one and keeps their median; "
        f"median / min over {args.rounds} interleaved blocks; ratio = median over rounds of block / p2p+cache block "
        f"in the same round; min ratio = min / min of p2p+cache")
    say(C.table(["tensor", "variant", "median µs", "min µs", "ratio", "min ratio"], rows))

    # (b)
    variants_b = [(t, c) for t in ("p2p", "broadcast") for c in (True, False)]
    label = lambda t, c: f"{t}, {'combined' if c else 'separate'}"
    samples_b = {(s, label(*v)): [] for s in SIZES for v in variants_b}
    for size, shape in SIZES.items():
        for t, c in variants_b:
            dog.arm(f"(b) warm-up {label(t, c)} {size}", 60)
            exchange_block(comms[f"{t}, cache on"], shape, 3, c)
        for r in range(args.rounds):
            for t, c in C.rotated(variants_b, r):
                dog.arm(f"(b) exchange {label(t, c)} {size}", 60)
                samples_b[(size, label(t, c))].append(exchange_block(comms[f"{t}, cache on"], shape, ITERS[size], c))
        dog.disarm()
    rows, part_b = [], []
    for size in SIZES:
        for t in ("p2p", "broadcast"):
            comb, sep = C.median(samples_b[(size, label(t, True))]), C.median(samples_b[(size, label(t, False))])
            ratio = C.paired_ratio(samples_b[(size, label(t, True))], samples_b[(size, label(t, False))])
            mr = min(samples_b[(size, label(t, True))]) / min(samples_b[(size, label(t, False))])
            rows.append([size, t, f"{comb:.1f}", f"{sep:.1f}", f"{ratio:.2f}", f"{mr:.2f}"])
            part_b.append({"size": size, "transport": t, "combined_median_us": comb, "separate_median_us": sep,
                           "paired_ratio_combined_over_separate": ratio,
                           "samples_combined_us": samples_b[(size, label(t, True))],
                           "samples_separate_us": samples_b[(size, label(t, False))]})
    results["exchange"] = part_b
    say(f"\n(b) one forward + one backward transfer, µs (median of per-exchange times, {args.rounds} interleaved "
        f"blocks): combined send_X_recv_Y vs separate calls (cache on)")
    say(C.table(["tensor", "transport", "combined µs", "separate µs", "combined/separate", "min ratio"], rows))

    # (c)
    reference = C.build_llama(seed=0)
    batches = C.make_batches(4)
    variants_c = [("p2p", 4, True), ("broadcast", 4, True), ("p2p", 8, True), ("broadcast", 8, True),
                  ("p2p", 8, False), ("broadcast", 8, False)]
    vname = lambda t, m, c: f"{t}, m={m}, cache {'on' if c else 'off'}"
    steps = {v: build_step(reference, *v) for v in variants_c}
    first_loss, times, cpu = {}, {v: [] for v in variants_c}, {v: [] for v in variants_c}
    for v in variants_c:  # warm-up step (also the first-step loss: same init and data for all)
        dog.arm(f"(c) first step {vname(*v)}", 120)
        first_loss[v] = steps[v](batches[0])
    i = 1
    for r in range(args.step_rounds):
        for v in C.rotated(variants_c, r):
            dog.arm(f"(c) step {vname(*v)}", 120)
            b = batches[i % len(batches)]
            times[v].append(C.sync_time(lambda: steps[v](b), cpu[v]))
        i += 1
    dog.disarm()
    cpu_ranks = C.gather_per_rank({vname(*v): x for v, x in cpu.items()})
    cpu_sum = {v: C.median([sum(r[vname(*v)][i] for r in cpu_ranks) for i in range(len(cpu[v]))]) for v in variants_c}
    rows, part_c = [], []
    for v in variants_c:
        t, m, c = v
        med = C.median(times[v])
        ratio = C.paired_ratio(times[v], times[("p2p", m, True)])
        tok_s = C.BATCH * C.SEQ / med
        rows.append([vname(*v), f"{med * 1e3:.1f}", f"{min(times[v]) * 1e3:.1f}", f"{tok_s:.0f}",
                     f"{ratio:.3f}", f"{min(times[v]) / min(times[('p2p', m, True)]):.3f}",
                     f"{cpu_sum[v] * 1e3:.0f}", f"{first_loss[v]:.6f}"])
        part_c.append({"transport": t, "num_microbatches": m, "metadata_cache": c, "median_ms": med * 1e3,
                       "min_ms": min(times[v]) * 1e3, "tokens_per_s": tok_s,
                       "paired_ratio_vs_p2p_cache_on_same_m": ratio, "cpu_ms_median_sum_of_ranks": cpu_sum[v] * 1e3,
                       "cpu_ms_samples_per_rank": [[x * 1e3 for x in r[vname(*v)]] for r in cpu_ranks],
                       "first_step_loss": first_loss[v], "samples_ms": [x * 1e3 for x in times[v]]})
    results["train_step"] = part_c
    say(f"\n(c) 1F1B training step, Llama h{C.HIDDEN} L{C.LAYERS} vocab {C.VOCAB} seq {C.SEQ} batch {C.BATCH}, "
        f"pp=2, AdamW (median of {args.step_rounds} interleaved steps; ratio = median over rounds of time / "
        f"p2p+cache time at the same m in the same round)")
    say(C.table(["variant", "median ms", "min ms", "tokens/s", "ratio", "min ratio", "CPU ms (2 ranks)",
                 "first-step loss"], rows))

    # verdicts
    say("")
    verdict = {}
    for m in (4, 8):
        v = C.compare(times[("p2p", m, True)], times[("broadcast", m, True)], "p2p", "broadcast")
        verdict[f"train_step_m{m}"] = v
        say(f"train step m={m}: {v['text']}")
    for size in SIZES:
        v = C.compare(samples[(size, "p2p, cache on")], samples[(size, "broadcast, cache on")], "p2p", "broadcast")
        verdict[f"pingpong {size}"] = v
        say(f"ping-pong {size}: {v['text']}")
    losses = list(first_loss.values())
    spread = max(losses) - min(losses)
    say(f"first-step losses agree across variants: spread {spread:.2e}")
    results["verdict"] = verdict
    results["first_step_loss_spread"] = spread
    C.finish(NAME, results, rank, t_start, say, watchdog="60 s per block, 120 s per step")


if __name__ == "__main__":
    main()

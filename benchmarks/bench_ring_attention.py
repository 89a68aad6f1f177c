"""Ring attention (sp=2, two gloo ranks of one thread each) vs one process's torch sdpa on the full sequence, CPU.

Causal attention of one row (batch 1, 4 heads of 64, fp32), forward + backward, at sequence lengths 2k / 4k / 8k;
also a packed row (documents of 1/8 of the row each, where ring attention skips the cross-document blocks), the
ring kernel alone (sp=1 on each rank, no communication) and, to compare, the ring at sp=2 with its hand-written
fallback blocks instead of torch's fused CPU kernel (`ring_blocks.FUSED` emptied). Tokens per second = sequence
length / median step time. sdpa is measured with 1 and 2 intra-op threads (2 = the same cores the two ranks use).
Outside CI.   Run:  python benchmarks/bench_ring_attention.py [--lengths 2048 4096 8192] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shardformer.sequence import ring_blocks  # noqa: E402
from shardformer.sequence.ring_attention import RingAttention  # noqa: E402
from shardformer.sequence.ring_layout import shard_zigzag  # noqa: E402

HEADS, HEAD_DIM = 4, 64


def _inputs(length: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, HEADS, length, HEAD_DIM, generator=g) for _ in range(3)]


def _packed_positions(length: int) -> torch.Tensor:
    return torch.arange(length).remainder(length // 8)[None]


def _median_s(step, repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sdpa_step(q, k, v, mask=None):
    def step():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=mask is None)
        out.sum().backward()
    return step


def _ring_step(ring: RingAttention, q, k, v):
    module = type("Causal", (), {"is_causal": True})()

    def step():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = ring(module, *leaves, None)
        out.sum().backward()
    return step


def _rank(rank: int, port: int, lengths, repeats: int, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    solo = [dist.new_group([r]) for r in range(2)][rank]
    for length in lengths:
        q, k, v = (shard_zigzag(t, 2, rank, dim=2) for t in _inputs(length))
        positions = _packed_positions(length)
        variants = {"ring sp=2 causal": (RingAttention(dist.group.WORLD), ring_blocks.FUSED),
                    "ring sp=2 causal, hand-written blocks": (RingAttention(dist.group.WORLD), {}),
                    "ring sp=2 packed (8 docs)": (RingAttention(dist.group.WORLD, positions), ring_blocks.FUSED)}
        fused = ring_blocks.FUSED
        for name, (ring, kernels) in variants.items():
            dist.barrier()
            ring_blocks.FUSED = kernels
            seconds = _median_s(_ring_step(ring, q, k, v), repeats)
            ring_blocks.FUSED = fused
            if rank == 0:
                results[(name, length)] = seconds
        full = _inputs(length)
        dist.barrier()
        seconds = _median_s(_ring_step(RingAttention(solo), *full), repeats)  # both ranks at once, one each
        if rank == 0:
            results[("ring kernel sp=1 (1 thread)", length)] = seconds
    dist.destroy_process_group()


def _single_process(lengths, repeats: int, results) -> None:
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for length in lengths:
            q, k, v = _inputs(length)
            results[(f"sdpa 1 process ({threads} threads) causal", length)] = _median_s(_sdpa_step(q, k, v), repeats)
            doc = torch.arange(length) // (length // 8)  # the documents of _packed_positions
            mask = (doc[:, None] == doc[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
            results[(f"sdpa 1 process ({threads} threads) packed (8 docs)", length)] = _median_s(
                _sdpa_step(q, k, v, mask), repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    manager = mp.Manager()
    results = manager.dict()
    _single_process(args.lengths, args.repeats, results)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args.lengths, args.repeats, results), nprocs=2)
    names = sorted({name for name, _ in results.keys()})
    print(f"forward+backward, batch 1, {HEADS} heads x {HEAD_DIM}, fp32, CPU ({os.cpu_count()} cores); tokens/s "
          f"(median step ms)")
    print(f"{'variant':48s}" + "".join(f"{f'S={n}':>22s}" for n in args.lengths))
    for name in names:
        cells = "".join(f"{n / results[(name, n)]:>12.0f} ({results[(name, n)] * 1e3:6.0f})" for n in args.lengths)
        print(f"{name:48s}{cells}")


if __name__ == "__main__":
    main()

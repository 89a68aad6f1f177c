"""`colossalai.shardformer.layer.utils`: ColossalAI's Randomizer (seeded generator states that code can run under,
and a global index tests reset between models) on this library's accelerator API; the zigzag batch splitters of
ColossalAI's ring attention are refused (ring attention here splits inside HybridParallelPlugin)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from booster_plugin.compat.accelerator import get_accelerator

from ..._refused import refused_function

__all__ = ["Randomizer", "split_batch_zigzag", "split_varlen_zigzag"]

_RING = ("ring attention's zigzag layout is applied by HybridParallelPlugin(sequence_parallelism_mode='ring_attn') "
         "itself; batches are passed whole.")
split_batch_zigzag = refused_function("split_batch_zigzag", _RING)
split_varlen_zigzag = refused_function("split_varlen_zigzag", _RING)


def _seeded_state(seed: int, get, set_, seed_fn) -> torch.Tensor:
    original = get()
    seed_fn(seed)
    state = get()
    set_(original)
    return state


class Randomizer:
    """Generator states seeded with `seed`, kept apart from the process's: `with randomizer.fork_rng():` runs the
    block under them (the device's; with `enable_cpu` the CPU's too) and keeps where they got to."""

    _INDEX = 0

    def __init__(self, seed: int) -> None:
        acc = get_accelerator()
        self.seed = seed
        self.device_rng_state = _seeded_state(seed, acc.get_rng_state, acc.set_rng_state, acc.manual_seed)
        self.cpu_rng_state = _seeded_state(seed, torch.get_rng_state, torch.set_rng_state, torch.manual_seed)

    @contextmanager
    def fork_rng(self, enable_cpu: bool = False) -> Iterator[None]:
        acc = get_accelerator()
        device_before = acc.get_rng_state()
        acc.set_rng_state(self.device_rng_state)
        cpu_before = torch.get_rng_state() if enable_cpu else None
        if enable_cpu:
            torch.set_rng_state(self.cpu_rng_state)
        try:
            yield
        finally:
            self.device_rng_state = acc.get_rng_state()
            acc.set_rng_state(device_before)
            if enable_cpu:
                self.cpu_rng_state = torch.get_rng_state()
                torch.set_rng_state(cpu_before)

    @staticmethod
    def index() -> int:
        return Randomizer._INDEX

    @staticmethod
    def increment_index() -> None:
        Randomizer._INDEX += 1

    @staticmethod
    def reset_index() -> None:
        Randomizer._INDEX = 0

    @staticmethod
    def is_randomizer_index_synchronized(process_group: Optional[dist.ProcessGroup] = None) -> bool:
        """Whether every rank of the group has the same index."""
        if not dist.is_initialized():
            return True
        index = torch.tensor([Randomizer.index()], device=get_accelerator().get_current_device())
        gathered = [torch.empty_like(index) for _ in range(dist.get_world_size(process_group))]
        dist.all_gather(gathered, index, group=process_group)
        return all(bool(t == index) for t in gathered)

    @staticmethod
    def synchronize_index(process_group: Optional[dist.ProcessGroup] = None) -> None:
        """Every rank takes the group's largest index."""
        if dist.is_initialized():
            index = torch.tensor([Randomizer.index()], device=get_accelerator().get_current_device())
            dist.all_reduce(index, op=dist.ReduceOp.MAX, group=process_group)
            Randomizer._INDEX = int(index)

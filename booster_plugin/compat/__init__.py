"""The compatibility edge (the core imports nothing from it): ColossalAI's argument tables (colossal_args.py,
fsdp_args.py), its zero-bubble node API (v_schedule.py), the Paddle-style front-end (parallelize.py), the old
`checkpoint_io` name, and here what ColossalAI scripts import besides the Booster and the plugin, so that they port
by changing imports only:

| ColossalAI                                   | here                                         |
|----------------------------------------------|----------------------------------------------|
| `colossalai.launch_from_torch`               | `booster_plugin.compat.launch_from_torch`    |
| `colossalai.cluster.DistCoordinator`         | `booster_plugin.compat.DistCoordinator`      |
| `colossalai.nn.optimizer.HybridAdam`         | `booster_plugin.compat.HybridAdam`           |
| `colossalai.lazy.LazyInitContext`            | `booster_plugin.compat.LazyInitContext`      |
| `colossalai.accelerator.get_accelerator`     | `booster_plugin.compat.get_accelerator`      |
| `colossalai.utils.set_seed`                  | `booster_plugin.compat.set_seed`             |
| `colossalai.pipeline.schedule.v_schedule.PipelineGraph` | `booster_plugin.compat.PipelineGraph` (v_schedule.py) |

Each is built on torch: torch.distributed for the coordinator, torch.optim.Adam for HybridAdam, the meta device for
lazy initialization (booster_plugin/lazy: `from_pretrained` too; the plugin materializes only each rank's shard at
`boost`), torch.accelerator for devices (booster_plugin/compat/accelerator.py: ColossalAI's whole accelerator API).
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import warnings
from typing import Any, Callable, Iterator, Optional, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from pipeline.groups import world_group

from ..guards.launch import ensure_distributed
from ..lazy import LazyInitContext
from .accelerator import get_accelerator
from .v_schedule import PipelineGraph, ScheduledNode

__all__ = ["DistCoordinator", "HybridAdam", "LazyInitContext", "PipelineGraph", "ScheduledNode", "get_accelerator",
           "launch_from_torch", "set_seed"]

_P = ParamSpec("_P")  # a decorated function's parameters, and its result
_R = TypeVar("_R")


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2 ** 32)


def launch_from_torch(backend: Optional[str] = None, seed: int = 1024, verbose: bool = True) -> None:
    """Initialize torch.distributed from torchrun's environment and seed every generator.

    Args:
        backend: ignored in favour of the device's own (gloo on CPU, NCCL on CUDA), so a script written for
            `backend="nccl"` also runs on CPU machines.
        seed: passed to `set_seed`.
        verbose: rank 0 prints the world size and backend.
    """
    ensure_distributed()
    set_seed(seed)
    if verbose and dist.get_rank() == 0:
        print(f"Distributed environment initialized: world size {dist.get_world_size()}, backend "
              f"{dist.get_backend()}")


class DistCoordinator:
    """Rank queries and rank-0-only helpers (ColossalAI's names). Needs torch.distributed initialized."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistCoordinator needs torch.distributed: call launch_from_torch() (or create the "
                               "HybridParallelPlugin) first.")
        # ColossalAI's attributes (scripts read `_rank`, `_local_rank`, `_world_size`), behind read-only properties
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._local_rank = int(os.environ.get("LOCAL_RANK", self._rank))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @staticmethod
    def _rank_in(process_group: Optional[dist.ProcessGroup]) -> int:
        return dist.get_rank(process_group) if process_group is not None else dist.get_rank()

    def is_master(self, process_group: Optional[dist.ProcessGroup] = None) -> bool:
        return self._rank_in(process_group) == 0

    def is_node_master(self) -> bool:
        return self.local_rank == 0

    def is_last_process(self, process_group: Optional[dist.ProcessGroup] = None) -> bool:
        size = dist.get_world_size(process_group) if process_group is not None else self.world_size
        return self._rank_in(process_group) == size - 1

    def print_on_master(self, msg: str, process_group: Optional[dist.ProcessGroup] = None) -> None:
        if self.is_master(process_group):
            print(msg, flush=True)

    def print_on_node_master(self, msg: str) -> None:
        if self.is_node_master():
            print(msg, flush=True)

    def block_all(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        """Barrier over the group (default: the world)."""
        dist.barrier(group=process_group if process_group is not None else world_group())

    @contextlib.contextmanager
    def priority_execution(self, executor_rank: int = 0,
                           process_group: Optional[dist.ProcessGroup] = None) -> Iterator[None]:
        """`executor_rank` runs the block first (e.g. downloads), then every other rank runs it."""
        first = self._rank_in(process_group) == executor_rank
        if not first:
            self.block_all(process_group)
        yield
        if first:
            self.block_all(process_group)

    def on_master_only(self, process_group: Optional[dist.ProcessGroup] = None
                       ) -> Callable[[Callable[_P, _R]], Callable[_P, Optional[_R]]]:
        """Decorator: the function runs on the group's rank 0 only (elsewhere it returns None)."""
        def decorator(fn: Callable[_P, _R]) -> Callable[_P, Optional[_R]]:
            @functools.wraps(fn)
            def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> Optional[_R]:
                return fn(*args, **kwargs) if self.is_master(process_group) else None
            return wrapper
        return decorator

    def destroy(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        dist.destroy_process_group(process_group)


class HybridAdam(torch.optim.Adam):
    """ColossalAI's HybridAdam on torch's Adam: `adamw_mode=True` (default) decouples weight decay (AdamW).

    Args: as ColossalAI's. `bias_correction=False` is refused (torch's Adam always corrects, and dropping it changes
    results); `nvme_offload_fraction` > 0 is accepted with a warning (memory only: state stays in memory).
    """

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                 nvme_offload_fraction: float = 0.0, nvme_offload_dir: Optional[str] = None, **defaults: Any) -> None:
        if not bias_correction:
            raise NotImplementedError("HybridAdam(bias_correction=False) is not supported: torch's Adam always applies "
                                      "bias correction.")
        if nvme_offload_fraction > 0:
            warnings.warn("HybridAdam(nvme_offload_fraction>0) is ignored: optimizer state stays in memory; results "
                          "are unaffected.", stacklevel=2)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode, **defaults)

"""Plugin and DPPluginBase: ColossalAI's plugin base classes, with the hooks the Booster calls (booster.py).

Every plugin (HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin) is a DPPluginBase, so ColossalAI scripts'
`isinstance(plugin, DPPluginBase)` checks and `plugin: Plugin` hints hold. The Booster only calls these methods.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional, Protocol, Type, TypedDict

import numpy as np
import torch
import torch.distributed as dist

from pipeline.groups import world_group
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ..checkpoint.scheduler import Scheduler
from ..core.optimizer_wrapper import OptimizerWrapper
from ..guards.launch import ARRIVAL_TIMEOUT_S, arrival_barrier

__all__ = ["Plugin", "DPPluginBase", "BoosterCheckpointIO", "PipelineResult"]


class BoosterCheckpointIO(Protocol):
    """The checkpoint calls the Booster makes (checkpoint/io.py's HybridParallelCheckpointIO and its subclasses)."""

    def register_optimizer(self, model: nn.Module, optimizer: OptimizerWrapper) -> None: ...
    def synchronize(self) -> None: ...
    def save_model(self, model: nn.Module, checkpoint: str, **kwargs: Any) -> None: ...
    def load_model(self, model: nn.Module, checkpoint: str, **kwargs: Any) -> None: ...
    def save_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str, **kwargs: Any) -> None: ...
    def load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str, **kwargs: Any) -> None: ...
    def save_lr_scheduler(self, lr_scheduler: Scheduler, checkpoint: str) -> None: ...
    def load_lr_scheduler(self, lr_scheduler: Scheduler, checkpoint: str) -> None: ...
    def save_lora_as_pretrained(self, model: nn.Module, checkpoint: str, use_safetensors: bool = False) -> None: ...


class PipelineResult(TypedDict):
    """What `execute_pipeline` returns."""
    loss: Optional[torch.Tensor]  # the step's loss on every stage (with return_loss and a criterion), else None
    outputs: Any  # the user model's outputs merged over microbatches (with return_outputs on the last stage), else None


class Plugin(ABC):
    """ColossalAI's Plugin: how a Booster boosts a model and runs its steps and checkpoints."""

    @abstractmethod
    def configure(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                  criterion: Optional[Callable] = None, dataloader: Optional[DataLoader] = None, lr_scheduler=None):
        """Boost: (model, optimizer, criterion, dataloader, lr_scheduler), the model and optimizer wrapped."""

    @abstractmethod
    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                           **kwargs: Any) -> DataLoader:
        """A DataLoader over this rank's share of `dataset`."""

    @abstractmethod
    def get_checkpoint_io(self) -> BoosterCheckpointIO:
        """The collective checkpoint calls for models and optimizers this plugin boosted."""

    @abstractmethod
    def no_sync(self, model: nn.Module, optimizer: Optional[OptimizerWrapper] = None) -> ContextManager[None]:
        """Gradient accumulation: backward passes inside do not reduce gradients over data parallel."""

    def arrive(self, call: str) -> None:
        """Start of a collective call (checkpoints): fails on the ranks that arrived if some rank never does (by
        default a monitored barrier over the world)."""
        arrival_barrier(call, ARRIVAL_TIMEOUT_S)

    def control_checkpoint_io(self) -> bool:
        """ColossalAI's query: every plugin here provides its checkpoint IO."""
        return True

    def support_no_sync(self) -> bool:
        return True

    def control_precision(self) -> bool:
        """ColossalAI's query: False where Booster(mixed_precision=...) applies (torch AMP, core/torch_amp.py)."""
        return True

    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """`booster.backward(loss, optimizer)`: the boosted optimizer's backward (it scales an fp16 loss)."""
        optimizer.backward(loss)

    def execute_pipeline(self, data_iter: Iterator[Mapping[str, object]], model: nn.Module,
                         criterion: Optional[Callable], optimizer: Optional[OptimizerWrapper] = None,
                         return_loss: bool = True, return_outputs: bool = False) -> PipelineResult:
        raise NotImplementedError(f"{type(self).__name__} has no pipeline: execute_pipeline needs "
                                  f"HybridParallelPlugin(pp_size > 1 or num_microbatches=...). Call "
                                  f"loss = criterion(model(**batch), batch); booster.backward(loss, optimizer).")


class DPPluginBase(Plugin):
    """ColossalAI's base class of data-parallel plugins: ranks and size of the data-parallel group and
    `prepare_dataloader` over it. By default (a user's subclass, as ColossalAI's) data parallelism is the world, and
    the constructor records `rank` and `world_size` as ColossalAI's does; plugins with other layouts override."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("A data-parallel plugin needs torch.distributed: call launch_from_torch() first.")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    @property
    def dp_group(self) -> ProcessGroup:
        return world_group()

    @property
    def dp_rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_size(self) -> int:
        return dist.get_world_size()

    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                           distributed_sampler_cls: Optional[Type[DistributedSampler]] = None,
                           **kwargs: Any) -> DataLoader:
        """As ColossalAI's: a DataLoader over this rank's data-parallel shard (`distributed_sampler_cls`, default
        DistributedSampler, shuffled with `seed`), each worker seeded with `seed`; `kwargs` go to the DataLoader."""
        sampler_cls = distributed_sampler_cls or DistributedSampler
        sampler = sampler_cls(dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=shuffle, seed=seed)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, worker_init_fn=_WorkerSeed(seed),
                          drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers, **kwargs)


class _WorkerSeed:
    """A DataLoader worker's seeding (a class, so that worker processes can pickle it)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, worker_id: int) -> None:
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        random.seed(self.seed)


"""TorchDDPPlugin: ColossalAI 0.5's plugin for torch's DistributedDataParallel (the model replicated on every rank,
gradients averaged by DDP's bucketed all-reduce), with HF-format model checkpoints (checkpoint/ddp_io.py)."""
from __future__ import annotations

import warnings
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from pipeline.groups import world_group
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..checkpoint.ddp_io import TorchDDPCheckpointIO, ddp_context
from ..core.ddp_model import TorchDDPModel, ddp_module
from ..core.optimizer_wrapper import OptimizerWrapper
from ..guards.launch import DEFAULT_TIMEOUT_S, default_device, ensure_distributed
from .base import DPPluginBase

__all__ = ["TorchDDPPlugin", "OptimizerWrapper"]


class TorchDDPPlugin(DPPluginBase):
    """ColossalAI's TorchDDPPlugin, every argument by name: the model wrapped in torch's DistributedDataParallel
    over the world (its arguments as given) inside a TorchDDPModel (`model.module` is the DDP, `model.unwrap()` the
    model, as ColossalAI's), the optimizer in OptimizerWrapper. Precision is the model's own (as in
    ColossalAI, this plugin does not control it: `Booster(mixed_precision="fp16")` runs torch AMP around it). No
    pipeline: `execute_pipeline` is refused.

    Args:
        broadcast_buffers, bucket_cap_mb, find_unused_parameters, check_reduction, gradient_as_bucket_view,
            static_graph: DistributedDataParallel's arguments.
        fp8_communication: ColossalAI compresses DDP's gradient all-reduce to fp8 (on GPUs); ours reduces in the
            gradients' dtype: accepted, True warns (rank 0).
    """

    def __init__(self, broadcast_buffers: bool = True, bucket_cap_mb: int = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 fp8_communication: bool = False) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be > 0.")
        ensure_distributed()
        self.ddp_kwargs = dict(broadcast_buffers=broadcast_buffers, bucket_cap_mb=bucket_cap_mb,
                               find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
                               gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
        if fp8_communication and dist.get_rank() == 0:
            warnings.warn("TorchDDPPlugin(fp8_communication=True) is ignored: gradients are all-reduced in their own "
                          "dtype (ColossalAI compresses them to fp8 on GPUs). Results are unaffected.", stacklevel=2)
        self.device = default_device()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def configure(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                  criterion: Optional[Callable] = None, dataloader: Optional[DataLoader] = None, lr_scheduler=None):
        """The model on this rank's device (BatchNorm made SyncBatchNorm, as ColossalAI), in DistributedDataParallel
        (rank 0's parameters and buffers broadcast to every rank) in a TorchDDPModel; the optimizer in
        OptimizerWrapper."""
        if isinstance(model, (TorchDDPModel, DistributedDataParallel)):
            raise ValueError(f"The model is already boosted (a {type(model).__name__}): boost the original model "
                             f"once.")
        if any(isinstance(m, _BatchNorm) for m in model.modules()):
            if self.device.type == "cpu":
                raise NotImplementedError("TorchDDPPlugin converts BatchNorm to SyncBatchNorm, which needs an "
                                          "accelerator: run on GPUs or use a model without BatchNorm.")
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(self.device)
        device_ids = [self.device] if self.device.type != "cpu" else None
        model = TorchDDPModel(DistributedDataParallel(model, device_ids=device_ids, process_group=world_group(),
                                                      **self.ddp_kwargs))
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = OptimizerWrapper(optimizer)
        return model, optimizer, criterion, dataloader, lr_scheduler

    def control_precision(self) -> bool:
        """As in ColossalAI: Booster(mixed_precision="fp16"/"bf16") runs torch AMP around this plugin's model."""
        return False

    def get_checkpoint_io(self) -> TorchDDPCheckpointIO:
        return TorchDDPCheckpointIO(ddp_context(self.device, DEFAULT_TIMEOUT_S))

    def no_sync(self, model: Optional[nn.Module] = None,
                optimizer: Optional[OptimizerWrapper] = None) -> ContextManager[None]:
        """DistributedDataParallel's no_sync: gradients accumulate locally until the first backward outside."""
        return ddp_module(model).no_sync()

"""Booster: the user-facing entry point (ColossalAI's names and signatures)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch import nn

from .plugin import HybridParallelPlugin


class Booster:
    def __init__(self, device: Optional[str] = None, mixed_precision: Optional[str] = None,
                 plugin: Optional[HybridParallelPlugin] = None) -> None:
        if mixed_precision is not None:
            raise ValueError("Set precision on the plugin: HybridParallelPlugin(precision='bf16').")
        self.plugin = plugin if plugin is not None else HybridParallelPlugin()
        self.device = device

    def boost(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
              criterion: Optional[Callable] = None, dataloader=None, lr_scheduler=None):
        """Shard `model` for this rank and wrap the optimizer; returns (model, optimizer, criterion, dataloader,
        lr_scheduler)."""
        return self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler)

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """Backward for pp_size == 1 (with a pipeline, execute_pipeline runs the backward passes)."""
        if self.plugin.pp_size > 1:
            raise RuntimeError("With pp_size > 1 use booster.execute_pipeline(...), which runs forward and backward.")
        optimizer.backward(loss)

    def execute_pipeline(self, data_iter: Iterator, model: nn.Module, criterion: Callable, optimizer=None,
                         return_loss: bool = True, return_outputs: bool = False) -> Dict[str, Any]:
        """One step (forward and, with grad enabled, backward) over microbatches; {"loss", "outputs"}."""
        return self.plugin.execute_pipeline(data_iter, model, criterion, optimizer, return_loss, return_outputs)

    @contextlib.contextmanager
    def no_sync(self, model: Optional[nn.Module] = None, optimizer=None):
        """Gradient accumulation: gradients are reduced over data parallel at optimizer.step(), so nothing to skip."""
        yield

"""HybridPluginBase: the Booster hooks of the plugins that boost with our engine (HybridParallelPlugin and, through
it, LowLevelZeroPlugin): their checkpoint IO, backward and no_sync."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from ..checkpoint import CheckpointContext, HybridParallelCheckpointIO
from ..core.optimizer_wrapper import OptimizerWrapper
from .base import DPPluginBase

__all__ = ["HybridPluginBase"]


class HybridPluginBase(DPPluginBase):
    """DPPluginBase for models boosted into a HybridParallelModule (booster_plugin/plugins/prepare.py)."""

    pp_size: int  # the subclass's pipeline size

    def get_checkpoint_io(self) -> HybridParallelCheckpointIO:
        return HybridParallelCheckpointIO(CheckpointContext.from_plugin(self))

    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """Backward for pp_size == 1 (with a pipeline, execute_pipeline runs the backward passes)."""
        if self.pp_size > 1:
            raise RuntimeError("With pp_size > 1 use booster.execute_pipeline(...), which runs forward and backward.")
        optimizer.backward(loss)

    @contextlib.contextmanager
    def no_sync(self, model: Optional[nn.Module] = None,
                optimizer: Optional[OptimizerWrapper] = None) -> Iterator[None]:
        """Backward passes inside accumulate locally; the data-parallel reduction starts in the first backward
        outside (or at optimizer.step()). The boosted module skips it while `require_grad_sync` is False."""
        previous = getattr(model, "require_grad_sync", None)
        if previous is not None:
            model.require_grad_sync = False
        try:
            yield
        finally:
            if previous is not None:
                model.require_grad_sync = previous

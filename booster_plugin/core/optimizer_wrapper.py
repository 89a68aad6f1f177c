"""OptimizerWrapper: ColossalAI's wrapper of a torch optimizer, the boosted optimizer of TorchDDPPlugin."""
from __future__ import annotations

from abc import ABCMeta
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["OptimizerWrapper"]


class OptimizerWrapper(metaclass=ABCMeta):
    """ColossalAI's OptimizerWrapper: the boosted optimizer of TorchDDPPlugin. `backward(loss)` runs the backward
    (DDP averages the gradients in it); other attributes are the wrapped optimizer's. Every plugin's boosted optimizer
    is one (`isinstance(optimizer, OptimizerWrapper)`, as in ColossalAI): the FSDP ones subclass it,
    HybridParallelOptimizer (and so ZeroOptimizer) is registered with it."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optim, name)  # only reached for names this class does not define

    def unwrap(self) -> torch.optim.Optimizer:
        return self.optim

    @property
    def parameters(self) -> list:
        """Every parameter the optimizer steps (ColossalAI's property)."""
        return [p for group in self.optim.param_groups for p in group["params"]]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        torch.autograd.backward(tensor, grad)

    def step(self, *args: Any, **kwargs: Any) -> Optional[float]:
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients' global norm (DDP's gradients are the same on every rank: this is the global one)."""
        return nn.utils.clip_grad_norm_(self.parameters, max_norm, norm_type=norm_type)

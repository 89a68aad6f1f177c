"""TorchDDPModel: the model TorchDDPPlugin's `boost` returns (ColossalAI's TorchDDPModel, a ModelWrapper):
`module` is torch's DistributedDataParallel, calling the wrapper runs it, `unwrap()` is the original model."""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .torch_amp import AMPModule

__all__ = ["TorchDDPModel", "ddp_module"]


class TorchDDPModel(nn.Module):
    def __init__(self, module: DistributedDataParallel) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        return self.module.module


def ddp_module(model: nn.Module) -> DistributedDataParallel:
    """The DistributedDataParallel inside the TorchDDPModel that TorchDDPPlugin's boost returned (inside torch AMP's
    wrapper with Booster(mixed_precision=...))."""
    if isinstance(model, AMPModule):
        model = model.module
    if isinstance(model, TorchDDPModel):
        return model.module
    raise TypeError(f"Expected the model returned by booster.boost() with TorchDDPPlugin (a TorchDDPModel), got "
                    f"{type(model).__name__}.")

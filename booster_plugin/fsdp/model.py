"""FSDPModel: the model `boost` returns from the FSDP2 plugins (ColossalAI's ModelWrapper: TorchFSDPModel,
GeminiDDP)."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from .state import full_model_state

__all__ = ["FSDPModel", "GeminiModel", "fsdp_module", "hf_class_name"]


class FSDPModel(nn.Module):
    """Wraps the model that torch's `fully_shard` sharded in place (its parameters are DTensors, this rank's dim-0
    slices; its class is FSDP2's subclass of the original). Calling it runs the model (FSDP2's hooks gather each
    layer's parameters around its forward and backward); `unwrap()` / `.module` is the sharded model itself."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        return self.module


class GeminiModel(FSDPModel):
    """GeminiPlugin's boosted model (ColossalAI's GeminiDDP): `state_dict()` is the whole model's, under the
    model's own names; with `only_rank_0` (the default, as ColossalAI) rank 0 gets it (on the CPU) and the other ranks
    an empty dict. Collective: every rank calls it."""

    def state_dict(self, destination: Optional[Dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False,
                   only_rank_0: bool = True) -> Dict[str, torch.Tensor]:
        state = full_model_state(self.module, rank0_only=only_rank_0)
        destination = {} if destination is None else destination
        destination.update({prefix + name: tensor for name, tensor in state.items()})
        return destination


def fsdp_module(model: nn.Module) -> nn.Module:
    """The sharded model inside the FSDPModel that GeminiPlugin's or TorchFSDPPlugin's boost returned."""
    if isinstance(model, FSDPModel):
        return model.module
    raise TypeError(f"Expected the model returned by booster.boost() with GeminiPlugin or TorchFSDPPlugin (an "
                    f"FSDPModel), got {type(model).__name__}.")


def hf_class_name(module: nn.Module) -> str:
    """The model's own class name (FSDP2 replaces the class by `FSDP<name>`, a subclass of it)."""
    from torch.distributed.fsdp import FSDPModule
    cls = type(module)
    if issubclass(cls, FSDPModule):
        cls = next(base for base in cls.__mro__[1:] if not issubclass(base, FSDPModule))
    return cls.__name__

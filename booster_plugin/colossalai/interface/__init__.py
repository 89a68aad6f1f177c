"""`colossalai.interface`: what every boosted model and optimizer is.

`OptimizerWrapper` is this library's (every plugin's boosted optimizer is one). `ModelWrapper` is ColossalAI's
(`module` wrapped, `unwrap()`, calls forwarded), and the boosted models of every plugin are registered with it:
HybridParallelPlugin's (and its ZeRO and MoE variants'), the FSDP2 plugins' (GeminiPlugin, TorchFSDPPlugin) and
TorchDDPPlugin's (whose `module` is torch's DistributedDataParallel, as in ColossalAI). `AMPModelMixin.update_master_params()` is ColossalAI's hook for models that keep master weights
(nothing to do by default; here `booster.load_model` refreshes them).
"""
from abc import ABCMeta
from typing import Any

from torch import nn

from booster_plugin.core.ddp_model import TorchDDPModel
from booster_plugin.fsdp.model import FSDPModel
from booster_plugin.core.optimizer_wrapper import OptimizerWrapper
from booster_plugin.core.parallel_module import HybridParallelModule

__all__ = ["OptimizerWrapper", "ModelWrapper", "AMPModelMixin"]


class ModelWrapper(nn.Module, metaclass=ABCMeta):
    """ColossalAI's ModelWrapper: `self.module` is the wrapped model; calling the wrapper calls it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        """The original model (inside nested ModelWrappers)."""
        return self.module.unwrap(unwrap_peft) if isinstance(self.module, ModelWrapper) else self.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


ModelWrapper.register(HybridParallelModule)
ModelWrapper.register(FSDPModel)
ModelWrapper.register(TorchDDPModel)


class AMPModelMixin:
    """ColossalAI's interface of models trained with automatic mixed precision."""

    def update_master_params(self) -> None:
        """Copy the model's (low-precision) parameters into its master weights; nothing to do by default."""

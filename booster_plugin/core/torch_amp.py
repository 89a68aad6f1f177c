"""Booster(mixed_precision=...) where the plugin leaves precision to the Booster (TorchDDPPlugin: its
`control_precision()` is False), as ColossalAI's Booster does it, with torch's AMP:

- "fp16": the model's and the criterion's forward run under `torch.autocast(device, torch.float16)`, the loss is
  scaled by torch's `GradScaler` (ColossalAI's FP16TorchMixedPrecision, its defaults): `optimizer.step()` skips a
  step with non-finite gradients and adapts the scale; `clip_grad_by_norm` unscales first.
- "bf16": autocast to bfloat16, no loss scale (ColossalAI's BF16MixedPrecision is an empty class that cannot run;
  this one does what the name says).
- anything else ("fp16_apex", "fp16_naive", "fp8") is refused with the reason.

Parameters stay in their own dtype (fp32): autocast casts per operation. The plugins that control precision
(HybridParallelPlugin and its family, Gemini, TorchFSDP) take it as their own `precision=` argument instead.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from .optimizer_wrapper import OptimizerWrapper

__all__ = ["AMPModule", "AMPOptimizer", "TorchAMP", "torch_amp"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_REFUSED = {"fp16_apex": "NVIDIA apex is not used here", "fp16_naive": "ColossalAI's naive fp16 (parameters cast "
            "to fp16) loses precision in the update", "fp8": "fp8 matmuls need kernels this library does not ship"}


class TorchAMP(NamedTuple):
    """What Booster(mixed_precision=...) asked for, validated."""
    name: str
    dtype: torch.dtype


def torch_amp(mixed_precision: Optional[str]) -> Optional[TorchAMP]:
    """The validated setting (None: off); raises for a name that cannot run, with the alternative."""
    if mixed_precision is None or mixed_precision == "fp32":
        return None
    if mixed_precision in _REFUSED:
        raise NotImplementedError(f"Booster(mixed_precision={mixed_precision!r}): {_REFUSED[mixed_precision]}. Use "
                                  f"'fp16' (torch AMP with a loss scale) or 'bf16'.")
    if mixed_precision not in _DTYPES:
        raise ValueError(f"Booster(mixed_precision={mixed_precision!r}): expected one of 'fp16', 'bf16' (or None).")
    return TorchAMP(mixed_precision, _DTYPES[mixed_precision])


class AMPModule(nn.Module):
    """The boosted model, its forward under autocast (ColossalAI's TorchAMPModule)."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type, self.dtype = device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)

    def unwrap(self) -> nn.Module:
        """The user's model (inside the plugin's boosted model this wraps, as ColossalAI's ModelWrapper.unwrap)."""
        return self.module.unwrap()


class AMPCriterion:
    """The criterion under autocast, as ColossalAI wraps it."""

    def __init__(self, criterion: Callable, device_type: str, dtype: torch.dtype) -> None:
        self.criterion, self.device_type, self.dtype = criterion, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.criterion(*args, **kwargs)


class AMPOptimizer(OptimizerWrapper):
    """The optimizer with torch's GradScaler (fp16) or none (bf16): ColossalAI's TorchAMPOptimizer."""

    def __init__(self, optim: torch.optim.Optimizer, device_type: str, scaled: bool) -> None:
        super().__init__(optim)
        self.scaler = torch.amp.GradScaler(device_type, enabled=scaled)  # ColossalAI's defaults are torch's

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scaler.scale(loss).backward(**kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        torch.autograd.backward(tensor, self.scaler.scale(grad))

    def step(self, *args: Any, **kwargs: Any) -> Optional[float]:
        out = self.scaler.step(self.optim, *args, **kwargs)
        self.scaler.update()
        return out

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.scaler.unscale_(self.optim)
        return super().clip_grad_by_norm(max_norm, norm_type)


def apply_torch_amp(amp: TorchAMP, device: torch.device, model: nn.Module,
                    optimizer: Union[None, torch.optim.Optimizer, OptimizerWrapper], criterion: Optional[Callable]):
    """(model, optimizer, criterion) of a plugin that does not control precision, under `amp`."""
    kind = device.type
    model = AMPModule(model, kind, amp.dtype)
    if optimizer is not None:
        optimizer = AMPOptimizer(optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer, kind,
                                 scaled=amp.dtype == torch.float16)
    if criterion is not None:
        criterion = AMPCriterion(criterion, kind, amp.dtype)
    return model, optimizer, criterion

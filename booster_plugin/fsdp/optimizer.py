"""The boosted optimizers of the FSDP2 plugins: ColossalAI's FSDPOptimizerWrapper (TorchFSDPPlugin) and
GeminiOptimizer (GeminiPlugin: fp16 loss scaling, clipping by `max_norm`, gradients cleared after each step).

The wrapped torch optimizer steps the sharded fp32 parameters (DTensors, this rank's slices): they are the master
weights whatever the compute dtype. Gradients arrive already averaged over data parallel (FSDP2 reduce-scatters them
in the backward), so clipping needs only the global norm, which torch's clip_grad_norm_ computes over DTensors.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.mixed_precision import DynamicLossScaler
from ..core.optimizer_wrapper import OptimizerWrapper
from ..guards.optimizer_guard import boosted_step
from .model import fsdp_module
from .state import full_optimizer_state, load_full_optimizer_state

__all__ = ["FSDPOptimizerWrapper", "GeminiOptimizer", "full_value"]


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (e.g. a gradient norm), a plain tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FSDPOptimizerWrapper(OptimizerWrapper):
    """ColossalAI's FSDPOptimizerWrapper: the optimizer of TorchFSDPPlugin; `unwrap_model()` is the boosted model."""

    def __init__(self, optim: torch.optim.Optimizer, model: nn.Module) -> None:
        super().__init__(optim)
        self.model = model

    def unwrap_model(self) -> nn.Module:
        return self.model

    def step(self, *args: Any, **kwargs: Any) -> Optional[float]:
        with boosted_step(self.optim):  # (an optimizer stepping these parameters outside boost is refused)
            return self.optim.step(*args, **kwargs)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients' global norm (over every rank's shards); returns that norm before clipping."""
        return full_value(nn.utils.clip_grad_norm_(self.parameters, max_norm, norm_type=norm_type))


class GeminiOptimizer(FSDPOptimizerWrapper):
    """ColossalAI's GeminiOptimizer over FSDP2. `backward` scales an fp16 loss; `step` unscales and checks the
    gradients (an overflow anywhere skips the step on every rank and backs the scale off), clips their global norm
    to `max_norm` (> 0), steps, and clears the gradients (as Gemini does, also after a skipped step)."""

    def __init__(self, optim: torch.optim.Optimizer, model: nn.Module, scaler: Optional[DynamicLossScaler],
                 max_norm: float) -> None:
        super().__init__(optim, model)
        self.scaler = scaler
        self.max_norm = max_norm
        self._grad_norm: Optional[float] = None
        self._warned_clip = False

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward(**kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        torch.autograd.backward(tensor, grad * self.loss_scale if self.scaler is not None else grad)

    def _grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.parameters if p.grad is not None]

    def step(self, *args: Any, **kwargs: Any) -> Optional[float]:
        if self.scaler is not None:
            overflow = bool(self.scaler.unscale_and_check([_local(g) for g in self._grads()]))
            self.scaler.update(overflow)
            if overflow:
                if self.scaler.at_min_scale and dist.get_rank() == 0:
                    warnings.warn(f"fp16 gradients overflow at the minimum loss scale {self.scaler.scale}: the step "
                                  f"is skipped.", stacklevel=2)
                self._grad_norm = None
                self.zero_grad()
                return None
        if self.max_norm > 0:
            norm = nn.utils.clip_grad_norm_(self.parameters, self.max_norm)
            self._grad_norm = float(full_value(norm))
        with boosted_step(self.optim):
            result = self.optim.step(*args, **kwargs)
        self.zero_grad()
        return result

    def get_grad_norm(self, norm_type: float = 2, **kwargs: object) -> Optional[float]:
        """The global gradient norm of the last step that clipped (max_norm > 0), before clipping."""
        return self._grad_norm

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, *args: object, **kwargs: object) -> None:
        """As ColossalAI's GeminiOptimizer: clipping is the plugin's (`GeminiPlugin(max_norm=...)`); this call
        warns and does nothing."""
        if not self._warned_clip and dist.get_rank() == 0:
            warnings.warn("GeminiOptimizer.clip_grad_by_norm does nothing (as in ColossalAI): Gemini clips by "
                          "itself, pass GeminiPlugin(max_norm=...).", stacklevel=2)
        self._warned_clip = True

    def clip_grad_by_value(self, clip_value: float, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("Gemini does not support clip_grad_by_value (as in ColossalAI).")

    def state_dict(self, only_rank_0: bool = True) -> Dict[str, Any]:
        """The whole optimizer state (keyed by parameter name) and param groups, as ColossalAI's GeminiOptimizer:
        with `only_rank_0` on rank 0 only (the others get an empty dict). Collective."""
        return full_optimizer_state(fsdp_module(self.model), self.optim, rank0_only=only_rank_0)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a whole state as `state_dict(only_rank_0=False)` returns it; every rank keeps its slices."""
        load_full_optimizer_state(fsdp_module(self.model), self.optim, state_dict)

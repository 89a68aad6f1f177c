"""Mixture-of-experts experts over tensor parallel, as transformers' `moe_tp_experts` plan style: the stacked expert
weights are split like column / row layers (gate|up by output features, down by input features), so each rank
computes its part of every expert the router picked, for every token.

- Output: this rank's partial sum of the experts' outputs; summed over the tp group (all-reduce forward).
- Inputs: the hidden states and the routing weights are replicated but their gradients, from this rank's part of
  the experts only, are partial: summed over the group (all-reduce backward). The routing indices need nothing.
The router itself stays replicated (it sees the full hidden states and full gradients)."""
from __future__ import annotations

import functools

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .comm import copy_to_tp, reduce_from_tp

__all__ = ["split_experts"]


def split_experts(module: nn.Module, group: ProcessGroup | None) -> None:
    """Hook `module` (transformers' experts: forward(hidden_states, top_k_index, top_k_weights)) for experts whose
    weights are split over `group` (see the module docstring). Its parameters are split separately."""
    module.register_forward_pre_hook(functools.partial(_copy_inputs, group), with_kwargs=True)
    module.register_forward_hook(functools.partial(_sum_output, group))


def _copy_inputs(group: ProcessGroup | None, module: nn.Module, args: tuple, kwargs: dict):
    args, kwargs = list(args), dict(kwargs)
    for position, name in ((0, "hidden_states"), (2, "top_k_weights")):
        if len(args) > position:
            args[position] = copy_to_tp(args[position], group)
        elif name in kwargs:
            kwargs[name] = copy_to_tp(kwargs[name], group)
        else:
            raise TypeError(f"{type(module).__name__} was called without `{name}` (positional argument "
                            f"{position}); its tensor-parallel split needs it to sum its gradient over tp ranks.")
    return tuple(args), kwargs


def _sum_output(group: ProcessGroup | None, module: nn.Module, args, output: Tensor) -> Tensor:
    return reduce_from_tp(output, group)

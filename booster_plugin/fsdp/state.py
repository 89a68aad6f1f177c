"""Whole (unsharded) state dicts of an FSDP2-sharded model and its optimizer, through torch's
`torch.distributed.checkpoint.state_dict` (collective: every rank calls). With `rank0_only` the full tensors are
gathered onto rank 0's CPU and the other ranks get an empty dict; otherwise every rank gets them."""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from ..guards.optimizer_guard import boosted_step

__all__ = ["full_model_state", "full_optimizer_state", "load_full_optimizer_state"]


def _options(rank0_only: bool) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)


def full_model_state(module: nn.Module, rank0_only: bool) -> Dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers, whole, under the model's own names."""
    return get_model_state_dict(module, options=_options(rank0_only))


def full_optimizer_state(module: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool) -> Dict[str, Any]:
    """The optimizer's state keyed by parameter name, whole, and its param groups."""
    with boosted_step(optim):  # (before any step, torch initializes the state with a step of lr 0)
        return get_optimizer_state_dict(module, optim, options=_options(rank0_only))


def load_full_optimizer_state(module: nn.Module, optim: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """Each rank keeps its slices of the whole state given (as `full_optimizer_state` returns it); the param
    groups' values are taken as given (torch's flattening turns tuples such as Adam's betas into lists)."""
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
    with boosted_step(optim):  # torch initializes the state with a step of lr 0 (not the user's stray step)
        set_optimizer_state_dict(module, optim, state, options=StateDictOptions(full_state_dict=True))
    for group, saved in zip(optim.param_groups, hyper):
        group.update(saved)

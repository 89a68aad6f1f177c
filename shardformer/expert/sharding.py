"""Which modules of a model are mixture-of-experts experts, and their split over the expert-parallel group
(layer/expert_parallel.py does the exchange).

An experts module is one the tp plan shards as experts (transformers' `moe_tp_experts`), or, for a plan that names
none, a module with an integer `num_experts` whose own parameters are stacked over that many experts (transformers
5's fused 3-D expert weights; a router's 2-D [experts, hidden] weight does not count). Everything else in the model (routers, shared experts, attention) stays replicated
over ep.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from torch import nn

from pipeline.context import Axis

from .dispatch import expert_parameters, split_experts_over_ep
from ..stage.forward import Released
from ..tensor.styles import Experts, ParallelStyle

__all__ = ["experts_modules", "check_expert_parallel", "refuse_sequence_parallelism", "shard_experts"]


def experts_modules(model: nn.Module, plan_style: Callable[[str], Optional[ParallelStyle]]) -> List[Tuple[str, nn.Module]]:
    """(path, module) of every experts module `model` still holds (see the module docstring)."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, Released):
            continue
        count = getattr(module, "num_experts", None)
        planned = isinstance(plan_style(path), Experts)
        stacked = expert_parameters(module, count) if isinstance(count, int) and count > 0 else []
        if planned or any(p.dim() >= 3 for _, p in stacked):  # (a router's [E, hidden] weight is not stacked)
            found.append((path, module))
    return found


def check_expert_parallel(model: nn.Module, plan_style: Callable[[str], Optional[ParallelStyle]],
                          ep_size: int) -> None:
    """Raise, alike on every rank (the model is the same everywhere), when the model's experts cannot be split
    over `ep_size` ranks."""
    found = experts_modules(model, plan_style)
    name = type(model).__name__
    if not found:
        raise ValueError(f"ep_size={ep_size} splits mixture-of-experts experts over ranks, but {name} has no experts "
                         f"module with stacked expert weights (transformers 5's `...Experts` with 3-D parameters). "
                         f"Use ep_size=1 for this model.")
    for path, module in found:
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int) or not expert_parameters(module, count):
            raise ValueError(f"{name}: '{path}' ({type(module).__name__}) is planned as experts but has no parameters "
                             f"stacked over an integer `num_experts`; expert parallelism cannot split it. Use "
                             f"ep_size=1.")
        if count % ep_size:
            raise ValueError(f"ep_size={ep_size} must divide the number of experts of {name} ({count} in '{path}'): "
                             f"each ep rank holds num_experts / ep_size whole experts.")


def refuse_sequence_parallelism(model: nn.Module, plan_style: Callable[[str], Optional[ParallelStyle]],
                                mode: str) -> None:
    """Sequence parallelism "split_gather" is not supported on mixture-of-experts models: raise, alike on every rank,
    naming why (before anything is sharded or any collective runs). "all_to_all" and "ring_attn" run the experts on
    this rank's tokens (replicated, or split over ep) and gather the router logits (router_logits.py)."""
    found = experts_modules(model, plan_style)
    if found and mode == "split_gather":
        raise NotImplementedError(
            f"sequence_parallelism_mode='split_gather' on {type(model).__name__}, a mixture-of-experts model "
            f"('{found[0][0]}'): not supported. Its experts are split over the tp ranks, each computing its part of "
            f"every expert for the same tokens, but split_gather leaves them this rank's part of the sequence. Use "
            f"sequence_parallelism_mode='all_to_all' or 'ring_attn' (with sp_size > 1; ep_size composes).")


def shard_experts(model: nn.Module, plan_style: Callable[[str], Optional[ParallelStyle]], ep: Axis) -> List[str]:
    """Split every experts module `model` holds over the `ep` axis (after the tp split, if any); the full names of
    the parameters now holding this rank's experts only."""
    names = []
    for path, module in experts_modules(model, plan_style):
        for name in split_experts_over_ep(module, ep, module.num_experts):
            names.append(f"{path}.{name}" if path else name)
    return names

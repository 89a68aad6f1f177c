"""An optimizer that has already stepped, boosted (as ColossalAI accepts it): its state carried onto the sharded
parameters by name. Before sharding, `unsharded_state` takes each parameter's state out of the torch optimizer under
every name of the parameter; after the boosted optimizer is built, `carry_state` gives each parameter this rank steps
its slice of that state (tensors shaped like the full parameter sliced as the parameter is: tp through its TPSpec,
experts by ep rank; ZeRO partitions it on the way out), through the same installation as load_optimizer."""
from __future__ import annotations

from typing import Dict, List, Union

import torch

from pipeline.context import ParallelContext
from shardformer.layer.spec import get_tp_spec, shard_tensor

from ..checkpoint.optimizer import optimizer_parts
from ..checkpoint.optimizer_load import Loaded, apply_optimizer
from ..core.optimizer import HybridParallelOptimizer
from ..core.parallel_module import HybridParallelModule

StateValue = Union[torch.Tensor, float, int, bool]  # Adam's moments, its step, ...
StateByName = Dict[str, Dict[str, StateValue]]


def unsharded_state(optimizer: torch.optim.Optimizer, names: Dict[int, List[str]]) -> StateByName:
    """The optimizer's per-parameter state, keyed by each of the parameter's names; the optimizer is left without
    state (its parameters are about to be replaced by their shards)."""
    carried: StateByName = {}
    for p, state in optimizer.state.items():
        for name in names.get(id(p), ()):
            carried[name] = dict(state)
    optimizer.state.clear()
    return carried


def carry_state(boosted: HybridParallelOptimizer, carried: StateByName, ctx: ParallelContext) -> None:
    """Install `carried` (from unsharded_state) into the boosted optimizer, each tensor sliced for this rank."""
    if not carried:
        return
    with boosted.unpartitioned(load=True):  # ZeRO: installed whole, partitioned on exit
        parts = optimizer_parts(boosted)
        new_state = {}
        for group in parts.optim.param_groups:
            for p in group["params"]:
                name = parts.names[id(p)]
                if name in carried:
                    new_state[p] = {key: _slice(value, p, name, parts.module, ctx) for key, value in
                                    carried[name].items()}
        apply_optimizer(parts.optim, Loaded(new_state, [None] * len(parts.optim.param_groups), None))


def _slice(value: StateValue, p: torch.Tensor, name: str, module: HybridParallelModule,
           ctx: ParallelContext) -> StateValue:
    """This rank's part of one state value: a tensor shaped like the full parameter is sliced as `p` is."""
    full_shape = tuple(module.full_params[name][0])
    if not torch.is_tensor(value) or tuple(value.shape) != full_shape or value.dim() == 0:
        return value  # e.g. Adam's step
    if name in module.info.expert_params:  # every expert before sharding: this ep rank's (as load_optimizer)
        value = value.narrow(0, ctx.ep.rank * p.shape[0], p.shape[0])
    spec = get_tp_spec(p)
    if spec is not None:
        value = shard_tensor(value, spec, ctx.tp.rank, ctx.tp.size)
    return value.to(device=p.device).clone()

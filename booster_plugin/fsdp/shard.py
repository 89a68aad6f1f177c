"""Sharding a model with torch FSDP2 (`fully_shard`): the mesh, which submodules become their own FSDP group (the
decoder layers), the replicas made equal before sharding, and the optimizer pointed at the sharded parameters.

fully_shard replaces every parameter of a module it shards by a new DTensor parameter (this rank's dim-0 slice), so
an optimizer built over the model before `boost` would step the old tensors; `rebind_optimizer` puts the new ones
into its param groups, matched by parameter name (groups and their hyperparameters are kept, and so is the
optimizer object, so an lr scheduler built on it stays valid).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.context import Axis
from pipeline.groups import group_backend, world_group
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp.wrap import _Policy
from torch.distributed.utils import _sync_module_states


__all__ = ["make_mesh", "decoder_layers", "policy_targets", "prepare_replicas", "shard_model", "rebind_optimizer"]

_BROADCAST_BUCKET = 250 * 1024 * 1024  # DDP's bucket size for its own initial broadcast


@dataclass(frozen=True)
class ShardLayout:
    """How fully_shard lays parameters out: over `replicate` x `shard` ranks (HSDP when replicate > 1) and whether
    a layer's parameters are freed again after its forward (ZeRO-3) or kept until its backward (ZeRO-2)."""

    replicate: int
    shard: int
    reshard_after_forward: bool = True


def make_mesh(layout: ShardLayout, device: torch.device) -> DeviceMesh:
    """1-D over the world (FSDP), or (replicate, shard) for HSDP; its groups carry CPU tensors too
    (`pipeline.groups.group_backend`), whatever backend the script's world group has."""
    shape, names = ((layout.shard,), ("shard",)) if layout.replicate == 1 else \
        ((layout.replicate, layout.shard), ("replicate", "shard"))
    backend = group_backend()
    override = None if backend is None else {dim: backend for dim in range(len(shape))}
    return init_device_mesh(device.type, shape, mesh_dim_names=names, backend_override=override)


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The model's repeated blocks: modules of a class its `_no_split_modules` names (transformers' own list of
    blocks that must stay whole), outermost only; else our shardformer policy's layer list; else none (the root
    alone is one FSDP group)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers: List[nn.Module] = []
    if names:
        inside: set = set()
        for module in model.modules():
            if id(module) in inside:
                continue
            if type(module).__name__ in names and module is not model:
                layers.append(module)
                inside.update(id(m) for m in module.modules())
    if not layers:
        layers = _policy_layers(model)
    return [layer for layer in layers if not _shares_parameters(model, layer)]


def _policy_layers(model: nn.Module) -> List[nn.Module]:
    try:
        from shardformer import get_autopolicy
        policy = get_autopolicy(model)
        policy.set_model(model)
        return list(policy.layer_list())
    except Exception:  # no policy for this model: the root alone
        return []


def _shares_parameters(model: nn.Module, layer: nn.Module) -> bool:
    """A layer whose parameter is also reached outside it (a tie) cannot be its own FSDP group."""
    inner = {id(p) for p in layer.parameters()}
    inside = {id(m) for m in layer.modules()}
    return any(id(p) in inner for m in model.modules() if id(m) not in inside
               for p in m.parameters(recurse=False))


def policy_targets(model: nn.Module, policy: Callable) -> List[nn.Module]:
    """The submodules an FSDP1 auto-wrap policy would wrap (the root excluded: it is always sharded last). A torch
    policy object (ModuleWrapPolicy, CustomPolicy) runs its own selection; a function policy
    `fn(module, recurse, nonwrapped_numel)` is asked for each module with recurse=False and the module's size."""
    if isinstance(policy, _Policy):
        chosen = policy._run_policy(model, set(), {})
        return [m for m in model.modules() if m in chosen and m is not model]
    return [m for m in model.modules() if m is not model and
            policy(module=m, recurse=False, nonwrapped_numel=sum(p.numel() for p in m.parameters()))]


def prepare_replicas(model: nn.Module, device: torch.device) -> nn.Module:
    """The model on `device` (lazily built meta tensors allocated and initialized by the model's own init), and
    rank 0's parameters and buffers broadcast to every rank (as DDP does), so every shard comes from one model."""
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        from shardformer.materialize import materialize
        materialize(model, device, Axis.alone("tp"), 0)
    model = model.to(device)
    if dist.get_world_size() > 1:
        _sync_module_states(model, world_group(), _BROADCAST_BUCKET, 0, set())
    return model


def shard_model(model: nn.Module, layers: List[nn.Module], mesh: DeviceMesh, layout: ShardLayout,
                mp_policy: MixedPrecisionPolicy, root_mp_policy: MixedPrecisionPolicy,
                offload_policy: Optional[OffloadPolicy] = None) -> None:
    """fully_shard each of `layers` (bottom-up: a nested one first), then the root, which takes every parameter
    left (embeddings, final norm, head; tied weights stay together there)."""
    offload = offload_policy or OffloadPolicy()
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    for layer in sorted(layers, key=lambda m: -depth.get(id(m), 0)):
        fully_shard(layer, mesh=mesh, reshard_after_forward=layout.reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=layout.reshard_after_forward, mp_policy=root_mp_policy,
                offload_policy=offload)


def parameter_names(model: nn.Module) -> Dict[int, str]:
    """{id(parameter): its name}, taken before sharding."""
    return {id(p): name for name, p in model.named_parameters()}


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: Dict[int, str], model: nn.Module) -> None:
    """Point `optimizer`'s param groups at the sharded parameters that replaced theirs (matched by name)."""
    if optimizer.state:
        raise ValueError("The optimizer already has state (it stepped before boost): boost the model and optimizer "
                         "before training, or load the state afterwards with booster.load_optimizer.")
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        unknown = [i for i, p in enumerate(group["params"]) if names.get(id(p)) not in sharded]
        if unknown:
            raise ValueError(f"The optimizer holds {len(unknown)} tensors that are not parameters of the model: build "
                             f"it over model.parameters() (or groups of them) before boosting.")
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]

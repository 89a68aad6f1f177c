"""Sharding metadata attached to tensor-parallel parameters, and the shard / unshard helpers checkpoints use."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .comm import get_tp_world_size

__all__ = ["TPSpec", "set_tp_spec", "get_tp_spec", "padded_size", "shard_tensor", "gather_tensor", "shard_parameter",
           "UnshardedStateDict"]


@dataclass
class TPSpec:
    """How a parameter is split over its tensor-parallel group.

    dim: the split dimension. n_fused: number of equal fused areas along `dim` (3 for GPT-2's q,k,v), each split
    separately. full_size: unpadded global size along `dim` when the parameter carries padding (vocab padding), else
    None. padded: global size along `dim` after padding; None rounds full_size up to a multiple of the group size.
    """

    dim: int
    n_fused: int = 1
    full_size: int | None = None
    padded: int | None = None


def set_tp_spec(param: Tensor, spec: TPSpec) -> None:
    """Attach `spec` to `param` (as `param._tp_spec`)."""
    param._tp_spec = spec


def get_tp_spec(param: Tensor) -> TPSpec | None:
    """The TPSpec attached to `param`, or None for a replicated parameter."""
    return getattr(param, "_tp_spec", None)


def padded_size(size: int, world: int, multiple: int = 1) -> int:
    """Smallest size >= `size` divisible by `multiple * world`."""
    step = multiple * world
    return -(-size // step) * step


def _pad(full: Tensor, dim: int, target: int) -> Tensor:
    extra = target - full.size(dim)
    if extra < 0:
        raise ValueError(f"tensor has {full.size(dim)} entries along dim {dim}, more than the padded size {target}")
    if extra == 0:
        return full
    shape = list(full.shape)
    shape[dim] = extra
    return torch.cat([full, full.new_zeros(shape)], dim=dim)


def shard_tensor(full: Tensor, spec: TPSpec, rank: int, world: int) -> Tensor:
    """This rank's shard of the full (unpadded or padded) tensor: a new contiguous, detached tensor.

    Padding rows are zero. With n_fused > 1 each fused area is split on its own and the chunks are concatenated.
    """
    full = full.detach()
    dim = spec.dim % full.dim()
    if spec.full_size is not None:
        full = _pad(full, dim, spec.padded or padded_size(spec.full_size, world))
    size = full.size(dim)
    if size % (spec.n_fused * world):
        raise ValueError(f"size {size} along dim {dim} is not divisible by n_fused={spec.n_fused} * world={world}")
    area = size // spec.n_fused
    step = area // world
    return torch.cat([full.narrow(dim, a * area + rank * step, step) for a in range(spec.n_fused)], dim=dim)


def gather_tensor(local: Tensor, spec: TPSpec, group: ProcessGroup | None) -> Tensor:
    """Reassemble the full, unpadded tensor from every rank's shard (inverse of shard_tensor)."""
    local = local.detach().contiguous()
    dim = spec.dim % local.dim()
    world = get_tp_world_size(group)
    if world == 1:
        parts = [local]
    else:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=group)
    step = local.size(dim) // spec.n_fused
    full = torch.cat([p.narrow(dim, a * step, step) for a in range(spec.n_fused) for p in parts], dim=dim)
    if spec.full_size is not None:
        full = full.narrow(dim, 0, spec.full_size).contiguous()
    return full


def shard_parameter(param: Tensor, spec: TPSpec | None, rank: int, world: int) -> nn.Parameter:
    """A fresh Parameter holding this rank's shard of `param` (a full copy when `spec` is None), spec attached."""
    data = param.detach().clone() if spec is None else shard_tensor(param, spec, rank, world)
    out = nn.Parameter(data.contiguous(), requires_grad=param.requires_grad)
    if spec is not None:
        set_tp_spec(out, spec)
    return out


class UnshardedStateDict:
    """Mixin for parallel layers: `unsharded_state_dict()` gives the native module's full tensors (padding
    stripped, fused areas reassembled). Collective over the layer's `tp_group`."""

    def unsharded_state_dict(self) -> dict:
        full = {}
        for name, tensor in self.state_dict(keep_vars=True).items():
            spec = get_tp_spec(tensor)
            full[name] = tensor.detach() if spec is None else gather_tensor(tensor.detach(), spec, self.tp_group)
        return full

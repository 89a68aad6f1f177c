"""Sharding metadata of tensor-parallel parameters (a registry keyed by tensor identity), and the shard / unshard
helpers checkpoints use."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, List, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .comm import get_tp_world_size
from .tensor_registry import tensor_registry

__all__ = ["TPSpec", "set_tp_spec", "get_tp_spec", "copy_tp_spec", "padded_size", "ShardRange", "shard_ranges",
           "shard_from", "fill_shard", "shard_tensor", "zero_padding", "unshard", "gather_tensor", "shard_parameter",
           "UnshardedStateDict"]


@dataclass
class TPSpec:
    """How a parameter is split over its tensor-parallel group.

    dim: the split dimension. n_fused: number of equal fused areas along `dim` (3 for GPT-2's q,k,v), each split
    separately. full_size: unpadded global size along `dim` when the parameter carries padding (vocab padding), else
    None. padded: global size along `dim` after padding; None rounds full_size up to a multiple of the group size.
    group: the process group it is split over (None: the default group).
    """

    dim: int
    n_fused: int = 1
    full_size: int | None = None
    padded: int | None = None
    # the tensor-parallel group it is split over (None: the default group, as the layers read None); a process-wide
    # handle: copies of the spec share it
    group: ProcessGroup | None = field(default=None, compare=False, repr=False)

    def __deepcopy__(self, memo: dict) -> "TPSpec":
        return replace(self)


# tensor -> its TPSpec (layer/tensor_registry.py: nothing is written onto torch's parameters)
_SPECS = tensor_registry()


def set_tp_spec(param: Tensor, spec: TPSpec | None) -> None:
    """Record that `param` is split as `spec` (None: replicated)."""
    if spec is None:
        _SPECS.pop(param, None)
    else:
        _SPECS[param] = spec


def get_tp_spec(param: Tensor) -> TPSpec | None:
    """The TPSpec recorded for `param`, or None for a replicated parameter."""
    return _SPECS.get(param)


def copy_tp_spec(src: Tensor, dst: Tensor) -> None:
    """Give `dst` (a stand-in, master or re-created copy of `src`) the split recorded for `src`, if any."""
    set_tp_spec(dst, get_tp_spec(src))


def padded_size(size: int, world: int, multiple: int = 1) -> int:
    """Smallest size >= `size` divisible by `multiple * world`."""
    step = multiple * world
    return -(-size // step) * step


class ShardRange(NamedTuple):
    """Entries [start, stop) of the full tensor along the split dim that a rank holds in one fused area, followed
    in its shard by `padding` zero entries (vocab padding)."""

    start: int
    stop: int
    padding: int


def shard_ranges(spec: TPSpec, size: int, rank: int, world: int) -> List[ShardRange]:
    """What `rank` of `world` holds of a full tensor with `size` entries along `spec.dim` (unpadded, or already
    padded), one ShardRange per fused area. The one definition of the shard / padding layout."""
    total = size
    if spec.full_size is not None:
        total = spec.padded or padded_size(spec.full_size, world)
        if size > total:
            raise ValueError(f"tensor has {size} entries along dim {spec.dim}, more than the padded size {total}")
    if total % (spec.n_fused * world):
        raise ValueError(f"size {total} along dim {spec.dim} is not divisible by n_fused={spec.n_fused} * "
                         f"world={world}")
    area = total // spec.n_fused
    step = area // world
    out = []
    for a in range(spec.n_fused):
        lo = a * area + rank * step
        start, stop = min(lo, size), min(lo + step, size)
        out.append(ShardRange(start, stop, step - (stop - start)))
    return out


def shard_from(read: Callable[[int, int], Tensor], size: int, dim: int, spec: TPSpec, rank: int,
               world: int) -> Tensor:
    """This rank's shard, built from `read(start, stop)` (entries [start, stop) of the full tensor along `dim`,
    which has `size` of them) and zero padding: a new contiguous tensor."""
    parts = []
    for r in shard_ranges(spec, size, rank, world):
        part = read(r.start, r.stop)
        parts.append(part)
        if r.padding:
            shape = list(part.shape)
            shape[dim] = r.padding
            parts.append(part.new_zeros(shape))
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def fill_shard(dst: Tensor, read: Callable[[int, int], Tensor], size: int, dim: int, spec: TPSpec | None, rank: int,
               world: int) -> None:
    """Copy this rank's shard, as `shard_from` lays it out, into `dst` (the shard's shape; any dtype and device)
    without building it first: each range `read(start, stop)` returns (entries of the full tensor along `dim`, which
    has `size` of them) goes straight into its place, padding is zeroed. `spec` None: the whole tensor."""
    if spec is None:
        dst.copy_(read(0, size))
        return
    step = dst.size(dim) // spec.n_fused
    for area, r in enumerate(shard_ranges(spec, size, rank, world)):
        block = dst.narrow(dim, area * step, step)
        if r.stop > r.start:
            block.narrow(dim, 0, r.stop - r.start).copy_(read(r.start, r.stop))
        if r.padding:
            block.narrow(dim, r.stop - r.start, r.padding).zero_()


def shard_tensor(full: Tensor, spec: TPSpec, rank: int, world: int) -> Tensor:
    """This rank's shard of the full (unpadded or padded) tensor: a new contiguous, detached tensor.

    Padding rows are zero. With n_fused > 1 each fused area is split on its own and the chunks are concatenated.
    """
    full = full.detach()
    dim = spec.dim % full.dim()
    return shard_from(lambda lo, hi: full.narrow(dim, lo, hi - lo), full.size(dim), dim, spec, rank, world)


@torch.no_grad()
def zero_padding(shard: Tensor, spec: TPSpec | None, rank: int, world: int) -> None:
    """Zero the padding entries of `rank`'s shard in place (e.g. after a fresh init), as `shard_tensor` makes them."""
    if spec is None or spec.full_size is None:
        return
    dim = spec.dim % shard.dim()
    step = shard.size(dim) // spec.n_fused
    for area, r in enumerate(shard_ranges(spec, spec.full_size, rank, world)):
        if r.padding:
            shard.narrow(dim, (area + 1) * step - r.padding, r.padding).zero_()


def unshard(parts: Sequence[Tensor], spec: TPSpec) -> Tensor:
    """The full, unpadded tensor from every rank's shard, in rank order (inverse of shard_tensor)."""
    dim = spec.dim % parts[0].dim()
    step = parts[0].size(dim) // spec.n_fused
    full = torch.cat([p.narrow(dim, a * step, step) for a in range(spec.n_fused) for p in parts], dim=dim)
    if spec.full_size is not None:
        full = full.narrow(dim, 0, spec.full_size)
    return full.contiguous()


def gather_tensor(local: Tensor, spec: TPSpec, group: ProcessGroup | None) -> Tensor:
    """Reassemble the full, unpadded tensor from every rank's shard (inverse of shard_tensor)."""
    local = local.detach().contiguous()
    world = get_tp_world_size(group)
    if world == 1:
        return unshard([local], spec)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    return unshard(parts, spec)


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

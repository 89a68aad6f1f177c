"""Data-parallel gradient buckets: gradients of a group of parameters in one flat buffer, reduced by one collective
(all-reduce, or ZeRO-2's reduce-scatter) launched as soon as the group's last gradient is accumulated."""
from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardformer.layer.comm import reduce_scatter_tensor

BUCKET_BYTES = 25 * 1024 * 1024


class ReduceAxis(NamedTuple):
    """The ranks a bucket's gradients are reduced over and how they are averaged: dense parameters over dp (divisor
    dp); expert parameters over moe_dp, the replicas holding the same experts, with divisor dp too (each rank's
    expert gradients already sum the tokens of its whole ep group)."""
    group: dist.ProcessGroup
    size: int     # ranks in `group` (ZeRO: the slices)
    rank: int     # this rank's place in `group` (ZeRO: the slice it owns)
    divisor: int  # the reduced sum is divided by it


def make_buckets(params: Iterable[nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> List[List[nn.Parameter]]:
    """Group parameters (same dtype and device) into buckets of about `bucket_bytes`, for one collective each."""
    buckets: List[List[nn.Parameter]] = []
    open_buckets: Dict[tuple, List[nn.Parameter]] = {}
    sizes: Dict[tuple, int] = {}
    for p in params:
        key = (p.dtype, p.device)
        bucket = open_buckets.setdefault(key, [])
        bucket.append(p)
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        if sizes[key] >= bucket_bytes:
            buckets.append(open_buckets.pop(key))
            sizes[key] = 0
    buckets.extend(b for b in open_buckets.values() if b)
    return buckets


@torch.no_grad()
def broadcast_params(params: List[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Copy the group's first rank's values of `params` to every rank of it, one broadcast per bucket."""
    src = dist.get_global_rank(group, 0)
    for bucket in make_buckets(params):
        flat = _flatten_dense_tensors([p.data for p in bucket])
        dist.broadcast(flat, src=src, group=group)
        for p, synced in zip(bucket, _unflatten_dense_tensors(flat, [p.data for p in bucket])):
            p.data.copy_(synced)


class GradBucket:
    """Gradients of a group of parameters in one flat buffer: one reduction, launched as soon as the last of them
    is accumulated in the step's final backward pass, so the reduction overlaps the rest of the backward.

    With ZeRO (`zero`) the gradient area is padded to a multiple of the axis size and its rank r owns the r-th of
    those equal slices. `scatter` (ZeRO-2): the buffer lives only while its reduction runs; the reduction is a
    reduce-scatter into `shard` (this rank's slice), and the full gradients are released."""

    def __init__(self, params: List[nn.Parameter], axis: ReduceAxis, zero: bool = False,
                 scatter: bool = False) -> None:
        self.params = params
        self.axis = axis
        shards = axis.size if zero else 1
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.padded = -(-self.offsets[-1] // shards) * shards
        self.shard_numel = self.padded // shards
        self.scatter = scatter
        self.dtype, self.device = params[0].dtype, params[0].device
        # after the gradients, one flag per parameter: did any replica produce a gradient for it?
        self.buffer: Optional[torch.Tensor] = None if scatter else self._new_buffer()
        self.shard: Optional[torch.Tensor] = None  # ZeRO-2: this rank's slice of the averaged gradients
        self.used: List[bool] = [False] * len(params)
        self.ready: set = set()
        self.work: List[dist.Work] = []
        # ZeRO-2, accumulation without no_sync: the averaged slice of this step's earlier reductions, added to the
        # next one's (as ColossalAI's ZeRO-2 adds each reduction into its partitioned gradient store)
        self.carried: Optional[torch.Tensor] = None
        self.carried_used: List[bool] = []

    def _new_buffer(self) -> torch.Tensor:
        return torch.zeros(self.padded + len(self.params), dtype=self.dtype, device=self.device)

    @property
    def has_grad(self) -> torch.Tensor:
        return self.buffer[self.padded:]

    def view(self, i: int) -> torch.Tensor:
        return self.buffer[self.offsets[i]:self.offsets[i + 1]].view_as(self.params[i])

    @property
    def launched(self) -> bool:
        return bool(self.work)

    @torch.no_grad()
    def launch(self) -> None:
        group = self.axis.group
        if self.scatter:
            self.buffer = self._new_buffer()
        for i, p in enumerate(self.params):
            self.has_grad[i] = p.grad is not None
            if p.grad is None:
                self.view(i).zero_()
            elif p.grad.data_ptr() != self.view(i).data_ptr():
                self.view(i).copy_(p.grad)
            if self.scatter:
                p.grad = None  # ZeRO-2: only this rank's slice is kept
        if self.scatter:
            self.shard = torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
            self.work = [reduce_scatter_tensor(self.shard, self.buffer[:self.padded], group=group, async_op=True),
                         dist.all_reduce(self.has_grad, group=group, async_op=True)]
        else:
            self.work = [dist.all_reduce(self.buffer, group=group, async_op=True)]

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the reduction; the gradients become views of the averaged buffer (None where no replica had
        one, so that the optimizer skips unused parameters as it would on one process)."""
        for work in self.work:
            work.wait()
        self.work = []
        self.ready.clear()
        self.used = [flag > 0 for flag in self.has_grad.tolist()]
        if self.scatter:
            self.shard.div_(self.axis.divisor)
            self.buffer = None
            return
        self.buffer[:self.padded].div_(self.axis.divisor)
        for i, p in enumerate(self.params):
            p.grad = self.view(i) if self.used[i] else None

    @torch.no_grad()
    def adopt_grads(self) -> None:
        """ZeRO, before the step reads its slice: take the script's changes to `p.grad` since the reduction (in-place
        changes already live in the buffer; a replaced gradient is copied into it, a removed one is unused).
        ZeRO-2 keeps no `p.grad`, so a gradient set on a parameter could not be applied: refused."""
        for i, p in enumerate(self.params):
            if self.scatter and p.grad is not None:
                raise RuntimeError("zero_stage=2 partitions the gradients over data parallel: `p.grad` is None after "
                                   "the backward, and a gradient set on a parameter cannot be applied. Use "
                                   "zero_stage=1 (or 0) to change gradients before optimizer.step(), or the "
                                   "plugin's max_norm for clipping.")
            if self.scatter:
                continue
            self.used[i] = p.grad is not None
            if p.grad is not None and p.grad.data_ptr() != self.view(i).data_ptr():
                self.view(i).copy_(p.grad)

    def shard_grad(self) -> torch.Tensor:
        """ZeRO: the averaged gradients of the slice this rank owns."""
        if self.scatter:
            return self.shard
        rank = self.axis.rank
        return self.buffer[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    def carry(self) -> None:
        """ZeRO-2: a further backward accumulates into reduced gradients; keep their slice aside for add_carried
        (ZeRO-0/1 need nothing: `p.grad` keeps the average, identical on every replica, and reducing `average +
        local` again gives `average + mean(local)`, as torch DDP)."""
        if self.scatter and self.shard is not None:
            self.carried, self.carried_used, self.shard = self.shard, self.used, None

    def add_carried(self) -> None:
        """ZeRO-2, after this reduction: add the carried slice of the step's earlier backwards."""
        if self.carried is not None:
            self.shard.add_(self.carried)
            self.used = [a or b for a, b in zip(self.used, self.carried_used)]
            self.carried = None

    def reset(self) -> None:
        """Drop a launched reduction and the gradients of a discarded step."""
        for work in self.work:
            work.wait()
        self.work = []
        self.ready.clear()
        self.carried = None
        if self.scatter:
            self.buffer = self.shard = None

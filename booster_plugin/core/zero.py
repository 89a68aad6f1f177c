"""ZeRO-1/2 over the data-parallel group: optimizer state and fp32 master weights partitioned; with ZeRO-2 also
the gradients (reduce-scattered into the owner's slice).

Partition: the model's gradient buckets (HybridParallelModule, one flat buffer each) are padded to a multiple of
dp and dp rank r owns the r-th slice of each bucket, so every rank holds exactly 1/dp of the elements (up to the
padding of the last element group). A parameter that crosses a slice boundary is split between ranks: each rank
steps a 1-D `Segment.master` of its part. The user's optimizer steps those segments, which is exact for optimizers
that act element by element (ELEMENTWISE_OPTIMIZERS; others are refused). A segment with no gradient on any
replica gets none, so the optimizer skips it as it would skip the whole parameter on one process.

After the step every bucket's slices are all-gathered (`all_gather_into_tensor`) into the model parameters.
ZeRO-1 reads its slice of the all-reduced bucket; ZeRO-2 gets it from `reduce_scatter_tensor` (GradBucket).
(Both through shardformer.layer.comm, which takes torch's newer names `all_gather_single` /
`reduce_scatter_single` where torch has them.)
Reused from torch: those two collectives on flat buffers, and ZeroRedundancyOptimizer's idea of wrapping the
user's optimizer over a local partition (here: element slices of buckets instead of whole parameters, so that the
per-rank bytes are ÷dp exactly and ZeRO-2's reduce-scatter lines up with the partition).
"""
from __future__ import annotations

import collections
import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardformer.layer.comm import all_gather_tensor
from shardformer.layer.spec import copy_tp_spec

from .optimizer import HybridParallelOptimizer
from .grad_bucket import GradBucket

ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)
_UPDATE_METHODS = ("step", "_init_group")  # where an optimizer reads its gradients and computes its update


def check_zero_optimizer(optimizer: torch.optim.Optimizer, zero_stage: int) -> None:
    """Refuse an optimizer whose update is not element-wise (it cannot step a slice of a parameter): one of
    ELEMENTWISE_OPTIMIZERS, or a subclass that keeps its update (overrides neither `step` nor `_init_group`, e.g.
    only its constructor). Depends on the optimizer's class alone, so every rank decides alike."""
    cls = type(optimizer)
    base = next((c for c in cls.__mro__ if c in ELEMENTWISE_OPTIMIZERS), None)
    if base is None:
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(f"zero_stage={zero_stage} partitions parameters element-wise over data parallel; "
                        f"{cls.__name__} is not one of the element-wise optimizers ({names}) nor a subclass of one. "
                        f"Use one of them or zero_stage=0.")
    # (torch wraps `step` in a profiling hook per class, so compare the functions underneath)
    overridden = [name for name in _UPDATE_METHODS
                  if inspect.unwrap(getattr(cls, name)) is not inspect.unwrap(getattr(base, name))]
    if overridden:
        raise TypeError(f"zero_stage={zero_stage} steps each dp rank's slice of a parameter, which is exact only for "
                        f"an element-wise update; {cls.__name__} subclasses {base.__name__} but overrides "
                        f"{' and '.join(overridden)}, so its update may mix elements of a parameter (e.g. a per-tensor "
                        f"mean or norm) and would train differently under ZeRO. Use zero_stage=0, or {base.__name__} "
                        f"itself (a subclass that changes only its constructor is accepted).")


@dataclass
class Segment:
    """The part of one model parameter that this dp rank owns and steps."""
    param: nn.Parameter
    bucket: GradBucket
    index: int  # of the parameter in the bucket
    start: int  # first owned element of the flattened parameter
    shard_offset: int  # where the owned elements lie in the bucket's slice
    master: nn.Parameter  # 1-D; a view of the parameter when the dtypes agree (fp32), else an fp32 copy

    @property
    def numel(self) -> int:
        return self.master.numel()


class ZeroOptimizer(HybridParallelOptimizer):
    """HybridParallelOptimizer whose stepped parameters are this dp rank's segments."""

    def _init_weights(self, master_dtype: Optional[torch.dtype]) -> None:
        self.master_of = {}  # (full master weights exist nowhere; checkpoint_io reads segments through this class)
        self._pairs = []
        model = self.model
        self.segments: Dict[int, Segment] = {}
        for bucket in model.buckets:  # (expert buckets are partitioned over moe_dp: ReduceAxis)
            rank = bucket.axis.rank
            lo, hi = rank * bucket.shard_numel, (rank + 1) * bucket.shard_numel
            for i, p in enumerate(bucket.params):
                a, b = max(lo, bucket.offsets[i]), min(hi, bucket.offsets[i + 1])
                if a >= b:
                    continue
                if not p.is_contiguous():
                    raise ValueError("ZeRO needs contiguous parameters; a boosted parameter is not contiguous.")
                flat = p.detach().view(-1)[a - bucket.offsets[i]:b - bucket.offsets[i]]
                if master_dtype is not None and master_dtype != p.dtype:
                    flat = flat.to(master_dtype).clone()
                master = nn.Parameter(flat, requires_grad=p.requires_grad)
                self.segments[id(p)] = Segment(p, bucket, i, a - bucket.offsets[i], a - lo, master)
        self._mixed = master_dtype is not None
        self._group_params = [list(group["params"]) for group in self.optim.param_groups]  # model parameters
        for group in self.optim.param_groups:
            group["params"] = [self.segments[id(p)].master for p in group["params"] if id(p) in self.segments]
        self._stand_ins: Optional[Dict[int, nn.Parameter]] = None  # set inside unpartitioned()

    def named_parameters(self):
        """(model parameter name, this rank's segment of it) for the parameters this rank owns a part of; inside
        `unpartitioned()`: (name, the whole parameter the view steps)."""
        for name, p in self.model.unwrap().named_parameters():
            if self._stand_ins is not None and id(p) in self._stand_ins:
                yield name, self._stand_ins[id(p)]
            elif self._stand_ins is None and id(p) in self.segments:
                yield name, self.segments[id(p)].master

    def load_master_weight(self, param: nn.Parameter, value: torch.Tensor) -> None:
        seg = self.segments.get(id(param))
        if seg is not None and self._mixed:
            seg.master.copy_(value.reshape(-1)[seg.start:seg.start + seg.numel])

    def _master_grads(self) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        for bucket in self.model.buckets:
            bucket.adopt_grads()
        out = []
        for seg in self.segments.values():
            seg.master.grad = None
            if seg.bucket.used[seg.index]:
                g = seg.bucket.shard_grad()[seg.shard_offset:seg.shard_offset + seg.numel]
                seg.master.grad = g if g.dtype == seg.master.dtype else g.to(seg.master.dtype)
                out.append((seg.param, seg.master.grad))
        return out

    def _norm_groups(self) -> Tuple[Optional[dist.ProcessGroup], ...]:
        return self.model.dp_group, self.model.tp_group, self.model.pp_group

    def _expert_norm_groups(self) -> Tuple[Optional[dist.ProcessGroup], ...]:
        # expert slices are partitioned over moe_dp and differ over ep: dp (moe_dp x ep) holds each element once
        return self._norm_groups()

    def _gather_buckets(self, values: Dict[int, Optional[torch.Tensor]], dtype: Optional[torch.dtype]):
        """Yield (bucket, flat) where flat is the bucket's elements all-gathered from the slices of its ranks,
        each rank giving `values[id(param)]` (1-D, its segment; None: zeros), in `dtype` (None: the bucket's).
        Collective over each bucket's group (dp; moe_dp for expert parameters)."""
        for bucket in self.model.buckets:
            kind = dtype or bucket.dtype
            shard = torch.zeros(bucket.shard_numel, dtype=kind, device=bucket.device)
            for p in bucket.params:
                seg = self.segments.get(id(p))
                if seg is not None and values.get(id(p)) is not None:
                    shard[seg.shard_offset:seg.shard_offset + seg.numel] = values[id(p)]
            flat = torch.empty(bucket.padded, dtype=kind, device=bucket.device)
            all_gather_tensor(flat, shard, group=bucket.axis.group)
            yield bucket, flat

    @torch.no_grad()
    def _publish(self) -> None:
        masters = {pid: seg.master.detach() for pid, seg in self.segments.items()}
        for bucket, flat in self._gather_buckets(masters, None):
            for i, p in enumerate(bucket.params):
                p.copy_(flat[bucket.offsets[i]:bucket.offsets[i + 1]].view_as(p))

    @torch.no_grad()
    def gathered_grads(self) -> Dict[int, Optional[torch.Tensor]]:
        """{id(model parameter): its whole (this tp/pp rank's) stepped gradient, or None}. Collective over dp;
        for inspection (tests): ZeRO keeps only this rank's slice."""
        grads = {pid: seg.master.grad for pid, seg in self.segments.items()}
        out: Dict[int, Optional[torch.Tensor]] = {}
        for bucket, flat in self._gather_buckets(grads, torch.float32):
            for i, p in enumerate(bucket.params):
                used = bucket.used[i]
                out[id(p)] = flat[bucket.offsets[i]:bucket.offsets[i + 1]].view_as(p).clone() if used else None
        return out

    # -- checkpoints: the state as if unpartitioned --------------------------------------------------------------
    def _gather_state(self) -> Dict[int, Dict[str, Any]]:
        """{id(model parameter): its optimizer state with whole tensors (+ "master" with mixed precision)}, on
        every dp rank. Collective over dp (object all-gather of the small per-parameter metadata)."""
        names = {id(p): n for n, p in self.model.unwrap().named_parameters()}
        local: Dict[str, Dict[str, Any]] = {}
        for pid, seg in self.segments.items():
            state = self.optim.state.get(seg.master, {})
            local[names[pid]] = {"tensors": sorted(k for k, v in state.items() if _is_shard(v, seg)),
                                 "scalars": {k: v for k, v in state.items() if not _is_shard(v, seg)}}
        metas: List[Dict[str, Dict[str, Any]]] = [{} for _ in range(self.model.dp_size)]
        dist.all_gather_object(metas, local, group=self.model.dp_group)
        state_of: Dict[int, Dict[str, Any]] = {}
        keys = set()
        for bucket in self.model.buckets:
            for p in bucket.params:
                found = [m[names[id(p)]] for m in metas if names[id(p)] in m]
                state_of[id(p)] = dict(found[0]["scalars"]) if found else {}
                tensors = {k for f in found for k in f["tensors"]}
                keys |= tensors
                state_of[id(p)]["_tensors"] = tensors
        for key in sorted(keys) + (["master"] if self._mixed else []):
            values = {pid: (seg.master.detach() if key == "master" else self.optim.state.get(seg.master, {}).get(key))
                      for pid, seg in self.segments.items()}
            for bucket, flat in self._gather_buckets(values, torch.float32):
                for i, p in enumerate(bucket.params):
                    if key == "master" or key in state_of[id(p)]["_tensors"]:
                        state_of[id(p)][key] = flat[bucket.offsets[i]:bucket.offsets[i + 1]].view_as(p).clone()
        for state in state_of.values():
            del state["_tensors"]
        return state_of

    @contextlib.contextmanager
    def unpartitioned(self, load: bool = False) -> Iterator[None]:
        """Inside, the inner optimizer looks unpartitioned to checkpoint_io: its param groups hold this (tp, pp)
        rank's whole parameters (fp32 masters with mixed precision) and its state whole tensors. With `load`, the
        state and master weights found there on exit are partitioned back. Collective over dp."""
        full = self._gather_state()
        stand_ins: Dict[int, nn.Parameter] = {}
        for group in self._group_params:
            for p in group:
                if id(p) in full and self._mixed:
                    stand_in = nn.Parameter(full[id(p)].pop("master"), requires_grad=p.requires_grad)
                    copy_tp_spec(p, stand_in)
                    stand_ins[id(p)] = stand_in
                elif id(p) in full:
                    stand_ins[id(p)] = p
        saved_params = [group["params"] for group in self.optim.param_groups]
        saved_state, saved_masters = self.optim.state, self.master_of
        self.optim.state = {stand_ins[pid]: state for pid, state in full.items() if state and pid in stand_ins}
        for group, params in zip(self.optim.param_groups, self._group_params):
            group["params"] = [stand_ins[id(p)] for p in params if id(p) in stand_ins]
        self.master_of = {pid: m for pid, m in stand_ins.items() if self._mixed}
        self._stand_ins = stand_ins
        try:
            yield
            if load:
                saved_state = collections.defaultdict(dict, self._partition(stand_ins))
        finally:
            for group, params in zip(self.optim.param_groups, saved_params):
                group["params"] = params
            self.optim.state, self.master_of, self._stand_ins = saved_state, saved_masters, None

    @torch.no_grad()
    def _partition(self, stand_ins: Dict[int, nn.Parameter]) -> Dict[nn.Parameter, Dict[str, Any]]:
        """This rank's slices of the whole state (and masters) found in the unpartitioned view."""
        state: Dict[nn.Parameter, Dict[str, Any]] = {}
        for pid, seg in self.segments.items():
            stand_in = stand_ins[pid]
            if self._mixed:
                seg.master.copy_(stand_in.detach().reshape(-1)[seg.start:seg.start + seg.numel])
            whole = self.optim.state.get(stand_in, {})
            if whole:
                state[seg.master] = {k: v.reshape(-1)[seg.start:seg.start + seg.numel].clone()
                                     if isinstance(v, torch.Tensor) and v.numel() == seg.param.numel() and v.dim() > 0
                                     else v for k, v in whole.items()}
        return state


def _is_shard(value: object, seg: Segment) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == seg.numel

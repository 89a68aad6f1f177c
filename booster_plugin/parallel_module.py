"""The boosted model: run a stage's forward, then reduce gradients across replicas in buckets (the optimizer side is
optimizer.py)."""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipeline.context import ParallelContext
from shardformer.layer.spec import get_tp_spec

from .failure import FailureGuard

if TYPE_CHECKING:
    from shardformer.policies import Policy

    from .batch_check import BatchLimits
    from .lora import LoRAState

BUCKET_BYTES = 25 * 1024 * 1024


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
def _broadcast_params(params: List[nn.Parameter], group: dist.ProcessGroup) -> None:
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

    With ZeRO (`shards` = dp size) the gradient area is padded to a multiple of `shards` and dp rank r owns the
    r-th of `shards` equal slices. `scatter` (ZeRO-2): the buffer lives only while its reduction runs; the
    reduction is a reduce-scatter into `shard` (this rank's slice), and the full gradients are released."""

    def __init__(self, params: List[nn.Parameter], shards: int = 1, scatter: bool = False) -> None:
        self.params = params
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
        self.work: List[Any] = []

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
    def launch(self, group: dist.ProcessGroup) -> None:
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
            self.work = [dist.reduce_scatter_single(self.shard, self.buffer[:self.padded], group=group, async_op=True),
                         dist.all_reduce(self.has_grad, group=group, async_op=True)]
        else:
            self.work = [dist.all_reduce(self.buffer, group=group, async_op=True)]

    @torch.no_grad()
    def finish(self, dp_size: int) -> None:
        """Wait for the reduction; the gradients become views of the averaged buffer (None where no replica had
        one, so that the optimizer skips unused parameters as it would on one process)."""
        for work in self.work:
            work.wait()
        self.work = []
        self.ready.clear()
        self.used = [flag > 0 for flag in self.has_grad.tolist()]
        if self.scatter:
            self.shard.div_(dp_size)
            self.buffer = None
            return
        self.buffer[:self.padded].div_(dp_size)
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

    def shard_grad(self, rank: int) -> torch.Tensor:
        """ZeRO: the averaged gradients of the slice dp rank `rank` (this rank) owns."""
        if self.scatter:
            return self.shard
        return self.buffer[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    def reset(self) -> None:
        """Drop a launched reduction and the gradients of a discarded step."""
        for work in self.work:
            work.wait()
        self.work = []
        self.ready.clear()
        if self.scatter:
            self.buffer = self.shard = None


class SharedParam(NamedTuple):
    """A parameter several pipeline stages hold (a tied embedding and LM head), as this stage holds it."""
    param: nn.Parameter
    group: dist.ProcessGroup  # the stages holding it
    owner: bool               # this stage is the first of them (it counts the parameter in norms, saves it)


@dataclass(frozen=True)
class ModelInfo:
    """What boost learnt of the unsharded model."""
    policy: "Policy"
    full_params: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]  # name -> (shape, dtype), tied names included
    batch_limits: "BatchLimits"  # the ids and labels it accepts
    lora: Optional["LoRAState"] = None


class HybridParallelModule(nn.Module):
    """Wraps the sharded HF model (`unwrap()` returns it); forward is the model's own, pruned to this stage."""

    def __init__(self, module: nn.Module, stage_forward, ctx: ParallelContext, info: ModelInfo,
                 shared_params: List[SharedParam], zero_stage: int = 0, bucket_bytes: int = BUCKET_BYTES,
                 failure_guard: Optional[FailureGuard] = None) -> None:
        super().__init__()
        self.failure_guard = failure_guard  # (pp == 1: the reduction at the end of a backward runs under it)
        self.module = module
        self._stage_forward = stage_forward
        self.ctx = ctx
        self.zero_stage = zero_stage
        self.info = info
        self.shared_params = shared_params
        # False while gradients accumulate (all but the last microbatch, booster.no_sync): no reduction launched
        self.require_grad_sync = True
        # True from the end of the reduction (sync_grads) until the gradients are stepped or zeroed: `p.grad` then
        # holds the averaged gradients, final as after one process's backward
        self._grads_synced = False
        self._sync_queued = False  # pp == 1: sync_grads is queued to run when the running backward pass ends
        self._buckets: List[GradBucket] = []
        if self.dp_size > 1:  # buckets in reverse order: the backward pass produces the last layers' grads first
            params = [p for p in module.parameters() if p.requires_grad]
            groups = make_buckets(reversed(params), bucket_bytes)
            if zero_stage > 0:  # a parameter shared by stages gets a bucket of its own: the same slices everywhere
                shared = {id(p) for p, _, _ in shared_params}
                groups = [[p] for p in params if id(p) in shared] + make_buckets(
                    (p for p in reversed(params) if id(p) not in shared), bucket_bytes)
            shards = self.dp_size if zero_stage > 0 else 1
            self._buckets = [GradBucket(b, shards, scatter=zero_stage == 2) for b in groups]
            for k, bucket in enumerate(self._buckets):
                for i, p in enumerate(bucket.params):
                    p.register_post_accumulate_grad_hook(self._grad_ready_hook(k, i))

    # -- what boost learnt of the model -----------------------------------------------------------------------------
    @property
    def policy(self) -> "Policy":
        return self.info.policy

    @property
    def full_params(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        return self.info.full_params

    @property
    def batch_limits(self) -> "BatchLimits":
        return self.info.batch_limits

    @property
    def lora(self) -> Optional["LoRAState"]:
        """The LoRA adapters' state (the PeftModel, ...) when boosted with LoRA; None otherwise."""
        return self.info.lora

    # -- this rank's place in the mesh (the groups: None where the axis has one rank) ------------------------------
    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        return self.ctx.dp.active

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        return self.ctx.tp.active

    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        return self.ctx.pp.active

    @property
    def dp_size(self) -> int:
        return self.ctx.dp.size

    @property
    def dp_rank(self) -> int:
        return self.ctx.dp.rank

    @property
    def stage(self) -> int:
        return self.ctx.pp.rank

    @property
    def num_stages(self) -> int:
        return self.ctx.pp.size

    def _grad_ready_hook(self, bucket_index: int, index: int):
        # The hook lives on the parameter and reaches this module (and so the parameter) only through a weak
        # reference: the garbage collector cannot see through tensor hooks, so a strong one would keep every boosted
        # model, its process groups and their threads alive for the life of the process.
        owner = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            module = owner()
            if module is None:
                return
            bucket = module._buckets[bucket_index]
            if module._grads_synced or bucket.launched:
                raise RuntimeError("A second backward pass reached gradients whose data-parallel reduction already "
                                   "started. To accumulate gradients, run all but the last backward inside "
                                   "`with booster.no_sync(model):`, or call optimizer.step()/zero_grad() between.")
            if not module.require_grad_sync:
                return
            if module.pp_group is None and not module._sync_queued:  # with a pipeline, execute_pipeline ends it
                module._sync_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(module._sync_after_backward)
            bucket.ready.add(index)
            if len(bucket.ready) == len(bucket.params):
                bucket.launch(module.dp_group)
        return hook

    def _sync_after_backward(self) -> None:
        """End of a backward pass that launched reductions (pp == 1): finish them, so that `p.grad` holds the
        averaged gradients when `backward()` returns, as in one process and torch DDP (the engine's final
        callback, as DDP uses)."""
        self._sync_queued = False
        # waiting for the replicas: a failure another rank published (failure.py) stops this rank instead of hanging
        with self.failure_guard.step("backward") if self.failure_guard is not None else contextlib.nullcontext():
            self.sync_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops reductions launched for gradients that are now discarded (e.g. a skipped step)."""
        for bucket in self._buckets:
            bucket.reset()
        self._grads_synced = False
        super().zero_grad(set_to_none=set_to_none)

    def grads_stepped(self) -> None:
        """The optimizer stepped the synced gradients: a later backward accumulates into them and reduces again."""
        self._grads_synced = False

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        """The sharded transformers model; `unwrap_peft=False`: the PeftModel around it, for a LoRA model."""
        return self.module if unwrap_peft or self.lora is None else self.lora.peft_model

    @torch.no_grad()
    def full_outputs(self, outputs: Any, loss: Optional[torch.Tensor]) -> Any:
        """Merged pipeline outputs as one process returns them: vocab-parallel logits gathered over tp (padding
        stripped) whatever the train/eval mode, and `loss` the step's loss instead of one per microbatch.
        Collective over tp (the last stage's tp ranks all hold outputs)."""
        from shardformer.layer import ColumnParallelLinear

        if not isinstance(outputs, dict):
            return outputs
        heads = [m for m in self.module.modules() if isinstance(m, ColumnParallelLinear) and m.gather_output_in_eval]
        logits = outputs.get("logits")
        if heads and logits is not None and not heads[0].gathers_output:
            outputs["logits"] = heads[0].gather(logits)
        if outputs.get("loss") is not None:
            outputs["loss"] = loss if loss is not None else outputs["loss"].mean()
        return outputs

    def forward(self, *args, **kwargs) -> Any:
        if self._stage_forward is not None:
            return self._stage_forward(*args, **kwargs)
        return self.module(*args, **kwargs)

    # -- gradient reduction (called by the optimizer's step) ---------------------------------------------
    @property
    def grads_synced(self) -> bool:
        """Whether `p.grad` holds the final (averaged over dp, summed over sharing stages) gradients."""
        return self._grads_synced

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Average gradients over data parallel (buckets not launched during the backward pass are launched now,
        e.g. with unused parameters), then sum those of parameters shared by stages (tied embeddings). Runs at the
        end of the step's backward (pp == 1: the engine's final callback; pp > 1: the end of execute_pipeline), or
        at optimizer.step() after backward passes that were all inside no_sync; a no-op once done."""
        if self._grads_synced or not (self._buckets or self.shared_params):  # (nothing to reduce: as one process)
            return
        self._grads_synced = True
        self._sync_grads()

    def _sync_grads(self) -> None:
        for bucket in self._buckets:
            if not bucket.launched:
                bucket.launch(self.dp_group)
        for bucket in self._buckets:
            bucket.finish(self.dp_size)
        # a shared parameter no stage produced a gradient for (e.g. an unused image encoder) keeps none, so that the
        # optimizer skips it (no weight decay) as it would on one process
        shared = [s for s, used in zip(self.shared_params, self._shared_used()) if used]
        if self.zero_stage == 2:  # a shared parameter has a bucket of its own: its slices agree across stages
            for p, group, _ in shared:
                if not p.requires_grad:  # frozen (e.g. a tied embedding under LoRA): no gradient to sum
                    continue
                bucket = self.bucket_of(p)
                dist.all_reduce(bucket.shard_grad(self.dp_rank), group=group)
                bucket.used = [True]
            return
        for p, group, _ in shared:
            if not p.requires_grad:  # frozen (e.g. a tied embedding under LoRA): no gradient to sum
                continue
            if p.grad is None:  # (ZeRO-1: in the bucket, whose slices the optimizer reads)
                p.grad = self.bucket_of(p).view(0).zero_() if self.zero_stage else torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
            if self.zero_stage:
                self.bucket_of(p).used = [True]

    def _shared_used(self) -> List[bool]:
        """For each shared parameter: has any stage holding it (any dp replica) a gradient? One all-reduce of
        flags per group of stages, the groups in the order of their ranks (the same order on every rank)."""
        local = [bool(self.bucket_of(p).used[0]) if self.zero_stage == 2 else p.grad is not None
                 for p, _, _ in self.shared_params]
        by_group: Dict[tuple, List[int]] = {}
        for i, (_, group, _) in enumerate(self.shared_params):
            by_group.setdefault(tuple(dist.get_process_group_ranks(group)), []).append(i)
        for _, indices in sorted(by_group.items()):
            p, group, _ = self.shared_params[indices[0]]
            flags = torch.tensor([float(local[i]) for i in indices], device=p.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            for i, flag in zip(indices, flags.tolist()):
                local[i] = flag > 0
        return local

    @property
    def buckets(self) -> List[GradBucket]:
        return self._buckets

    def bucket_of(self, param: nn.Parameter) -> GradBucket:
        return next(b for b in self._buckets if any(q is param for q in b.params))

    @torch.no_grad()
    def sync_params(self) -> None:
        """Make replicas identical at start: tp rank 0's replicated parameters (norms, biases of row-parallel layers,
        position embeddings: a model built with another seed on each tp rank would otherwise train diverged copies),
        dp rank 0's parameters, and the first holder's shared parameters."""
        if self.tp_group is not None:
            _broadcast_params([p for p in self.module.parameters() if get_tp_spec(p) is None], self.tp_group)
        if self.dp_size > 1:
            _broadcast_params(list(self.module.parameters()), self.dp_group)
        for p, group, _ in self.shared_params:
            dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)

    def counts_in_norm(self, param: nn.Parameter) -> bool:
        """Whether this rank counts `param` in the global norm (each element of the whole model once)."""
        if any(p is param and not owner for p, _, owner in self.shared_params):
            return False
        return get_tp_spec(param) is not None or self.ctx.tp.rank == 0

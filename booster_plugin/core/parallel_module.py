"""The boosted model: run a stage's forward, then reduce gradients across replicas in buckets (grad_bucket.py) and
sum those of parameters shared by stages, so that `p.grad` is final when the backward returns (the optimizer side is
optimizer.py)."""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Dict, FrozenSet, List, NamedTuple, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pipeline.context import ParallelContext
from shardformer.layer.spec import get_tp_spec

from ..guards.failure import FailureGuard
from .grad_bucket import BUCKET_BYTES, GradBucket, ReduceAxis, broadcast_params, make_buckets
from .regional_compile import tracing_checkpoints
from .stage_calls import in_schedule

if TYPE_CHECKING:
    from shardformer.chunked_loss import ChunkedLoss
    from shardformer.policies import Policy
    from shardformer.sequence.loss import HeadOnShard
    from shardformer.stage.placement import StagePlacement

    from ..guards.batch_check import BatchLimits
    from .lora import LoRAState

Outputs = TypeVar("Outputs")  # a user model's outputs, passed through


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
    expert_params: FrozenSet[str] = frozenset()  # parameters holding this ep rank's experts only (split over ep)
    sequence_head: Optional["HeadOnShard"] = None  # sequence parallelism kept split through the LM head and loss
    chunked_loss: Optional["ChunkedLoss"] = None  # the causal-LM loss computed in chunks, without the full logits
    placement: Optional["StagePlacement"] = None  # the unsharded model's layers and parameters over the pipeline
    compiled_layers: bool = False  # decoder layers compiled: forward traces their checkpoints (regional_compile.py)


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
        # the user's switch: False while gradients accumulate (booster.no_sync): no reduction launched
        self.require_grad_sync = True
        # False during a pipeline's gradient actions other than the one that launches the reduction (launching)
        self._launch = True
        # True from the end of the reduction (sync_grads) until the gradients are stepped or zeroed: `p.grad` then
        # holds the averaged gradients, final as after one process's backward
        self._grads_synced = False
        self._sync_queued = False  # pp == 1: sync_grads is queued to run when the running backward pass ends
        self._carried_shared: List[Tuple[nn.Parameter, torch.Tensor]] = []  # reopen_grads: tied sums set aside
        self._forwards = 0  # pp == 1, dp > 1: forwards with gradients since the last reduction (replicas compare)
        self._buckets: List[GradBucket] = []
        if self.dp_size > 1:
            self._buckets = self._make_buckets(bucket_bytes)
            for k, bucket in enumerate(self._buckets):
                for i, p in enumerate(bucket.params):
                    p.register_post_accumulate_grad_hook(self._grad_ready_hook(k, i))

    def _make_buckets(self, bucket_bytes: int) -> List[GradBucket]:
        """Buckets in reverse order (the backward pass produces the last layers' gradients first): dense parameters
        reduced over dp, expert parameters (split over ep) over moe_dp, each averaged over dp (ReduceAxis)."""
        experts = self.expert_param_ids()
        params = [p for p in self.module.parameters() if p.requires_grad]
        shared = {id(p) for p, _, _ in self.shared_params} if self.zero_stage > 0 else set()
        dp, moe_dp = self.ctx.dp, self.ctx.moe_dp
        out = []
        for axis, mine in ((ReduceAxis(dp.group, dp.size, dp.rank, dp.size), lambda p: id(p) not in experts),
                           (ReduceAxis(moe_dp.group, moe_dp.size, moe_dp.rank, dp.size), lambda p: id(p) in experts)):
            # ZeRO: a parameter shared by stages gets a bucket of its own (the same slices everywhere)
            groups = [[p] for p in params if id(p) in shared and mine(p)] + make_buckets(
                (p for p in reversed(params) if id(p) not in shared and mine(p)), bucket_bytes)
            out += [GradBucket(b, axis, zero=self.zero_stage > 0, scatter=self.zero_stage == 2) for b in groups]
        return out

    def expert_param_ids(self) -> set:
        """ids of the parameters holding this ep rank's experts only (split over ep; empty without ep)."""
        names = self.info.expert_params
        return {id(p) for n, p in self.module.named_parameters() if n in names}

    # -- what boost learnt of the model -----------------------------------------------------------------------------
    @property
    def policy(self) -> "Policy":
        return self.info.policy

    @property
    def placement(self) -> "StagePlacement":
        """Where the unsharded model's layers and parameters live over the pipeline (decided at boost)."""
        return self.info.placement

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
            if module._grads_synced:  # accumulation without no_sync (pp == 1): this backward reduces its part too
                module.reopen_grads()
            if bucket.launched:
                raise RuntimeError("A backward pass reached gradients whose data-parallel reduction is still running "
                                   "(a gradient produced after its bucket was launched). Let the backward that "
                                   "launched it end (its reduction finishes there), or call optimizer.zero_grad().")
            if not (module.require_grad_sync and module._launch):
                return
            if module.pp_group is None and not module._sync_queued:  # with a pipeline, the schedule's REDUCE_GRAD ends it
                module._sync_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(module._sync_after_backward)
            bucket.ready.add(index)
            if len(bucket.ready) == len(bucket.params):
                bucket.launch()
        return hook

    def _sync_after_backward(self) -> None:
        """End of a backward pass that launched reductions (pp == 1): finish them, so that `p.grad` holds the
        averaged gradients when `backward()` returns, as in one process and torch DDP (the engine's final
        callback, as DDP uses)."""
        self._sync_queued = False
        self.sync_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops reductions launched for gradients that are now discarded (e.g. a skipped step)."""
        for bucket in self._buckets:
            bucket.reset()
        self._grads_synced = False
        self._carried_shared = []
        super().zero_grad(set_to_none=set_to_none)

    def reopen_grads(self) -> None:
        """A backward (pp == 1) or execute_pipeline reaches gradients already reduced, without optimizer.step() or
        zero_grad() between: gradient accumulation without no_sync, as torch DDP and ColossalAI allow. Its own
        reduction then adds the mean over dp of the new contributions: ZeRO-0/1 reduce `p.grad` (the average, equal
        on every replica, plus the new local part) again; ZeRO-2 keeps the reduced slices aside (carry); gradients
        summed over stages (tied weights) are set aside and added back after the next sum."""
        if not self._grads_synced:
            return
        self._grads_synced = False
        for bucket in self._buckets:
            bucket.carry()
        if self.zero_stage < 2:
            # (a copy: `p.grad` is a view of its bucket, which the next reduction overwrites)
            self._carried_shared = [(p, p.grad.clone()) for p, _, _ in self.shared_params if p.grad is not None]
            for p, _ in self._carried_shared:
                p.grad = None

    def grads_stepped(self) -> None:
        """The optimizer stepped the synced gradients: a later backward accumulates into them and reduces again."""
        self._grads_synced = False

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        """The sharded transformers model; `unwrap_peft=False`: the PeftModel around it, for a LoRA model."""
        return self.module if unwrap_peft or self.lora is None else self.lora.peft_model

    @torch.no_grad()
    def full_outputs(self, outputs: Outputs, loss: Optional[torch.Tensor]) -> Outputs:
        """Merged pipeline outputs as one process returns them: vocab-parallel logits gathered over tp (padding
        stripped) whatever the train/eval mode, logits of this rank's tokens (sequence kept split through the head)
        over sp, and `loss` the step's loss instead of one per microbatch. Collective over tp and sp (the last
        stage's ranks all hold outputs)."""
        from shardformer.layer import ColumnParallelLinear
        from shardformer.sequence.parallel import gather_tokens

        if not isinstance(outputs, dict):
            return outputs
        heads = [m for m in self.module.modules() if isinstance(m, ColumnParallelLinear) and m.gather_output_in_eval]
        logits = outputs.get("logits")
        split = self.info.sequence_head
        if split is not None and split.active and logits is not None:
            outputs["logits"] = logits = gather_tokens(logits, split.tokens)
        if heads and logits is not None and not heads[0].gathers_output:
            outputs["logits"] = heads[0].gather(logits)
        if outputs.get("loss") is not None:
            outputs["loss"] = loss if loss is not None else outputs["loss"].mean()
        return outputs

    def full_logits(self, asked: bool) -> ContextManager[None]:
        """Where `asked` (a caller that asks for the outputs), forwards inside compute the full logits even where the
        causal-LM loss is otherwise computed in chunks without them (shardformer/chunked_loss.py)."""
        chunked = self.info.chunked_loss
        return chunked.full_logits() if asked and chunked is not None else contextlib.nullcontext()

    def forward(self, *args, **kwargs) -> Any:
        if self._buckets and self.pp_group is None and torch.is_grad_enabled():
            self._forwards += 1
        with tracing_checkpoints() if self.info.compiled_layers else contextlib.nullcontext():
            if self._stage_forward is not None and in_schedule():  # else every rank's call: one pipelined forward
                return self._stage_forward(*args, **kwargs)
            return self.module(*args, **kwargs)

    # -- gradient reduction (called by the optimizer's step) ---------------------------------------------
    @property
    def grads_synced(self) -> bool:
        """Whether `p.grad` holds the final (averaged over dp, summed over sharing stages) gradients."""
        return self._grads_synced

    @contextlib.contextmanager
    def launching(self, launch: bool):
        """A pipeline's gradient action (pipeline/step.py): its backward launches the reduction only if it is the
        one the rank's REDUCE_GRAD names (and the user does not accumulate, booster.no_sync)."""
        self._launch = launch
        try:
            yield
        finally:
            self._launch = True

    def reduce_grad(self) -> None:
        """The pipeline's REDUCE_GRAD: `p.grad` final when execute_pipeline returns, as in one process."""
        if self.require_grad_sync:
            self.sync_grads()

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Average gradients over data parallel (buckets not launched during the backward pass are launched now,
        e.g. with unused parameters), then sum those of parameters shared by stages (tied embeddings). Runs at the
        end of the step's backward (pp == 1: the engine's final callback; pp > 1: the schedule's REDUCE_GRAD), or
        at optimizer.step() after backward passes that were all inside no_sync; a no-op once done."""
        if self._grads_synced or not (self._buckets or self.shared_params):  # (nothing to reduce: as one process)
            return
        if self._buckets and self.pp_group is None:
            self._check_replicas_in_step()  # (every rank raises alike: not a failure to publish)
        self._grads_synced = True
        # waiting for the replicas: a failure another rank published (guards/failure.py) stops this rank instead of hanging
        with self.failure_guard.step("gradient reduction") if self.failure_guard is not None else \
                contextlib.nullcontext():
            self._sync_grads()
        self._add_carried()

    def _add_carried(self) -> None:
        """Accumulation without no_sync: add what reopen_grads set aside to this reduction's gradients."""
        for bucket in self._buckets:
            bucket.add_carried()
        for p, grad in self._carried_shared:
            p.grad = grad if p.grad is None else p.grad.add_(grad)
            if self.zero_stage:
                self.bucket_of(p).used = [True]
        self._carried_shared = []

    def _sync_grads(self) -> None:
        for bucket in self._buckets:
            if not bucket.launched:
                bucket.launch()
        for bucket in self._buckets:
            bucket.finish()
        # a shared parameter no stage produced a gradient for (e.g. an unused image encoder) keeps none, so that the
        # optimizer skips it (no weight decay) as it would on one process
        shared = [s for s, used in zip(self.shared_params, self._shared_used()) if used]
        if self.zero_stage == 2:  # a shared parameter has a bucket of its own: its slices agree across stages
            for p, group, _ in shared:
                if not p.requires_grad:  # frozen (e.g. a tied embedding under LoRA): no gradient to sum
                    continue
                bucket = self.bucket_of(p)
                dist.all_reduce(bucket.shard_grad(), group=group)
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

    def _check_replicas_in_step(self) -> None:
        """pp == 1 (under a pipeline, execute_pipeline's failure guard ends a failed step everywhere): a forward that
        failed on one replica and was caught by the script would pair its next step's gradients with this step's on
        the others, silently. One small all-gather over dp of the forwards since the last reduction catches it."""
        mine = torch.tensor([self._forwards], dtype=torch.int64, device=self._buckets[0].device)
        self._forwards = 0
        counts = [torch.empty_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(counts, mine, group=self.dp_group)
        counts = [int(c) for c in counts]
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"Data-parallel replicas are out of step: since the last gradient reduction the dp ranks ran {counts} "
                f"forward passes with gradients. A forward that failed on some ranks and was caught by the script (or "
                f"one with gradients on some ranks only, e.g. an evaluation outside torch.no_grad()) pairs one "
                f"replica's gradients with another step's. This step's gradients are not used: call "
                f"optimizer.zero_grad(), and end the job or skip a failed step on every rank alike.")

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
        sp rank 0's parameters, dp rank 0's parameters (moe_dp rank 0's experts), and the first holder's shared
        parameters."""
        if self.tp_group is not None:
            broadcast_params([p for p in self.module.parameters() if get_tp_spec(p) is None], self.tp_group)
        if self.ctx.sp.size > 1:  # sequence-parallel ranks hold the same parameters
            broadcast_params(list(self.module.parameters()), self.ctx.sp.group)
        if self.dp_size > 1:  # expert parameters from the replica holding the same experts
            experts = self.expert_param_ids()
            broadcast_params([p for p in self.module.parameters() if id(p) not in experts], self.dp_group)
            if experts and self.ctx.moe_dp.size > 1:
                broadcast_params([p for p in self.module.parameters() if id(p) in experts], self.ctx.moe_dp.group)
        for p, group, _ in self.shared_params:
            dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)

    def counts_in_norm(self, param: nn.Parameter) -> bool:
        """Whether this rank counts `param` in the global norm (each element of the whole model once)."""
        if any(p is param and not owner for p, _, owner in self.shared_params):
            return False
        return get_tp_spec(param) is not None or self.ctx.tp.rank == 0

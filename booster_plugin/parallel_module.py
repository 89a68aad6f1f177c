"""The boosted model and optimizer: run a stage's forward, then reduce gradients across stages and replicas."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardformer.layer.spec import get_tp_spec

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
    """Gradients of a group of parameters in one flat buffer: one all-reduce, launched as soon as the last of
    them is accumulated in the step's final backward pass, so the reduction overlaps the rest of the backward."""

    def __init__(self, params: List[nn.Parameter]) -> None:
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        # after the gradients, one flag per parameter: did any replica produce a gradient for it?
        self.buffer = torch.zeros(self.offsets[-1] + len(params), dtype=params[0].dtype, device=params[0].device)
        self.has_grad = self.buffer[self.offsets[-1]:]
        self.ready: set = set()
        self.work = None

    def view(self, i: int) -> torch.Tensor:
        return self.buffer[self.offsets[i]:self.offsets[i + 1]].view_as(self.params[i])

    @torch.no_grad()
    def launch(self, group: dist.ProcessGroup) -> None:
        for i, p in enumerate(self.params):
            self.has_grad[i] = p.grad is not None
            if p.grad is None:
                self.view(i).zero_()
            elif p.grad.data_ptr() != self.view(i).data_ptr():
                self.view(i).copy_(p.grad)
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True)

    @torch.no_grad()
    def finish(self, dp_size: int) -> None:
        """Wait for the reduction; the gradients become views of the averaged buffer (None where no replica had
        one, so that the optimizer skips unused parameters as it would on one process)."""
        self.work.wait()
        self.buffer.div_(dp_size)
        for i, p in enumerate(self.params):
            p.grad = self.view(i) if self.has_grad[i] > 0 else None
        self.work = None
        self.ready.clear()


class HybridParallelModule(nn.Module):
    """Wraps the sharded HF model (`unwrap()` returns it); forward is the model's own, pruned to this stage."""

    def __init__(self, module: nn.Module, stage_forward, dp_group: Optional[dist.ProcessGroup],
                 tp_group: Optional[dist.ProcessGroup], pp_group: Optional[dist.ProcessGroup],
                 shared_params: List[tuple], bucket_bytes: int = BUCKET_BYTES) -> None:
        super().__init__()
        self.module = module
        self._stage_forward = stage_forward
        self.dp_group, self.tp_group, self.pp_group = dp_group, tp_group, pp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.shared_params = shared_params  # [(parameter, group of the stages holding it, is_owner)]
        # False while gradients accumulate (all but the last microbatch, booster.no_sync): no reduction launched
        self.require_grad_sync = True
        self._buckets: List[GradBucket] = []
        if self.dp_size > 1:  # buckets in reverse order: the backward pass produces the last layers' grads first
            params = [p for p in module.parameters() if p.requires_grad]
            self._buckets = [GradBucket(b) for b in make_buckets(reversed(params), bucket_bytes)]
            for bucket in self._buckets:
                for i, p in enumerate(bucket.params):
                    p.register_post_accumulate_grad_hook(self._grad_ready_hook(bucket, i))

    def _grad_ready_hook(self, bucket: GradBucket, index: int):
        def hook(param: nn.Parameter) -> None:
            if not self.require_grad_sync:
                return
            if bucket.work is not None:
                raise RuntimeError("A second backward pass reached gradients whose data-parallel reduction already "
                                   "started. To accumulate gradients, run all but the last backward inside "
                                   "`with booster.no_sync(model):`, or call optimizer.step()/zero_grad() between.")
            bucket.ready.add(index)
            if len(bucket.ready) == len(bucket.params):
                bucket.launch(self.dp_group)
        return hook

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops reductions launched for gradients that are now discarded (e.g. a skipped step)."""
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            bucket.ready.clear()
        super().zero_grad(set_to_none=set_to_none)

    def unwrap(self) -> nn.Module:
        return self.module

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
    @torch.no_grad()
    def sync_grads(self) -> None:
        """Average gradients over data parallel (buckets not launched during the backward pass are launched now,
        e.g. with unused parameters), then sum those of parameters shared by stages (tied embeddings)."""
        for bucket in self._buckets:
            if bucket.work is None:
                bucket.launch(self.dp_group)
        for bucket in self._buckets:
            bucket.finish(self.dp_size)
        for p, group, _ in self.shared_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)

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

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm of the whole (unsharded) model: each parameter element counted once."""
        counted_elsewhere = {id(p) for p, _, owner in self.shared_params if not owner}
        tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        grads = [p.grad.detach().double() for p in self.module.parameters()
                 if p.grad is not None and id(p) not in counted_elsewhere
                 and (get_tp_spec(p) is not None or tp_rank == 0)]  # replicated over tp: count on one tp rank
        device = grads[0].device if grads else next(self.module.parameters()).device
        if norm_type == math.inf:
            total = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=device)
        else:
            total = sum((g.abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=device))
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        for group in (self.tp_group, self.pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, op=op, group=group)
        return total if norm_type == math.inf else total.pow(1.0 / norm_type)


class HybridParallelOptimizer:
    """Wraps the user's optimizer (now over this stage's parameters): gradient sync and clipping before step."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: HybridParallelModule, max_norm: float = 0.0,
                 tracer=None, master_dtype: Optional[torch.dtype] = None) -> None:
        self.optim = optimizer
        self.model = model
        self.max_norm = max_norm
        self.tracer = tracer
        self._grad_norm: Optional[float] = None
        # mixed precision: the optimizer steps fp32 master copies of the (bf16) model parameters
        self.master_of: Dict[int, nn.Parameter] = {}
        self._pairs: List[tuple] = []
        if master_dtype is not None:
            for group in optimizer.param_groups:
                masters = []
                for p in group["params"]:
                    master = nn.Parameter(p.detach().to(master_dtype).clone(), requires_grad=p.requires_grad)
                    if get_tp_spec(p) is not None:
                        master._tp_spec = get_tp_spec(p)
                    self.master_of[id(p)] = master
                    self._pairs.append((p, master))
                    masters.append(master)
                group["params"] = masters

    def __getattr__(self, name: str) -> Any:
        optim = self.__dict__.get("optim")
        try:
            return getattr(optim, name)
        except AttributeError:
            raise AttributeError(f"'HybridParallelOptimizer' object (wrapping {type(optim).__name__}) has no attribute "
                                 f"{name!r}") from None

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: Any) -> Optional[float]:
        """The global gradient norm computed by the last step (ColossalAI's semantics: with `max_norm` > 0, the norm
        before clipping; None before the first step or without clipping)."""
        return self._grad_norm

    def unwrap(self) -> torch.optim.Optimizer:
        return self.optim

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        loss.backward(**kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        torch.autograd.backward(tensor, grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self.model.zero_grad(set_to_none=set_to_none)

    def named_parameters(self):
        """(model parameter name, the parameter this optimizer steps) for this rank's parameters."""
        stepped = {id(q) for group in self.optim.param_groups for q in group["params"]}
        for name, p in self.model.unwrap().named_parameters():
            if id(p) in self.master_of:
                yield name, self.master_of[id(p)]
            elif id(p) in stepped:
                yield name, p

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        total = self.model.grad_norm(norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for group in self.optim.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
        return total

    def step(self, *args, **kwargs):
        with self.tracer.span("optimizer") if self.tracer is not None else contextlib.nullcontext():
            self.model.sync_grads()
            for p, master in self._pairs:
                master.grad = None if p.grad is None else p.grad.to(master.dtype)
            if self.max_norm > 0:
                self._grad_norm = float(self.clip_grad_norm(self.max_norm))
            result = self.optim.step(*args, **kwargs)
            with torch.no_grad():
                for p, master in self._pairs:
                    p.copy_(master)
            return result

    def state_dict(self) -> Dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

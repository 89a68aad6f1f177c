"""The boosted optimizer: gradient sync over stages and replicas, non-finite check, clipping on the global norm,
fp32 master weights for half precision, and the step."""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardformer.layer.spec import copy_tp_spec

from .mixed_precision import MAX_SKIPS_AT_MIN_SCALE, DynamicLossScaler, nonfinite_stages
from ..guards.optimizer_guard import boosted_step
from .optimizer_wrapper import OptimizerWrapper
from .parallel_module import HybridParallelModule

__all__ = ["HybridParallelOptimizer", "global_norm"]


def global_norm(parts: Sequence[Tuple[List[torch.Tensor], Iterable[Optional[dist.ProcessGroup]]]], norm_type: float,
                device: torch.device) -> torch.Tensor:
    """The norm of the union of the gradients of `parts`: each (gradients, groups) is held by the ranks of its
    groups, each element by one rank (e.g. dense gradients over tp and pp; expert gradients also over ep)."""
    inf = norm_type == math.inf
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    totals = []
    for grads, groups in parts:
        grads = [g.detach().double() for g in grads]
        zero = torch.zeros((), dtype=torch.float64, device=device)
        if inf:
            total = torch.stack([g.abs().max() for g in grads]).max() if grads else zero
        else:
            total = sum((g.abs().pow(norm_type).sum() for g in grads), zero)
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, op=op, group=group)
        totals.append(total)
    total = torch.stack(totals).max() if inf else torch.stack(totals).sum()
    return total if inf else total.pow(1.0 / norm_type)


@OptimizerWrapper.register  # ColossalAI's boosted optimizers are all OptimizerWrappers
class HybridParallelOptimizer:
    """Wraps the user's optimizer (now over this stage's parameters): gradient sync, loss scaling (fp16), clipping
    before step. Mixed precision: the optimizer steps fp32 master copies of the (bf16/fp16) model parameters.

    The seams `_master_grads`, `_norm_groups`, `_expert_norm_groups` and `_publish` are where ZeroOptimizer (zero.py)
    partitions."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: HybridParallelModule, max_norm: float = 0.0,
                 tracer=None, master_dtype: Optional[torch.dtype] = None,
                 scaler: Optional[DynamicLossScaler] = None, on_nonfinite: str = "skip") -> None:
        self.optim = optimizer
        self.model = model
        self.max_norm = max_norm
        self.tracer = tracer
        self.scaler = scaler
        self.on_nonfinite = on_nonfinite  # "skip" | "raise" | "ignore" (fp16: for overflows at min_scale)
        self._skips_at_min_scale = 0  # fp16: consecutive steps skipped for an overflow at min_scale
        self.steps = 0
        self._device = next(model.parameters()).device
        self._master_grad_pairs: List[Tuple[nn.Parameter, torch.Tensor]] = []
        self._grad_norm: Optional[torch.Tensor] = None
        self._init_weights(master_dtype)

    def _init_weights(self, master_dtype: Optional[torch.dtype]) -> None:
        self.master_of: Dict[int, nn.Parameter] = {}
        self._pairs: List[Tuple[nn.Parameter, nn.Parameter]] = []  # (model parameter, the parameter stepped)
        for group in self.optim.param_groups:
            stepped = []
            for p in group["params"]:
                master = p
                if master_dtype is not None and p.requires_grad:  # frozen (e.g. LoRA's base): never stepped
                    master = nn.Parameter(p.detach().to(master_dtype).clone(), requires_grad=p.requires_grad)
                    copy_tp_spec(p, master)
                    self.master_of[id(p)] = master
                self._pairs.append((p, master))
                stepped.append(master)
            group["params"] = stepped

    def __getattr__(self, name: str) -> Any:
        optim = self.__dict__.get("optim")
        try:
            return getattr(optim, name)
        except AttributeError:
            raise AttributeError(f"'HybridParallelOptimizer' object (wrapping {type(optim).__name__}) has no attribute "
                                 f"{name!r}") from None

    def unwrap(self) -> torch.optim.Optimizer:
        return self.optim

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Backward of the (last stage's) loss, scaled by the fp16 loss scale."""
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward(**kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        torch.autograd.backward(tensor, grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self.model.zero_grad(set_to_none=set_to_none)
        self._master_grad_pairs = []  # the last step's fp32 gradients: freed here, as the plain optimizer's are

    def named_parameters(self):
        """(model parameter name, the parameter this optimizer steps) for this rank's parameters."""
        stepped = {id(q) for group in self.optim.param_groups for q in group["params"]}
        for name, p in self.model.unwrap().named_parameters():
            if id(p) in self.master_of:
                yield name, self.master_of[id(p)]
            elif id(p) in stepped:
                yield name, p

    def load_master_weight(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """A checkpoint set `param` (model load): its fp32 master copy, if any, takes the same values."""
        if id(param) in self.master_of:
            self.master_of[id(param)].copy_(value)

    def unpartitioned(self, load: bool = False) -> contextlib.AbstractContextManager:
        """For checkpoint_io: the inner optimizer as if on one data-parallel rank (already so here; ZeRO gathers)."""
        return contextlib.nullcontext()

    def gathered_grads(self) -> Dict[int, Optional[torch.Tensor]]:
        """{id(model parameter): the gradient the optimizer stepped for it (unscaled, clipped), or None}."""
        return {id(p): master.grad for p, master in self._pairs}

    # -- seams -------------------------------------------------------------------------------------------
    def _master_grads(self) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        """After sync_grads: give each stepped parameter its gradient; (model parameter, gradient) pairs."""
        out = []
        for p, master in self._pairs:
            if master is not p:
                master.grad = None if p.grad is None else p.grad.to(master.dtype)
            if master.grad is not None:
                out.append((p, master.grad))
        return out

    def _norm_groups(self) -> Tuple[Optional[dist.ProcessGroup], ...]:
        """The groups whose ranks hold disjoint parts of the gradients this rank counts in the norm."""
        return self.model.tp_group, self.model.pp_group

    def _expert_norm_groups(self) -> Tuple[Optional[dist.ProcessGroup], ...]:
        """As `_norm_groups`, for the gradients of parameters split over ep (each ep rank holds other experts)."""
        return (self.model.ctx.ep.active,) + self._norm_groups()

    @torch.no_grad()
    def _publish(self) -> None:
        """After the step: the model parameters take the stepped values."""
        for p, master in self._pairs:
            if master is not p:
                p.copy_(master)

    # ------------------------------------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the stepped gradients to a global norm of at most `max_norm`; returns the norm. Collective."""
        counted = [(p, g) for p, g in self._master_grad_pairs if self.model.counts_in_norm(p)]
        experts = self.model.expert_param_ids()
        parts = [([g for p, g in counted if id(p) not in experts], self._norm_groups())]
        if experts:  # each ep rank holds other experts
            parts.append(([g for p, g in counted if id(p) in experts], self._expert_norm_groups()))
        total = self._grad_norm = global_norm(parts, norm_type, self._device)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for group in self.optim.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
        return total

    def _nonfinite(self, stages: List[int]) -> None:
        """Every rank alike: skip the step (warning on rank 0) or raise, so no parameter turns NaN silently."""
        what = (f"optimizer step {self.steps}: non-finite (inf/nan) gradients on pipeline stage(s) {stages}; the "
                f"step is skipped on every rank and the gradients are dropped")
        self.zero_grad()
        if self.on_nonfinite == "raise":
            raise FloatingPointError(what.replace("the step is skipped", "raising (on_nonfinite='raise')"))
        if dist.get_rank() == 0:
            warnings.warn(what + " (on_nonfinite='skip').", stacklevel=3)

    def _overflow(self, stages: List[int], scale: float, at_min_scale: bool) -> None:
        """fp16, every rank alike (the flags are agreed): the step is skipped. Above min_scale that is the loss
        scaler's business; at min_scale the gradients are non-finite for good and on_nonfinite applies: "raise" at
        once, "skip" warns (rank 0) and raises at the MAX_SKIPS_AT_MIN_SCALE-th such step in a row, "ignore" is
        silent."""
        self.zero_grad()
        self._skips_at_min_scale = self._skips_at_min_scale + 1 if at_min_scale else 0
        if not at_min_scale or self.on_nonfinite == "ignore":
            return
        count, limit = self._skips_at_min_scale, MAX_SKIPS_AT_MIN_SCALE
        what = (f"optimizer step {self.steps}: non-finite (inf/nan) fp16 gradients on pipeline stage(s) {stages} at "
                f"loss scale {scale:g}, already at its minimum (min_scale)")
        if self.on_nonfinite == "raise" or count >= limit:
            why = ("on_nonfinite='raise'" if self.on_nonfinite == "raise" else
                   f"{count} steps in a row skipped (on_nonfinite='skip' raises at {limit})")
            raise FloatingPointError(f"{what}; {why}: the scale cannot back off any more, so every step would be "
                                     f"skipped. Lower min_scale, use precision='bf16', or find the source of the "
                                     f"inf/nan (learning rate, max_norm, data).")
        if dist.get_rank() == 0:
            warnings.warn(f"{what}; the step is skipped on every rank ({count} in a row; on_nonfinite='skip' raises "
                          f"at {limit}).", stacklevel=3)

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: object) -> Optional[float]:
        """The global gradient norm (whole model, each element once, before clipping) of the last step that clipped
        (max_norm > 0), as ColossalAI's; None before such a step."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def step(self, *args, **kwargs):
        with self.tracer.span("optimizer") if self.tracer is not None else contextlib.nullcontext():
            self.model.sync_grads()
            self._master_grad_pairs = self._master_grads()
            self.steps += 1
            grads = [g for _, g in self._master_grad_pairs]
            if self.scaler is not None:  # fp16: one decision for the world; every rank skips the same steps
                scale, at_min_scale = self.scaler.scale, self.scaler.at_min_scale  # (those of these gradients)
                stages = self.scaler.unscale_and_check(grads, self.model.stage, self.model.num_stages)
                self.scaler.update(bool(stages))
                if stages:
                    self._overflow(stages, scale, at_min_scale)
                    return None
                self._skips_at_min_scale = 0
            elif self.on_nonfinite != "ignore":  # fp32/bf16: the same agreed check, without scaling
                stages = nonfinite_stages(grads, 1.0, self._device, self.model.stage, self.model.num_stages)
                if stages.any():
                    self._nonfinite([s for s, bad in enumerate(stages.tolist()) if bad])
                    return None
            if self.max_norm > 0:
                self.clip_grad_norm(self.max_norm)
            with boosted_step(self.optim):
                result = self.optim.step(*args, **kwargs)
            self._publish()
            self.model.grads_stepped()
            return result

    def state_dict(self) -> Dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

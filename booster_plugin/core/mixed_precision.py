"""fp16 training: dynamic loss scaling with one overflow decision for the whole world.

The loss is multiplied by `scale` before backward (HybridParallelOptimizer.backward, which the pipeline schedule
calls on the last stage, so the gradients sent between stages are scaled too). At the step the fp32 master
gradients are unscaled and checked with torch's own AMP kernel (`torch._amp_foreach_non_finite_check_and_unscale_`,
the one torch.amp.GradScaler uses); the found-inf flag is all-reduced (MAX) over every rank of every axis, so all
ranks skip the same steps. The update rule is ColossalAI's DynamicGradScaler (with hysteresis).

An overflow at a scale above `min_scale` is the scaler's business (the step is skipped, the scale backs off). At
`min_scale` the scale cannot back off any more and the gradients are non-finite for good, so the optimizer applies
`on_nonfinite` (HybridParallelOptimizer): "skip" warns and raises after MAX_SKIPS_AT_MIN_SCALE such steps in a row
(DeepSpeed's "Current loss scale already at minimum"), "raise" raises at once, "ignore" keeps skipping silently.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Mapping

import torch
import torch.distributed as dist

from pipeline.groups import world_group

MAX_SKIPS_AT_MIN_SCALE = 5  # consecutive overflowing steps at min_scale that on_nonfinite="skip" rides out


@dataclass
class LossScalerConfig:
    initial_scale: float = 2 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    max_scale: float = 2 ** 32

    def check(self) -> None:
        """Raise ValueError naming the argument when the scaler arguments cannot work."""
        problems = []
        if not self.min_scale > 0:
            problems.append(f"min_scale={self.min_scale} must be > 0")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            problems.append(f"initial_scale={self.initial_scale} must lie in [min_scale={self.min_scale}, "
                            f"max_scale={self.max_scale}]")
        if not self.growth_factor > 1:
            problems.append(f"growth_factor={self.growth_factor} must be > 1")
        if not 0 < self.backoff_factor < 1:
            problems.append(f"backoff_factor={self.backoff_factor} must be in (0, 1)")
        if self.growth_interval < 1 or self.hysteresis < 1:
            problems.append(f"growth_interval={self.growth_interval} and hysteresis={self.hysteresis} must be >= 1")
        if problems:
            raise ValueError("precision='fp16' loss scaler: " + "; ".join(problems) + ".")


class DynamicLossScaler:
    """Loss scale state and its update; `unscale_and_check` is collective over the default (world) group."""

    def __init__(self, config: LossScalerConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.scale = float(config.initial_scale)
        self.growth_step = 0  # steps without overflow since the last growth (or overflow)
        self.hysteresis_step = 0  # overflows since the last backoff (or growth)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @property
    def at_min_scale(self) -> bool:
        """The scale cannot back off any further."""
        return self.scale <= self.config.min_scale

    def unscale_and_check(self, grads: List[torch.Tensor], stage: int = 0, num_stages: int = 1) -> List[int]:
        """Divide `grads` (fp32, this rank's: pipeline stage `stage` of `num_stages`) by the scale in place; the
        stages on which any rank of the world saw inf or nan (empty: no overflow). Collective over the world."""
        flags = nonfinite_stages(grads, 1.0 / self.scale, self.device, stage, num_stages)
        return [s for s, bad in enumerate(flags.tolist()) if bad]

    def update(self, overflow: bool) -> None:
        c = self.config
        if overflow:
            self.hysteresis_step += 1
            self.growth_step = 0
            if self.hysteresis_step >= c.hysteresis:
                self.scale = max(self.scale * c.backoff_factor, c.min_scale)  # (until a growth: every overflow)
        else:
            self.growth_step += 1
            if self.growth_step == c.growth_interval:
                self.growth_step = 0
                self.hysteresis_step = 0
                self.scale = min(self.scale * c.growth_factor, c.max_scale)

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "growth_step": self.growth_step, "hysteresis_step": self.hysteresis_step}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.scale = float(state["scale"])
        self.growth_step = int(state["growth_step"])
        self.hysteresis_step = int(state["hysteresis_step"])


@torch.no_grad()
def nonfinite_stages(grads: List[torch.Tensor], inv_scale: float, device: torch.device, stage: int,
                     num_stages: int) -> torch.Tensor:
    """Multiply `grads` (fp32) by `inv_scale` in place and find inf/nan with torch's AMP kernel; returns, agreed
    over the world (one all-reduce), a bool per pipeline stage: did any rank of that stage see one? With
    `inv_scale` 1 (fp32, bf16: nothing to unscale) the gradients are only read: their max-norms (inf/nan
    propagate), half the memory traffic of the AMP kernel, which writes every gradient back."""
    found = torch.zeros(num_stages, dtype=torch.float32, device=device)
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for where, group in by_device.items():
        if inv_scale == 1.0:
            held = [g for g in group if g.numel()]  # (an empty tensor has no max-norm)
            norms = torch.stack(torch._foreach_norm(held, float("inf"))) if held else found.new_zeros(1)
            flag = (~torch.isfinite(norms)).any().float()
        else:
            flag = torch.zeros(1, dtype=torch.float32, device=where)
            inv = torch.full((1,), inv_scale, dtype=torch.float32, device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            flag = flag[0]
        found[stage] += flag.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=world_group())
    return found > 0


SCALER_ARGS = tuple(f.name for f in fields(LossScalerConfig))

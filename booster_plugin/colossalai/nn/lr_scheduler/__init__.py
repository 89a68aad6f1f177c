"""`colossalai.nn.lr_scheduler`: the warmup schedules ColossalAI's scripts use, in closed form on torch's
LRScheduler (`last_epoch` counts `step()` calls; the lr of step t depends on t alone, so `state_dict` and resuming
with `last_epoch` behave as torch's schedulers do).

Schedules, for a base lr b, W warmup steps and T total steps:

- `CosineAnnealingWarmupLR`: b (t+1)/W for t < W, then eta_min + (b - eta_min) (1 + cos(pi (t-W)/(T-W))) / 2.
  ColossalAI's holds b for two steps (t = W-1 and t = W) and continues the cosine periodically past T: so does this.
  This is ColossalAI's schedule on the torch it supports (<= 2.5.1); on newer torch its composition of two torch
  schedulers drifts (CosineAnnealingLR's first step changed), rising above b at t = W and lagging a step after.
- `LinearWarmupLR`: b (t+1)/(W+1) for t < W, then b (T-t)/(T-W) down to 0 at t = T. ColossalAI's keeps decreasing
  past T into negative rates; here the rate stays 0.
"""
from __future__ import annotations

import math
from typing import List

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["CosineAnnealingWarmupLR", "LinearWarmupLR"]


class CosineAnnealingWarmupLR(LRScheduler):
    """Linear warmup over `warmup_steps`, then cosine annealing to `eta_min` at `total_steps`."""

    def __init__(self, optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, eta_min: float = 0.0,
                 last_epoch: int = -1) -> None:
        if not 0 <= warmup_steps < total_steps:
            raise ValueError(f"CosineAnnealingWarmupLR needs 0 <= warmup_steps < total_steps, got warmup_steps="
                             f"{warmup_steps}, total_steps={total_steps}.")
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, int(warmup_steps), eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        t, w = self.last_epoch, self.warmup_steps
        if t < w:
            return [base * (t + 1) / w for base in self.base_lrs]
        cosine = (1 + math.cos(math.pi * (t - w) / (self.total_steps - w))) / 2
        return [self.eta_min + (base - self.eta_min) * cosine for base in self.base_lrs]


class LinearWarmupLR(LRScheduler):
    """Linear warmup over `warmup_steps`, then linear decay to 0 at `total_steps`."""

    def __init__(self, optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, last_epoch: int = -1) -> None:
        if not 0 <= warmup_steps < total_steps:
            raise ValueError(f"LinearWarmupLR needs 0 <= warmup_steps < total_steps, got warmup_steps={warmup_steps}, "
                             f"total_steps={total_steps}.")
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        t, w, total = self.last_epoch, self.warmup_steps, self.total_steps
        factor = (t + 1) / (w + 1) if t < w else max(total - t, 0) / (total - w)
        return [base * factor for base in self.base_lrs]

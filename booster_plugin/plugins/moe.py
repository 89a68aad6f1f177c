"""MoeHybridParallelPlugin: ColossalAI 0.5's mixture-of-experts plugin, as HybridParallelPlugin with expert
parallelism (`ep_size`, carved out of dp) and ColossalAI's MoE argument names."""
from __future__ import annotations

from typing import Any, Optional

from .hybrid import HybridParallelPlugin

__all__ = ["MoeHybridParallelPlugin"]


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """tp × pp × dp with each MoE layer's experts split over ep ranks carved out of dp (dp = moe_dp × ep), as
    ColossalAI's `MoeHybridParallelPlugin(tp_size, pp_size, ep_size, ...)`: every HybridParallelPlugin argument, and

    Args:
        tp_size, pp_size, ep_size: required, as in ColossalAI (see HybridParallelPlugin's `ep_size`).
        moe_dp_outside: the mesh order (moe_dp, pp, ep, tp) (default) or, False, (pp, moe_dp, ep, tp).

    Deliberate differences from ColossalAI, none of which changes what a step computes: ZeRO-2 and
    `overlap_communication` stay as given (ColossalAI turns them into ZeRO-1 without overlap because they "hang when
    some experts are not routed"; here a rank whose experts get no tokens still produces their zero gradients, so
    the buckets of expert gradients reduce in the same order everywhere); ZeRO-2 with pp runs (ColossalAI asks
    for zero_stage <= 1 with pp); the default precision is "fp32" as in our HybridParallelPlugin (ColossalAI's is
    "fp16"); routing is dropless and equals one process (no capacity factor)."""

    def __init__(self, tp_size: int, pp_size: int, ep_size: int, sp_size: Optional[int] = None,
                 moe_dp_outside: bool = True, **kwargs: Any) -> None:
        if "dp_outside" in kwargs:
            raise TypeError("MoeHybridParallelPlugin takes `moe_dp_outside` (ColossalAI's name), not `dp_outside`.")
        super().__init__(tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, sp_size=sp_size,
                         dp_outside=moe_dp_outside, **kwargs)

    @property
    def ep_size(self) -> int:
        return self.ctx.ep.size

    @property
    def moe_dp_size(self) -> int:
        return self.ctx.moe_dp.size

"""LowLevelZeroPlugin: ColossalAI 0.5's ZeRO data-parallel plugin, as HybridParallelPlugin(tp=1, pp=1,
zero_stage=stage): the model replicated, optimizer state (stage 1) and gradients (stage 2) partitioned over the world
by our ZeRO (booster_plugin/core/zero.py)."""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from .hybrid import HybridParallelPlugin

__all__ = ["LowLevelZeroPlugin"]


class LowLevelZeroPlugin(HybridParallelPlugin):
    """ColossalAI's LowLevelZeroPlugin, every argument by name. Checkpoints, no_sync and prepare_dataloader are
    HybridParallelPlugin's (HF-format model files; optimizer state loadable into any layout).

    Args:
        stage: ZeRO stage, 1 (optimizer state partitioned) or 2 (gradients too).
        precision: "fp32" (default; ColossalAI's default is "fp16": ours is fp32 so that results equal one process),
            "bf16" or "fp16" (fp32 master weights, dynamic loss scale).
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale: the fp16
            loss scaler (ColossalAI's defaults).
        max_norm: clip the global gradient norm (0: off); norm_type: only 2.0, as in ColossalAI.
        reduce_bucket_size_in_m: the gradient reduction's bucket size (our buckets are sized in MB).
        master_weights: True (fp32 master weights of bf16/fp16 parameters); False is refused: it changes results.
        cast_inputs: accepted; floating inputs are never cast (ColossalAI casts them to the bf16/fp16 compute
            dtype: pass such inputs, e.g. inputs_embeds, in the model's dtype; ids and masks need nothing).
        verbose: ColossalAI prints overflow information; ours warns on skipped steps whatever it is.
        communication_dtype, overlap_communication, overlap_allgather, cpu_offload, fp8_communication, use_fp8,
            extra_dp_size: speed and memory options on hardware we do not target; accepted, a non-default value
            warns (rank 0) and results are unchanged (extra_dp_size > 1: ColossalAI reduces in two levels, the same
            sums).
        kwargs: HybridParallelPlugin's own keyword arguments that apply without tp and pp (e.g. timeout,
            on_nonfinite, check_batches).
    """

    def __init__(self, stage: int = 1, precision: str = "fp32", initial_scale: float = 2 ** 32, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, max_scale: float = 2 ** 32, max_norm: float = 0.0, norm_type: float = 2.0,
                 reduce_bucket_size_in_m: int = 12, communication_dtype: Optional[torch.dtype] = None,
                 overlap_communication: bool = True, overlap_allgather: bool = False, cpu_offload: bool = False,
                 master_weights: bool = True, verbose: bool = False, cast_inputs: bool = True,
                 fp8_communication: bool = False, use_fp8: bool = False, extra_dp_size: int = 1,
                 **kwargs: Any) -> None:
        if stage not in (1, 2):
            raise ValueError(f"LowLevelZeroPlugin(stage={stage!r}): ZeRO stage 1 or 2 (for plain data parallel use "
                             f"TorchDDPPlugin or HybridParallelPlugin(zero_stage=0)).")
        if norm_type != 2.0:
            raise NotImplementedError(f"norm_type={norm_type}: gradients are clipped by their 2-norm only (as in "
                                      f"ColossalAI's LowLevelZeroPlugin); use norm_type=2.0.")
        if not master_weights and precision != "fp32":
            raise NotImplementedError(f"master_weights=False: {precision} training always keeps fp32 master weights "
                                      f"(without them updates round to the low precision and results change); use "
                                      f"master_weights=True.")
        if extra_dp_size < 1:
            raise ValueError(f"extra_dp_size={extra_dp_size} must be >= 1.")
        for name in ("tp_size", "pp_size", "tp", "pp", "zero_stage"):
            if name in kwargs:
                raise TypeError(f"LowLevelZeroPlugin got {name}: it is pure data parallel with ZeRO stage `stage`; "
                                f"for tp/pp use HybridParallelPlugin.")
        super().__init__(
            tp_size=1, pp_size=1, precision=precision, zero_stage=stage, max_norm=max_norm,
            initial_scale=initial_scale, min_scale=min_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, hysteresis=hysteresis,
            max_scale=max_scale, ddp_bucket_cap_mb=reduce_bucket_size_in_m,
            communication_dtype=communication_dtype, overlap_communication=overlap_communication,
            overlap_allgather=overlap_allgather, cpu_offload=cpu_offload, fp8_communication=fp8_communication,
            use_fp8=use_fp8, **kwargs)
        if extra_dp_size > 1 and dist.get_rank() == 0:
            warnings.warn(f"LowLevelZeroPlugin(extra_dp_size={extra_dp_size}) is ignored: ColossalAI would reduce "
                          f"gradients in two levels (the same sums); ours reduces over the world in one. Results are "
                          f"unaffected.", stacklevel=2)

    @property
    def stage(self) -> int:
        """The ZeRO stage (ColossalAI's attribute)."""
        return self.zero_stage

"""Speed switches: ours (`compile_layers`, `fused_kernels`, `attn_implementation`) and ColossalAI's, mapped onto them.

- `enable_jit_fused` -> compile_layers (regional compilation fuses element-wise work inside each decoder layer).
- `enable_fused_normalization` -> fused_kernels="liger" where Liger-Kernel can run (CUDA, liger_kernel installed) and
  the layers are not compiled, else compile_layers (the compiled layer graphs fuse the norms; said once on rank 0
  where Liger cannot run). Liger's kernels inside a compiled layer gained nothing (H200, Llama-3.2-1B shape: compiled
  160.7 ms a step, compiled with Liger's norms 164.7 ms; dynamo cannot analyse their Triton source, torch 2.11).
- `enable_flash_attention` -> attn_implementation="auto": flash_attention_2 where installed on CUDA, else sdpa.
- `enable_all_optimization` -> all three (and the chunked loss, on by default: config.ShardingConfig).
Our own switches given explicitly take precedence over ColossalAI's. Defaults (all off) keep the model as it is.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..core.attention_choice import resolve_attention, use_attention
from ..core.fused_kernels import FUSED_KERNELS, liger_unusable, use_liger_norms

__all__ = ["SpeedConfig", "COLOSSALAI_SPEED_SWITCHES", "use_kernels"]

COLOSSALAI_SPEED_SWITCHES = ("enable_all_optimization", "enable_fused_normalization", "enable_flash_attention",
                             "enable_jit_fused")


@dataclass(frozen=True)
class SpeedConfig:
    compile_layers: bool                # each held decoder layer compiled (core/regional_compile.py)
    fused_kernels: Optional[str]        # "liger": Liger's norms (core/fused_kernels.py); None: the model's own
    attn_implementation: Optional[str]  # set on the model (core/attention_choice.py); None: the model's own

    @classmethod
    def build(cls, compile_layers: bool, fused_kernels: Optional[str], attn_implementation: Optional[str],
              switches: Dict[str, bool], device: torch.device, rank: int) -> "SpeedConfig":
        """`switches`: ColossalAI's four (COLOSSALAI_SPEED_SWITCHES) by name. Raises on bad input, on every rank."""
        if fused_kernels not in FUSED_KERNELS:
            raise ValueError(f"fused_kernels={fused_kernels!r}: use one of {FUSED_KERNELS}.")
        if attn_implementation is not None and not isinstance(attn_implementation, str):
            raise TypeError(f"attn_implementation={attn_implementation!r}: a transformers attention implementation "
                            f"name ('sdpa', 'flash_attention_2', 'eager', ...) or 'auto'.")
        every = bool(switches.get("enable_all_optimization"))
        compiled = bool(compile_layers) or every or bool(switches.get("enable_jit_fused"))
        unusable = liger_unusable(device)
        if fused_kernels == "liger" and unusable is not None:
            raise ValueError(f"fused_kernels='liger': {unusable}. Drop it; compile_layers=True fuses the norms (and "
                             f"more) with torch.compile on any device.")
        if fused_kernels is None and not compiled and switches.get("enable_fused_normalization"):
            if unusable is None:
                fused_kernels = "liger"
            else:
                compiled = True
                if rank == 0:
                    warnings.warn(f"enable_fused_normalization: {unusable}; the compiled decoder layers "
                                  f"(compile_layers=True) fuse the norms instead.", stacklevel=4)
        if attn_implementation is None and (every or switches.get("enable_flash_attention")):
            attn_implementation = "auto"
        return cls(compiled, fused_kernels, resolve_attention(attn_implementation, device))


def use_kernels(model: nn.Module, speed: SpeedConfig, device: torch.device) -> None:
    """The attention implementation and fused norms asked for, on the model instance before it is sharded (sequence
    parallelism then wraps the chosen attention; the norms' parameters stay the same objects)."""
    use_attention(model, speed.attn_implementation)
    if speed.fused_kernels == "liger":
        unfused = [name for name, by in use_liger_norms(model, device).items() if not by]
        if unfused and dist.get_rank() == 0:
            warnings.warn(f"fused_kernels='liger': no Liger kernel equals {unfused} on a test input; they run as "
                          f"they are.", stacklevel=2)

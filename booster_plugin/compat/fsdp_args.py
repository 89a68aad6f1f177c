"""ColossalAI arguments of GeminiPlugin and TorchFSDPPlugin that our FSDP2 plugins (plugins/fsdp.py) accept by name but do
not act on, and the translation of TorchFSDPPlugin's FSDP1 options into FSDP2's.

As colossal_args.py does for HybridParallelPlugin: an option that only tunes speed or memory (Gemini's chunk
placement and offload, kernels, fp8) is accepted and a non-default value makes rank 0 warn once, saying what it would
have done; an option that would change results is refused before any collective, with the reason.
"""
from __future__ import annotations

import os
import warnings
from typing import Dict, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffload, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy

from .colossal_args import Unacted
from ..fsdp.shard import ShardLayout

__all__ = ["GEMINI_UNACTED", "FSDP1_UNACTED", "warn_unacted", "ShardLayout", "fsdp1_layout", "fsdp1_mp_policy",
           "refuse_fsdp1_options"]

GEMINI_UNACTED: Dict[str, Unacted] = {
    # Gemini's chunk manager: where chunks live and how they are sized (FSDP2 shards each parameter on dim 0)
    "chunk_config_dict": Unacted(None, False, "lay parameters out in chunks of the given configuration"),
    "chunk_init_device": Unacted(None, False, "build the chunks on that device"),
    "placement_policy": Unacted("static", False, "move chunks between accelerator and CPU by measured memory"),
    "max_prefetch": Unacted(0, False, "prefetch that many chunks ahead (FSDP2 prefetches one layer ahead)"),
    "offload_optim_frac": Unacted(0.0, False, "offload that fraction of the optimizer states to the CPU"),
    "offload_param_frac": Unacted(0.0, False, "offload that fraction of the parameters to the CPU"),
    "warmup_non_model_data_ratio": Unacted(0.8, False, "size the 'auto' placement's warmup budget"),
    "steady_cuda_cap_ratio": Unacted(0.9, False, "size the 'auto' placement's steady-state budget"),
    "gpu_margin_mem_ratio": Unacted(0.0, False, "run part of the optimizer step on the accelerator ('auto')"),
    # chunk-size search and bookkeeping: nothing to say
    "pin_memory": Unacted(False, False, ""),
    "strict_ddp_mode": Unacted(False, False, ""),
    "search_range_m": Unacted(32, False, ""),
    "hidden_dim": Unacted(None, False, ""),
    "min_chunk_size_m": Unacted(32, False, ""),
    "memstats": Unacted(None, False, ""),
    "enable_async_reduce": Unacted(True, False, ""),
    "verbose": Unacted(False, False, ""),
    # (ColossalAI's kernel switches act: GeminiPlugin's signature, plugins/speed.py)
    "enable_sequence_parallelism": Unacted(False, False, ""),  # ColossalAI ignores it without tp
    "use_fp8": Unacted(False, False, "run linear layers in fp8 (ours run in the compute dtype)"),
    "fp8_communication": Unacted(False, False, "compress communication to fp8 (ours stays in its dtype)"),
}

FSDP1_UNACTED: Dict[str, Unacted] = {
    "backward_prefetch": Unacted(None, False, "choose FSDP1's backward prefetch (FSDP2 prefetches one layer ahead "
                                              "by its own schedule)"),
    "sync_module_states": Unacted(False, False, ""),  # rank 0's parameters are always broadcast before sharding
    "fp8_communication": Unacted(False, False, "compress FSDP's all-gathers and reduce-scatters to fp8"),
}


def warn_unacted(plugin: str, table: Dict[str, Unacted], values: Mapping[str, object]) -> None:
    """Rank 0 warns once about the speed-only options set to something we do not do (results are unaffected)."""
    notes = []
    for name, value in values.items():
        arg = table[name]
        same = value is arg.default or (value is not None and arg.default is not None and value == arg.default)
        if not same and arg.effect:
            notes.append(f"{name}={value!r} would {arg.effect}")
    if notes and dist.get_rank() == 0:
        warnings.warn(f"{plugin} ignores options that only tune speed or memory (it shards with torch FSDP2); "
                      f"results are unaffected: " + "; ".join(notes) + ".", stacklevel=3)


def fsdp1_layout(strategy: Optional[ShardingStrategy], world: int) -> ShardLayout:
    """FSDP1's ShardingStrategy as an FSDP2 layout: NO_SHARD replicates over the world, HYBRID_SHARD shards within a
    node (LOCAL_WORLD_SIZE ranks, torchrun's) and replicates across nodes. Every layout gives the same results."""
    strategy = strategy or ShardingStrategy.FULL_SHARD
    if strategy == ShardingStrategy.NO_SHARD:
        return ShardLayout(world, 1, False)
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if node < 1 or world % node:
            raise ValueError(f"sharding_strategy={strategy.name}: LOCAL_WORLD_SIZE={node} must divide the world "
                             f"({world}).")
        return ShardLayout(world // node, node, strategy == ShardingStrategy.HYBRID_SHARD)
    return ShardLayout(1, world, strategy == ShardingStrategy.FULL_SHARD)


def fsdp1_mp_policy(mixed_precision: Optional[MixedPrecision]) -> MixedPrecisionPolicy:
    """FSDP1's MixedPrecision as FSDP2's policy (sharded parameters stay in their dtype: the optimizer's master
    copy); options FSDP2 cannot honour are refused, since they change results."""
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if mixed_precision.keep_low_precision_grads:
        raise NotImplementedError("MixedPrecision(keep_low_precision_grads=True) is not supported: FSDP2 keeps the "
                                  "sharded gradients in the parameters' dtype (fp32 updates); low-precision gradients "
                                  "would change the optimizer's results. Leave it False.")
    if mixed_precision.buffer_dtype is not None:
        raise NotImplementedError(f"MixedPrecision(buffer_dtype={mixed_precision.buffer_dtype}) is not supported: "
                                  f"FSDP2 leaves buffers in their own dtype, so results would differ from FSDP1's. "
                                  f"Cast the model's buffers yourself before boosting and leave buffer_dtype None.")
    return MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype, reduce_dtype=mixed_precision.reduce_dtype,
                                cast_forward_inputs=True)


def refuse_fsdp1_options(ignored_modules: Optional[Iterable[torch.nn.Module]], param_init_fn: object,
                         cpu_offload: Optional[CPUOffload]) -> None:
    """FSDP1 options whose FSDP2 counterpart would train differently."""
    if ignored_modules:
        raise NotImplementedError("TorchFSDPPlugin(ignored_modules=...) is not supported: FSDP would neither shard "
                                  "nor reduce their gradients, so the replicas of those modules would drift apart. "
                                  "Freeze them (requires_grad=False) instead, or leave ignored_modules None.")
    if param_init_fn is not None:
        raise NotImplementedError("TorchFSDPPlugin(param_init_fn=...) is not supported: initialize the model before "
                                  "boosting, or build it under LazyInitContext (boost then initializes it with the "
                                  "model's own init) and load weights with booster.load_model.")
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(f"cpu_offload must be a torch.distributed.fsdp.CPUOffload, got {type(cpu_offload).__name__}.")

"""Optimizer checkpoints: one safetensors + JSON file per (stage, tp rank) of dp replica 0, keyed by parameter
names, and `optimizer.index.json` (layout, files, per-tensor CRC32s).

optimizer_save.py writes them; optimizer_load.py reads them into any layout (optimizer_groups.py matches the param
groups). Here: what both see of a boosted optimizer, and the file names.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Set

import torch

from shardformer.layer.spec import TPSpec

from ..core.optimizer import HybridParallelOptimizer
from ..core.parallel_module import HybridParallelModule

OPTIMIZER_INDEX_NAME = "optimizer.index.json"


class OptimizerParts(NamedTuple):
    module: HybridParallelModule
    optim: torch.optim.Optimizer
    names: Dict[int, str]  # id(stepped parameter) -> model parameter name
    master_ids: Set[int]   # ids of fp32 master copies (bf16 training)


def optimizer_parts(optimizer) -> OptimizerParts:
    if not isinstance(optimizer, HybridParallelOptimizer):
        raise TypeError(f"Expected the boosted optimizer (HybridParallelOptimizer) returned by booster.boost(), "
                        f"got {type(optimizer).__name__}.")
    names = {id(p): n for n, p in optimizer.named_parameters()}
    master_ids = {id(m) for m in getattr(optimizer, "master_of", {}).values()}
    return OptimizerParts(optimizer.model, optimizer.optim, names, master_ids)


def spec_json(spec: Optional[TPSpec]) -> Optional[List[Optional[int]]]:
    return None if spec is None else [spec.dim, spec.n_fused, spec.full_size, spec.padded]


class FileNames(NamedTuple):
    index: str  # the index file's name
    base: str   # format of a (stage, tp rank)'s file names, without suffix


def file_names(prefix: Optional[str]) -> FileNames:
    base = f"{prefix}-" if prefix else ""
    return FileNames(base + OPTIMIZER_INDEX_NAME, base + "optimizer-pp{:03d}-tp{:03d}")

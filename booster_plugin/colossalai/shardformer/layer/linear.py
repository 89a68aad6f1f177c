"""ColossalAI's Linear1D_Col / Linear1D_Row / VocabParallelEmbedding1D with ColossalAI's arguments, on this library's
ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding (same sharding: output rows, input columns,
vocabulary rows over the process group; same results).

Differences: `from_native_module` shards a copy of the native parameters (ColossalAI shards the native Parameter
objects in place, so there `native.weight is layer.weight`); arguments that change results with no counterpart
here (`skip_bias_add`, `seq_parallel_mode="ring"`, a list of process groups) are refused; speed-only ones (`overlap`,
`stream_chunk_num`, `fp8_communication`, `use_zbv`) and initializers are accepted.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.context import Axis
from shardformer.layer import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from shardformer.layer.spec import get_tp_spec, shard_parameter

__all__ = ["Linear1D_Col", "Linear1D_Row", "VocabParallelEmbedding1D"]

_SPEED_ONLY = ("overlap", "stream_chunk_num", "fp8_communication", "use_zbv", "weight_initializer",
               "bias_initializer")


def _sequence_dim(cls_name: str, seq_parallel_mode: Optional[str], seq_parallel_dim: int) -> Optional[int]:
    if seq_parallel_mode in (None, "split_gather"):
        return seq_parallel_dim if seq_parallel_mode else None
    raise NotImplementedError(f"{cls_name}(seq_parallel_mode={seq_parallel_mode!r}): only None and 'split_gather' "
                              f"are supported here; other sequence-parallel modes run through HybridParallelPlugin's "
                              f"sequence_parallelism_mode.")


def _axis(process_group: Optional[ProcessGroup]) -> Axis:
    """The tp axis of the group ColossalAI code passes (None: its default, the whole world; one process without
    torch.distributed: this process alone)."""
    if process_group is not None:
        return Axis.of_group("tp", process_group)
    return Axis.of_group("tp", dist.group.WORLD) if dist.is_initialized() else Axis.alone("tp")


def _check(cls_name: str, process_group: Any, skip_bias_add: bool, extra: dict) -> None:
    if isinstance(process_group, (list, tuple)):
        raise NotImplementedError(f"{cls_name}: a list of process groups (2D tensor parallelism) is not supported: "
                                  f"pass one tensor-parallel group.")
    if skip_bias_add:
        raise NotImplementedError(f"{cls_name}(skip_bias_add=True) is not supported: the bias is always added.")
    if extra.get("weight") is not None or extra.get("bias_") is not None:
        raise NotImplementedError(f"{cls_name}(weight=..., bias_=...): adopting given Parameters is not supported; "
                                  f"use {cls_name}.from_native_module(module, process_group).")
    unknown = sorted(set(extra) - set(_SPEED_ONLY) - {"weight", "bias_"})
    if unknown:
        raise TypeError(f"{cls_name} got unexpected arguments {unknown}")


def _load(layer: nn.Module, module: nn.Module) -> nn.Module:
    """This rank's shards of the native module's parameters into the (meta) layer."""
    for name in ("weight", "bias"):
        if getattr(layer, name) is not None:
            native = getattr(module, name)
            setattr(layer, name, shard_parameter(native, get_tp_spec(getattr(layer, name)), layer.tp_rank,
                                                 layer.tp_size))
    return layer


class _FromNativeLinear:
    """ColossalAI's `from_native_module` of its linear layers: this class over a copy of an nn.Linear's weights."""

    @classmethod
    def from_native_module(cls, module: nn.Linear, process_group: Optional[ProcessGroup] = None, **kwargs: Any):
        kwargs.pop("dtype", None)
        layer = cls(module.in_features, module.out_features, bias=module.bias is not None, device="meta",
                    dtype=module.weight.dtype, process_group=process_group, **kwargs)
        return _load(layer, module)


class Linear1D_Col(_FromNativeLinear, ColumnParallelLinear):  # noqa: N801 (ColossalAI's name)
    """Output features split over `process_group`; `gather_output` all-gathers the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: Optional[torch.dtype] = None,
                 device: Any = None, process_group: Optional[ProcessGroup] = None, gather_output: bool = False,
                 seq_parallel_mode: Optional[str] = None, seq_parallel_dim: int = 1, skip_bias_add: bool = False,
                 **speed_only: Any) -> None:
        _check("Linear1D_Col", process_group, skip_bias_add, speed_only)
        super().__init__(in_features, out_features, _axis(process_group), bias=bias, gather_output=gather_output,
                         device=device, dtype=dtype)
        self.sequence_dim = _sequence_dim("Linear1D_Col", seq_parallel_mode, seq_parallel_dim)


class Linear1D_Row(_FromNativeLinear, RowParallelLinear):  # noqa: N801 (ColossalAI's name)
    """Input features split over `process_group`; partial outputs summed. `parallel_input=False` splits a full
    input first."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: Optional[torch.dtype] = None,
                 device: Any = None, process_group: Optional[ProcessGroup] = None,
                 seq_parallel_mode: Optional[str] = None, seq_parallel_dim: int = 1, parallel_input: bool = True,
                 skip_bias_add: bool = False, **speed_only: Any) -> None:
        _check("Linear1D_Row", process_group, skip_bias_add, speed_only)
        super().__init__(in_features, out_features, _axis(process_group), bias=bias, input_is_parallel=parallel_input,
                         device=device, dtype=dtype)
        self.sequence_dim = _sequence_dim("Linear1D_Row", seq_parallel_mode, seq_parallel_dim)


class VocabParallelEmbedding1D(VocabParallelEmbedding):
    """Vocabulary rows split over `process_group` (padded to a multiple of `make_vocab_size_divisible_by` x size)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device: Any = None,
                 process_group: Optional[ProcessGroup] = None, make_vocab_size_divisible_by: int = 64,
                 **speed_only: Any) -> None:
        _check("VocabParallelEmbedding1D", process_group, False, speed_only)
        super().__init__(num_embeddings, embedding_dim, _axis(process_group), padding_idx=padding_idx,
                         make_vocab_size_divisible_by=make_vocab_size_divisible_by, device=device, dtype=dtype)

    @classmethod
    def from_native_module(cls, module: nn.Embedding, process_group: Optional[ProcessGroup] = None,
                           **kwargs: Any) -> "VocabParallelEmbedding1D":
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError("VocabParallelEmbedding1D: max_norm, scale_grad_by_freq and sparse are not "
                                      "supported.")
        kwargs.pop("dtype", None)
        layer = cls(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx, device="meta",
                    dtype=module.weight.dtype, process_group=process_group, **kwargs)
        layer.weight = shard_parameter(module.weight, get_tp_spec(layer.weight), layer.tp_rank, layer.tp_size)
        return layer

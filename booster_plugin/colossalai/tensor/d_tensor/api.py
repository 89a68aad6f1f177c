"""`colossalai.tensor.d_tensor.api`: which tensors are sharded.

A tensor-parallel parameter here carries its TPSpec (`shardformer.layer.spec.get_tp_spec`) and an FSDP2-sharded one
(GeminiPlugin, TorchFSDPPlugin) is a torch DTensor: both are distributed tensors. ColossalAI's "customized" ones are
tensors with their own gather function (GPT-2's fused q/k/v); here fused parameters carry a TPSpec with n_fused > 1.
ColossalAI caches layout converters between its tensor layouts; here there is no such cache, so clearing it does
nothing.
"""
import torch
from torch.distributed.tensor import DTensor

from shardformer.layer.spec import get_tp_spec

__all__ = ["clear_layout_converter", "is_distributed_tensor", "is_customized_distributed_tensor"]


def clear_layout_converter() -> None:
    """Nothing to clear: no layout-converter cache here."""


def is_distributed_tensor(tensor: torch.Tensor) -> bool:
    """Sharded over tensor-parallel ranks (one split dimension) or by FSDP2 (a DTensor)."""
    spec = get_tp_spec(tensor)
    return isinstance(tensor, DTensor) or (spec is not None and spec.n_fused == 1)


def is_customized_distributed_tensor(tensor: torch.Tensor) -> bool:
    """Sharded over tensor-parallel ranks in several fused areas (q, k, v), each split separately."""
    spec = get_tp_spec(tensor)
    return spec is not None and spec.n_fused > 1

"""The model's cast to the compute dtype of mixed precision (bf16 / fp16), as transformers' own half-precision
models are: `from_pretrained(dtype=torch.bfloat16)` builds the rotary embeddings' frequency tables (`inv_freq`,
`original_inv_freq`: non-persistent fp32 buffers of its `*RotaryEmbedding` modules) in fp32 and keeps them there, and
the rotary forward computes its angles in fp32. A plain `model.to(bf16)` would round them to 8 bits: at position
2048 an angle then moves by radians, and a pretrained model sees other positions than it was trained on."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

__all__ = ["cast_to_compute_dtype"]


def _frequency_tables(model: nn.Module) -> List[Tuple[nn.Module, str, torch.Tensor]]:
    """(module, buffer name, tensor) of every non-persistent floating buffer of a rotary embedding module."""
    tables = []
    for module in model.modules():
        if not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point() and name in module._non_persistent_buffers_set:
                tables.append((module, name, buffer))
    return tables


def cast_to_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)`, the rotary frequency tables left in their own dtype (see the module docstring)."""
    kept = _frequency_tables(model)
    model.to(dtype)
    for module, name, table in kept:
        setattr(module, name, table)

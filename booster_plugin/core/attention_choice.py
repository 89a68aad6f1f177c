"""The attention implementation a boosted model runs (`HybridParallelPlugin(attn_implementation=...)`, and
ColossalAI's `enable_flash_attention`): set on the model instance with transformers' own
`PreTrainedModel.set_attn_implementation` before sharding (ring sequence parallelism then wraps the chosen one).
"auto" (what `enable_flash_attention=True` asks for): "flash_attention_2" on CUDA where the flash_attn package is
installed, else "sdpa" (torch's scaled_dot_product_attention, which picks its flash or memory-efficient kernels on
a GPU itself)."""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch
from torch import nn

__all__ = ["resolve_attention", "use_attention"]


def resolve_attention(requested: Optional[str], device: torch.device) -> Optional[str]:
    """The implementation name to set (None: keep the model's own)."""
    if requested != "auto":
        return requested
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def use_attention(model: nn.Module, name: Optional[str]) -> None:
    """Set `name` on the model (transformers validates it and says which are available)."""
    if name is None:
        return
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise TypeError(f"attn_implementation={name!r} needs a transformers model (PreTrainedModel); "
                        f"{type(model).__name__} has no set_attn_implementation. Drop the option for this model.")
    setter(name)

"""The boosted model as checkpoints see it: its unsharded parameter names, ties, checkpoint keys and stages.

Model checkpoints are the full, unsharded model in Hugging Face format, from and into any (tp, pp, dp) layout:
model_save.py writes them (gather.py streams the full tensors), model_load.py reads them.
"""
from __future__ import annotations

from typing import Callable, Dict

from ..core.lora import checkpoint_key
from ..core.parallel_module import HybridParallelModule
from .format import TORCH_SUFFIXES

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
FILE_SUFFIXES = (".safetensors",) + TORCH_SUFFIXES  # a checkpoint path with one of these is one file


def module_of(model) -> HybridParallelModule:
    if isinstance(model, HybridParallelModule):
        return model
    raise TypeError(f"Expected the boosted model (HybridParallelModule) returned by booster.boost(), got "
                    f"{type(model).__name__}.")


def tied_map(module: HybridParallelModule) -> Dict[str, str]:
    """{tied target: source} among the unsharded parameter names (HF's `all_tied_weights_keys`)."""
    unwrapped = module.unwrap()
    keys = getattr(unwrapped, "all_tied_weights_keys", None)
    if keys is None:
        config = getattr(unwrapped, "config", None)  # (None: not a transformers model, nothing tied by it)
        keys = getattr(unwrapped, "_tied_weights_keys", None) if getattr(config, "tie_word_embeddings", False) \
            else None
    if not isinstance(keys, dict):
        return {}
    full = module.full_params
    return {t: s for t, s in keys.items() if t in full and s in full and t != s}


def _same_name(name: str) -> str:
    return name


def key_of(module: HybridParallelModule) -> Callable[[str], str]:
    """Parameter name -> its key in the checkpoint (a LoRA model's base weights under their module's own name)."""
    return _same_name if module.lora is None else checkpoint_key


def stage_of(module: HybridParallelModule, name: str) -> int:
    """The first pipeline stage holding unsharded parameter `name` (its copy is the one saved)."""
    if module.pp_group is None:
        return 0
    return module.placement.stage_of_param(name)[0]

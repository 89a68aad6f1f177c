"""LoRA adapter checkpoints: `save_lora_as_pretrained` writes a standard peft adapter directory from any layout.

The keys and parameters of each adapter file were decided by peft (`get_peft_model_state_dict`) on the unsharded
model at boost (`module.lora.adapter_keys`); here their full tensors are gathered from every tp rank and pipeline stage
onto rank 0, which writes `adapter_model.safetensors` (non-default adapters in a sub-directory named after them,
as peft does) and peft's `adapter_config.json` into a temporary directory that is then swapped into place.
`PeftModel.from_pretrained(unsharded_model, path)` loads it.
"""
from __future__ import annotations

import copy
import functools
import os
from typing import Dict

import torch
from torch import nn

from ..core.lora import LoRAState
from ..core.parallel_module import HybridParallelModule
from .atomic import swap_into_place
from .context import CheckpointContext
from .format import Entry, write_tensor_file
from .gather import gather_on_rank0
from .save import LocalPhase, collective_save

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME


def save_lora_as_pretrained(ctx: CheckpointContext, module: HybridParallelModule, checkpoint: str) -> None:
    """Collective; see the module docstring. Raises CheckpointError on every rank if rank 0 could not write."""
    if module.lora is None:
        raise ValueError("save_lora_as_pretrained: the boosted model has no LoRA adapters; call "
                         "model = booster.enable_lora(model, lora_config=...) before booster.boost.")
    names = {n for keys in module.lora.adapter_keys.values() for n in keys.values()}
    full = gather_on_rank0(ctx, module, names)
    collective_save(ctx, f"save_lora_as_pretrained({checkpoint!r})", checkpoint,
                    lambda tmp: LocalPhase(functools.partial(_write_adapters, module.lora, full, tmp, checkpoint)))


def _write_adapters(lora: LoRAState, full: Dict[str, torch.Tensor], tmp: str, checkpoint: str) -> None:
    """Rank 0: every adapter into the temporary directory, then the swap."""
    for adapter, keys in lora.adapter_keys.items():
        directory = tmp if adapter == "default" else os.path.join(tmp, adapter)
        _write_adapter(lora.peft_model, adapter, directory, {k: full[n] for k, n in keys.items()})
    swap_into_place(checkpoint)


def _write_adapter(peft_model: nn.Module, adapter: str, directory: str, tensors: Dict[str, torch.Tensor]) -> None:
    """One adapter's weights and config, as peft's `save_pretrained` writes them."""
    os.makedirs(directory, exist_ok=True)
    keys = sorted(tensors)
    entries = [Entry(k, tuple(tensors[k].shape), tensors[k].dtype) for k in keys]
    write_tensor_file(os.path.join(directory, ADAPTER_WEIGHTS_NAME), entries, (tensors[k] for k in keys))
    config = copy.deepcopy(peft_model.peft_config[adapter])
    config.inference_mode = True
    base = peft_model.get_base_model()
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path") or None
    auto_mapping = None
    if config.task_type is None:
        auto_mapping = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    config.save_pretrained(directory, auto_mapping_dict=auto_mapping)

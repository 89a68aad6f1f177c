"""Derive a policy's pipeline structure (layer list, entry and exit modules) from a model instead of writing it.

Given the path of the repeated layer list, one tiny forward on the model's own dummy inputs records which modules
around the list run before its first layer (entry: first stage only) and which after its last layer (exit: last
stage only). Registration order is not used: models register e.g. a final norm before their layers.
- Entry: the first module holding an embedding is the model's input (`INPUT`: on later stages it returns the
  received hidden states); later embeddings are additive (`ZEROS`, e.g. positions); other modules with parameters
  and dropouts become identities (e.g. a projection or LayerNorm of the embeddings, GPT-2's `drop`). Modules
  without parameters that are not dropouts (rotary embeddings) run on every stage.
- Exit: modules with parameters that run after the layers, or never run in the traced forward (e.g. an unused
  pooler).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from ..stage.forward import IDENTITY, INPUT, ZEROS


def find_layer_lists(model: nn.Module, layer_class: type) -> List[str]:
    """Paths (relative to `model`) of the ModuleLists whose children are `layer_class` blocks, in model order."""
    paths: List[str] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(isinstance(m, layer_class) for m in module):
            paths.append(path)
    return paths


def _candidates(base: nn.Module, layers: str) -> Dict[str, nn.Module]:
    """The modules beside the path from `base` down to the layer list: their calls place them before or after."""
    found: Dict[str, nn.Module] = {}
    parts = layers.split(".")
    module, prefix = base, ""
    for part in parts:
        for name, child in module.named_children():
            if name != part:
                found[prefix + name] = child
        module, prefix = getattr(module, part), prefix + part + "."
    return found


def _dummy_inputs(model: nn.Module) -> Dict[str, torch.Tensor]:
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3]], device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    return inputs


def call_order(model: nn.Module, modules: Dict[str, nn.Module]) -> Dict[str, List[int]]:
    """For each named module, the indices of its calls in one forward of `model` on its dummy inputs."""
    calls: Dict[str, List[int]] = {name: [] for name in modules}
    counter = [0]
    handles = []
    for name, module in modules.items():
        def hook(mod, args, name=name):
            calls[name].append(counter[0])
            counter[0] += 1
        handles.append(module.register_forward_pre_hook(hook))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(**_dummy_inputs(model))
    except Exception as err:
        raise RuntimeError(f"Deriving the pipeline split of {type(model).__name__} runs one forward on its dummy "
                           f"inputs, which failed: {err}. Build the model on a real device, or write a "
                           f"shardformer.Policy with explicit entry/exit modules.") from err
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return calls


def derive_entry_exit(model: nn.Module, base: nn.Module, layers: str) -> Tuple[Dict[str, str], Tuple[str, ...]]:
    """(entry {path: stand-in kind}, exit paths), base-relative, for the layer list at base-relative `layers`."""
    layer_list = base.get_submodule(layers)
    others = _candidates(base, layers)
    calls = call_order(model, {**others, "\0first": layer_list[0], "\0last": layer_list[len(layer_list) - 1]})
    if not calls["\0first"]:
        raise RuntimeError(f"The layers at '{layers}' did not run in a forward of {type(model).__name__}.")
    first, last = calls["\0first"][0], calls["\0last"][-1]
    entry: Dict[str, str] = {}
    exit: List[str] = []
    for path, module in others.items():
        has_params = any(True for _ in module.parameters())
        before = [c for c in calls[path] if c < first]
        if before and (has_params or isinstance(module, nn.Dropout)):
            if any(isinstance(m, nn.Embedding) for m in module.modules()):
                entry[path] = ZEROS if INPUT in entry.values() else INPUT
            else:
                entry[path] = IDENTITY
        elif has_params and (not calls[path] or min(calls[path]) > last):
            exit.append(path)
        elif has_params:
            raise RuntimeError(f"'{path}' of {type(model).__name__} runs among the layers at '{layers}': it cannot "
                               f"be placed on one pipeline stage; write a shardformer.Policy for this model.")
    if INPUT not in entry.values():
        raise RuntimeError(f"No embedding runs before the layers at '{layers}' in {type(model).__name__}: the "
                           f"first stage's input cannot be derived; write a shardformer.Policy for this model.")
    return entry, tuple(exit)

"""Module paths of a transformers model as policies and plans name them: the base model's prefix, plan patterns
(`*` for one name), and lookups that may miss."""
from __future__ import annotations

import re
from typing import Dict, Mapping, Optional, Tuple, TypeVar

from torch import nn

__all__ = ["base_prefix", "find_submodule", "match", "split_at_base"]

V = TypeVar("V")


def base_prefix(model: nn.Module) -> str:
    """'' when the model is its own base model (or has none), else its path and a dot, e.g. 'transformer.'."""
    base = getattr(model, "base_model", model)
    if base is model:
        return ""
    for name, module in model.named_modules():
        if module is base:
            return name + "."
    raise ValueError(f"{type(model).__name__}.base_model is not one of its submodules.")


def find_submodule(root: nn.Module, path: str) -> Optional[nn.Module]:
    """The submodule at `path` ('' is `root`), or None where there is none (or it is None)."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def match(pattern: str, path: str) -> bool:
    """Does a plan pattern ('*' = one path component) match a module path?"""
    return re.fullmatch(pattern.replace(".", r"\.").replace("*", r"[^.]+"), path) is not None


def split_at_base(plan: Mapping[str, V], prefix: str) -> Tuple[Dict[str, V], Dict[str, V]]:
    """A model-relative plan as (base-relative entries, entries outside the base model), for a base `prefix`."""
    inside = {path[len(prefix):]: value for path, value in plan.items() if path.startswith(prefix)}
    outside = {path: value for path, value in plan.items() if not path.startswith(prefix)}
    return inside, outside

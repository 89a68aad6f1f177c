"""What a stage passes on, leaf by leaf: nested dicts, lists and tuples of tensors (and a model's own output types,
which register themselves with torch.utils._pytree, as transformers' ModelOutput does) are walked by pytree alone.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple, TypeVar

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

__all__ = ["detached", "grad_pairs", "handed_off", "input_grads", "merge_outputs"]

Tree = TypeVar("Tree")  # a nested structure (pytree) of tensors, returned in the same structure


def detached(obj: Tree) -> Tree:
    """`obj` with every tensor detached (an output kept past its step)."""
    return tree_map_only(Tensor, Tensor.detach, obj)


def handed_off(obj: Tree) -> Tree:
    """An output passed to the next virtual stage on the same rank: new leaves, as if it had been received."""
    return tree_map_only(Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), obj)


def input_grads(obj: object) -> object:
    """The gradients a stage computed for its inputs `obj`, in the same structure (None where there is none)."""
    return tree_map(lambda x: x.grad if isinstance(x, Tensor) and x.requires_grad else None, obj)


def grad_pairs(outputs: object, grads: object) -> Tuple[List[Tensor], List[Tensor]]:
    """The tensors of `outputs` that need a gradient and their gradients in `grads` (the same structure, as
    `input_grads` made it on the next stage), for one autograd call."""
    pairs = [(t, g) for t, g in zip(tree_leaves(outputs), tree_leaves(grads), strict=True)
             if isinstance(t, Tensor) and t.requires_grad and g is not None]
    return [t for t, _ in pairs], [g for _, g in pairs]


def merge_outputs(outputs: Sequence[Tree]) -> Tree:
    """Per-microbatch outputs of one structure as one: tensors concatenated along dim 0 (scalars stacked), every
    other leaf taken from the first."""
    return tree_map(_merge_leaves, outputs[0], *outputs[1:])


def _merge_leaves(first: Any, *rest: Any) -> Any:
    if isinstance(first, Tensor):
        return torch.cat([first, *rest], dim=0) if first.dim() > 0 else torch.stack([first, *rest])
    return first

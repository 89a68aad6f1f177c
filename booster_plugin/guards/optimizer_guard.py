"""Refuse an optimizer that steps a boosted model's parameters without going through `boost`.

Such an optimizer (built from the boosted model's parameters after `boost`, or the original object stepped
directly instead of the optimizer `boost` returned) skips the plugin's work at the step: tied weights summed over
pipeline stages, gradient clipping over all shards, fp32 master weights, ZeRO partitions. Its update is silently
wrong (tied embedding and LM head drift apart). torch's global optimizer step pre-hook sees every step of every
optimizer; it raises when an optimizer holding a boosted parameter steps outside the boosted optimizer's `step`.
Every rank runs the same script, so every rank raises, before the step's first collective.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Iterator, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

# parameters of boosted models, by id (a WeakSet would compare tensors with their element-wise `==`)
_boosted: Dict[int, "weakref.ref[torch.Tensor]"] = {}
_stepping: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # inner optimizers in a boosted step
_hook = None


def guard_parameters(model: nn.Module) -> None:
    """From now on, only a boosted optimizer's `step` may step the parameters of `model` (a boosted model)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_step)
    for p in model.parameters():
        _boosted[id(p)] = weakref.ref(p, lambda _, key=id(p): _boosted.pop(key, None))


@contextlib.contextmanager
def boosted_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around the inner optimizer's step, inside the boosted optimizer's `step`."""
    _stepping.add(optimizer)
    try:
        yield
    finally:
        _stepping.discard(optimizer)


def _check_step(optimizer: torch.optim.Optimizer, args: Tuple[object, ...], kwargs: Dict[str, object]) -> None:
    if optimizer in _stepping or not _boosted:
        return
    if any(_is_boosted(p) for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() updates parameters of a boosted model, but this optimizer did not go "
            f"through booster.boost: it would skip the plugin's gradient work (tied weights summed over pipeline "
            f"stages, clipping over all shards, master weights, ZeRO). Build the optimizer from the model's "
            f"parameters before boosting and pass it to boost: `model, optimizer, *_ = booster.boost(model, "
            f"optimizer)`, then step the optimizer boost returned.")


def _is_boosted(param: torch.Tensor) -> bool:
    ref = _boosted.get(id(param))
    return ref is not None and ref() is param

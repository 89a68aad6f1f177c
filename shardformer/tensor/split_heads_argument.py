"""A tensor-parallel style for per-head tensor arguments built outside the module whose heads tp splits: BLOOM's
ALiBi bias, shaped (batch * heads, 1, keys), and Falcon's, shaped (batch, heads, 1, keys) and folded into a per-head
attention mask (batch, heads, queries, keys), are built for all heads by the base model and reach each attention,
where a rank holding heads [r * h / tp, (r + 1) * h / tp) must use only theirs. Registered in the sharder's style
table (apply_styles.STYLE_TABLE) on import: a policy names it like Colwise or Rowwise."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Tuple

from torch import nn

from .apply_styles import STYLE_TABLE, TPContext

__all__ = ["SplitHeadsArgument"]


@dataclass(frozen=True)
class SplitHeadsArgument:
    """The module's `arguments` reach it as this rank's heads' slice: along dim 1 where that dim counts every head
    (`dim=1`, (batch, heads, ...); a tensor with one head there, e.g. a plain mask, is left whole), or in a first dim
    that flattens batch and heads (`dim=0`, (batch * heads, ...)). Heads are counted by the module's attribute
    `heads` before tp divides it."""
    arguments: Tuple[str, ...]
    dim: int = 1
    heads: str = "num_heads"


def _split_heads_argument(module: nn.Module, style: SplitHeadsArgument, ctx: TPContext) -> Optional[nn.Module]:
    heads, rank = getattr(module, style.heads), ctx.tp.rank
    if heads % ctx.tp.size:
        raise ValueError(f"tp_size={ctx.tp.size} does not divide the {heads} heads of {type(module).__name__}.")
    local = heads // ctx.tp.size
    names = list(inspect.signature(module.forward).parameters)
    where = {name: names.index(name) if name in names else None for name in style.arguments}

    def own_heads(x):
        if x is None or x.dim() < 2:
            return x
        if style.dim == 1:
            return x[:, rank * local:(rank + 1) * local] if x.shape[1] == heads else x
        return x.view(-1, heads, *x.shape[1:])[:, rank * local:(rank + 1) * local].reshape(-1, *x.shape[1:])

    def hook(mod, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        for name, index in where.items():
            if name in kwargs:
                kwargs[name] = own_heads(kwargs[name])
            elif index is not None and index < len(args):
                args[index] = own_heads(args[index])
        return tuple(args), kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return None


STYLE_TABLE[SplitHeadsArgument] = _split_heads_argument

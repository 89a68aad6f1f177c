"""A config view a transformers module sees only while it runs: swapped in around the call and restored after, so
outside our calls the module (transformers') holds its own config and nothing of ours stays on it.

transformers' modules read their config at call time (`self.config._attn_implementation`, the loop's
`self.config.layer_types[i]`) and offer no other seam to change what one module reads without changing the model's
config, which the masks and the other modules read too: the swap is the narrowest change there is.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List
from weakref import WeakKeyDictionary

from torch import nn

__all__ = ["config_swapped", "see_config_while_running"]


@contextlib.contextmanager
def config_swapped(module: nn.Module, view: Any) -> Iterator[None]:
    """Inside, `module.config` is `view` (None: unchanged); its own config is restored on exit, error or not."""
    if view is None:
        yield
        return
    own = module.config
    module.config = view
    try:
        yield
    finally:
        module.config = own


# module -> its own configs saved by the calls running now (a stack: a call may re-enter, e.g. recomputation)
_SAVED: "WeakKeyDictionary[nn.Module, List[Any]]" = WeakKeyDictionary()


class _SeeView:
    """Forward hooks of one module: swap `view` in before its forward and its own config back after."""

    def __init__(self, view: Any) -> None:
        self.view = view

    def enter(self, module: nn.Module, args: tuple) -> None:
        _SAVED.setdefault(module, []).append(module.config)
        module.config = self.view

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        saved = _SAVED.get(module)
        if saved:
            module.config = saved.pop()


def see_config_while_running(module: nn.Module, view: Any) -> None:
    """While `module` runs (each call, recomputation included) it reads `view` as its config; between calls its own.
    The swap runs before the module's other pre-hooks; the restore runs even when the forward raises."""
    hooks = _SeeView(view)
    module.register_forward_pre_hook(hooks.enter, prepend=True)
    module.register_forward_hook(hooks.leave, always_call=True)

"""ColossalAI names with no counterpart here: importable (so a ported test or script loads), raising on use with the
reason and what to use instead."""
from __future__ import annotations

from typing import Any, Callable, NoReturn, Type

__all__ = ["refused_class", "refused_function"]


def _raise(name: str, reason: str) -> NoReturn:
    raise NotImplementedError(f"colossalai's {name} has no counterpart in booster_plugin: {reason}")


def refused_function(name: str, reason: str) -> Callable[..., NoReturn]:
    """A function named `name` that raises NotImplementedError(reason) when called."""
    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        _raise(name, reason)
    refused.__name__ = refused.__qualname__ = name.rsplit(".", 1)[-1]
    refused.__doc__ = f"Refused: {reason}"
    return refused


def refused_class(name: str, reason: str) -> Type:
    """A class named `name` whose construction raises NotImplementedError(reason) (isinstance checks are False)."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        _raise(name, reason)

    def from_native_module(cls: Type, *args: Any, **kwargs: Any) -> NoReturn:
        _raise(name, reason)

    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__doc__": f"Refused: {reason}",
                                               "from_native_module": classmethod(from_native_module)})

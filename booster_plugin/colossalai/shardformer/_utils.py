"""`colossalai.shardformer._utils.getattr_`: a dotted attribute path (`"model.layers[0].self_attn"`)."""
import re
from typing import Any

__all__ = ["getattr_"]

_INDEXED = re.compile(r"^(\w+)\[(\d+)\]$")


def getattr_(obj: Any, attr: str, ignore: bool = False) -> Any:
    """`obj.a.b[0].c` for `attr="a.b[0].c"`; None when a step is missing and `ignore`, else AttributeError."""
    for name in attr.split("."):
        match = _INDEXED.match(name)
        try:
            obj = getattr(obj, match.group(1))[int(match.group(2))] if match else getattr(obj, name)
        except AttributeError:
            if ignore:
                return None
            raise AttributeError(f"Object {obj.__class__.__name__} has no attribute {attr}") from None
    return obj

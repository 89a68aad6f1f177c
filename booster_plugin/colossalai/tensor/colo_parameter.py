"""`colossalai.tensor.colo_parameter.ColoParameter`: the parameters GeminiPlugin manages. Here GeminiPlugin shards
with torch FSDP2, whose parameters are DTensors: `isinstance(p, ColoParameter)` holds for them; the class itself
cannot be built (FSDP2 makes its parameters)."""
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ColoParameter"]


class _ShardedParameterCheck(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, nn.Parameter) and isinstance(obj, DTensor)


class ColoParameter(metaclass=_ShardedParameterCheck):
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("ColoParameter is not built by hand here: GeminiPlugin's boost makes the model's "
                                  "parameters FSDP2 DTensors, which are ColoParameters for isinstance.")

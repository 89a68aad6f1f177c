"""`colossalai.checkpoint_io.utils`: `gather_distributed_param` for FSDP2-sharded parameters (DTensors); a
tensor-parallel parameter here does not carry its process group, so gathering one by itself is refused (the boosted
model's `state_dict()` and `booster.save_model` gather every parameter)."""
import torch
from torch.distributed.tensor import DTensor

from shardformer.layer.spec import get_tp_spec

from .._refused import refused_function

__all__ = ["gather_distributed_param", "create_pinned_state_dict"]


def gather_distributed_param(param: torch.Tensor, keep_vars: bool = False) -> torch.Tensor:
    """The whole parameter: a DTensor's full tensor; a replicated one as it is."""
    tensor = param if keep_vars else param.detach()
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    if get_tp_spec(param) is not None:
        raise NotImplementedError("gather_distributed_param of a tensor-parallel shard: the parameter does not carry "
                                  "its process group here; use the boosted model's state_dict() (whole tensors) or "
                                  "shardformer.layer.gather_tensor(shard, spec, tp_group).")
    return tensor


create_pinned_state_dict = refused_function("create_pinned_state_dict", "asynchronous pinned-memory saving is not "
                                                                        "implemented (booster.save_model(use_async) "
                                                                        "saves synchronously).")

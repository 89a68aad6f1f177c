"""`colossalai.checkpoint_io.utils`: `gather_distributed_param`, the whole tensor of a sharded parameter: an FSDP2
DTensor's full tensor, or a tensor-parallel shard gathered over the group its TPSpec records (collective over that
group), without padding."""
import torch
from torch.distributed.tensor import DTensor

from shardformer.layer.spec import gather_tensor, get_tp_spec

from .._refused import refused_function

__all__ = ["gather_distributed_param", "create_pinned_state_dict"]


def gather_distributed_param(param: torch.Tensor, keep_vars: bool = False) -> torch.Tensor:
    """The whole parameter: a DTensor's full tensor, a tensor-parallel shard gathered, a replicated one as it is."""
    tensor = param if keep_vars else param.detach()
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    spec = get_tp_spec(param)
    return tensor if spec is None else gather_tensor(tensor, spec, spec.group)


create_pinned_state_dict = refused_function("create_pinned_state_dict", "asynchronous pinned-memory saving is not "
                                                                        "implemented (booster.save_model(use_async) "
                                                                        "saves synchronously).")

"""`colossalai.tensor.padded_tensor.api`: parameters padded so that they split evenly (the vocabulary of a
vocab-parallel embedding or LM head): their TPSpec records the unpadded size."""
import torch

from shardformer.layer.spec import get_tp_spec

__all__ = ["is_padded_tensor", "to_unpadded_tensor"]


def is_padded_tensor(tensor: torch.Tensor) -> bool:
    spec = get_tp_spec(tensor)
    return spec is not None and spec.full_size is not None


def to_unpadded_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor without its padding rows, when it is a whole (gathered) padded tensor; otherwise as it is."""
    spec = get_tp_spec(tensor)
    if spec is None or spec.full_size is None or tensor.shape[spec.dim] <= spec.full_size:
        return tensor
    return tensor.narrow(spec.dim, 0, spec.full_size)

"""`colossalai.tensor.padded_tensor`."""
from .api import is_padded_tensor, to_unpadded_tensor

__all__ = ["is_padded_tensor", "to_unpadded_tensor"]

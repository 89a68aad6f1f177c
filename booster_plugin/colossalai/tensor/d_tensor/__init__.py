"""`colossalai.tensor.d_tensor`."""
from .api import clear_layout_converter, is_customized_distributed_tensor, is_distributed_tensor

__all__ = ["clear_layout_converter", "is_distributed_tensor", "is_customized_distributed_tensor"]

"""`colossalai.pipeline.weight_grad_store`: refused (zero-bubble weight-gradient deferral is internal to the
'zbv' schedule here)."""
from .._refused import refused_class

__all__ = ["WeightGradStore"]

WeightGradStore = refused_class("WeightGradStore", "the zbv schedule defers weight gradients itself "
                                                   "(HybridParallelPlugin(pp_style='zbv')); no global store.")

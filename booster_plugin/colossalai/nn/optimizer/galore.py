"""`colossalai.nn.optimizer.galore`: refused with GaLoreAdamW8bit."""
from ..._refused import refused_function

__all__ = ["get_galore_param_groups"]

get_galore_param_groups = refused_function("get_galore_param_groups", "GaLore is not implemented here.")

"""`colossalai.utils.safetensors`: refused (ColossalAI's asynchronous flat safetensors writer; checkpoints here are
written by the plugins' checkpoint IO with the safetensors package)."""
from .._refused import refused_function

__all__ = ["load_flat", "move_and_save", "save", "save_nested"]

_REASON = "use booster.save_model(..., use_safetensors=True) or the safetensors package."
load_flat = refused_function("load_flat", _REASON)
move_and_save = refused_function("move_and_save", _REASON)
save = refused_function("save", _REASON)
save_nested = refused_function("save_nested", _REASON)

"""`colossalai.checkpoint_io`: checkpoints go through `booster.save_model/load_model/save_optimizer/...` (each
plugin's own checkpoint IO); ColossalAI's standalone CheckpointIO classes are refused."""
from .._refused import refused_class

__all__ = ["CheckpointIO", "GeneralCheckpointIO"]

_BOOSTER = "use booster.save_model / load_model / save_optimizer / load_optimizer (the plugin's checkpoint IO)."
CheckpointIO = refused_class("CheckpointIO", _BOOSTER)
GeneralCheckpointIO = refused_class("GeneralCheckpointIO", _BOOSTER)

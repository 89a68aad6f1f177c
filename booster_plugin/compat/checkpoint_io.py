"""Compatibility name: the checkpoint code lives in the `booster_plugin.checkpoint` package."""
from ..checkpoint import CheckpointError, HybridParallelCheckpointIO

__all__ = ["CheckpointError", "HybridParallelCheckpointIO"]

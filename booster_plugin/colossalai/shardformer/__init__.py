"""`colossalai.shardformer`: its activation-checkpointing configurations, with ColossalAI's defaults."""
from dataclasses import dataclass

from booster_plugin.core.activation_checkpoint import GradientCheckpointConfig as _GradientCheckpointConfig

__all__ = ["GradientCheckpointConfig", "PipelineGradientCheckpointConfig"]


@dataclass
class GradientCheckpointConfig(_GradientCheckpointConfig):
    """This library's GradientCheckpointConfig with ColossalAI's default ratio, 0.0 (this library's is 1.0)."""
    gradient_checkpointing_ratio: float = 0.0


@dataclass
class PipelineGradientCheckpointConfig(GradientCheckpointConfig):
    """`num_ckpt_layers_per_stage` (one count per pipeline stage) or `gradient_checkpointing_ratio` of each stage's
    layers. ColossalAI counts per stage and model chunk with several chunks; here a stage's count covers all its
    chunks."""

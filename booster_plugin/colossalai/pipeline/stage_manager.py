"""`colossalai.pipeline.stage_manager`: the plugin's `stage_manager` (None without pipeline parallelism) is one."""
from pipeline.stage_manager import PipelineStageManager

__all__ = ["PipelineStageManager"]

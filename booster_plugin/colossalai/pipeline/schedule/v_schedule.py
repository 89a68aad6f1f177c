"""`colossalai.pipeline.schedule.v_schedule`: the zero-bubble V schedule's builder."""
from booster_plugin.compat import PipelineGraph

__all__ = ["PipelineGraph"]

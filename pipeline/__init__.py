"""Pipeline runtime: process-group mesh, stage manager, P2P communication and schedules (no transformers here)."""
from .mesh import ProcessGroupMesh
from .p2p import PipelineP2PCommunication
from .runtime import PipelineSchedule
from .stage_manager import PipelineStageManager

__all__ = ["ProcessGroupMesh", "PipelineStageManager", "PipelineP2PCommunication", "PipelineSchedule"]

"""`colossalai.cluster`."""
from booster_plugin.compat import DistCoordinator
from pipeline.mesh import ProcessGroupMesh

__all__ = ["DistCoordinator", "ProcessGroupMesh"]

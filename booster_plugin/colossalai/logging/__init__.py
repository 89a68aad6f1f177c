"""`colossalai.logging`: named loggers whose calls take `ranks=[...]` (booster_plugin/dist_logger.py)."""
from ...dist_logger import DistributedLogger, disable_existing_loggers, get_dist_logger

__all__ = ["DistributedLogger", "get_dist_logger", "disable_existing_loggers"]

"""`colossalai.booster.booster`."""
from booster_plugin import Booster

__all__ = ["Booster"]

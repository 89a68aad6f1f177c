"""`colossalai.booster.mixed_precision`: precision is chosen by name here (`Booster(mixed_precision="fp16")` or the
plugin's `precision=`); ColossalAI's MixedPrecision objects are refused."""
from ..._refused import refused_class

__all__ = ["FP16TorchMixedPrecision"]

FP16TorchMixedPrecision = refused_class("FP16TorchMixedPrecision", "pass mixed_precision='fp16' to Booster or "
                                                                   "precision='fp16' to the plugin.")

"""Booster and its plugins (HybridParallelPlugin, MoeHybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin): compose pipeline and
shardformer for training. `world_group()`: every rank in a group that carries CPU tensors too, whatever backend the
script's world group has (`init_process_group("nccl")` has none for the CPU)."""
from pipeline.groups import world_group

from . import clean_exit  # noqa: F401  (first: its atexit hook then runs after those of the modules below)
from .activation_checkpoint import GradientCheckpointConfig
from .booster import Booster
from .fsdp import GeminiPlugin, TorchFSDPPlugin
from .low_level_zero import LowLevelZeroPlugin
from .moe_plugin import MoeHybridParallelPlugin
from .optimizer import HybridParallelOptimizer
from .parallel_module import HybridParallelModule
from .plugin import HybridParallelPlugin
from .plugin_base import DPPluginBase, Plugin
from .samplers import StatefulDistributedSampler
from .torch_ddp import TorchDDPPlugin

__all__ = ["Booster", "Plugin", "DPPluginBase", "HybridParallelPlugin", "MoeHybridParallelPlugin", "LowLevelZeroPlugin",
           "TorchDDPPlugin", "GeminiPlugin", "TorchFSDPPlugin",
           "HybridParallelModule", "HybridParallelOptimizer", "GradientCheckpointConfig", "StatefulDistributedSampler",
           "world_group", "HybridParallelTrainer", "HybridParallelTrainerMixin"]

_TRAINER_NAMES = ("HybridParallelTrainer", "HybridParallelTrainerMixin")


def __getattr__(name: str):
    """The Trainer integration, imported on first use (it imports transformers.Trainer and accelerate)."""
    if name in _TRAINER_NAMES:
        from . import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

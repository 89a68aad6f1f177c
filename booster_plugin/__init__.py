"""Booster and its plugins (HybridParallelPlugin, MoeHybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin): compose pipeline and
shardformer for training. `world_group()`: every rank in a group that carries CPU tensors too, whatever backend the
script's world group has (`init_process_group("nccl")` has none for the CPU)."""
from pipeline.groups import world_group

from .guards import clean_exit  # noqa: F401  (first: its atexit hook then runs after those of the modules below)
from .core.activation_checkpoint import GradientCheckpointConfig
from .booster import Booster
from .plugins.fsdp import GeminiPlugin, TorchFSDPPlugin
from .plugins.low_level_zero import LowLevelZeroPlugin
from .plugins.moe import MoeHybridParallelPlugin
from .core.optimizer import HybridParallelOptimizer
from .core.parallel_module import HybridParallelModule
from .plugins.hybrid import HybridParallelPlugin
from .plugins.base import DPPluginBase, Plugin
from .samplers import StatefulDistributedSampler
from .plugins.torch_ddp import TorchDDPPlugin

__all__ = ["Booster", "Plugin", "DPPluginBase", "HybridParallelPlugin", "MoeHybridParallelPlugin", "LowLevelZeroPlugin",
           "TorchDDPPlugin", "GeminiPlugin", "TorchFSDPPlugin",
           "HybridParallelModule", "HybridParallelOptimizer", "GradientCheckpointConfig", "StatefulDistributedSampler",
           "world_group", "HybridParallelTrainer", "HybridParallelTrainerMixin", "HybridParallelSFTTrainer",
           "HybridParallelDPOTrainer"]

_TRAINER_NAMES = ("HybridParallelTrainer", "HybridParallelTrainerMixin")
_TRL_NAMES = ("HybridParallelSFTTrainer", "HybridParallelDPOTrainer")


def __getattr__(name: str):
    """The Trainer integration, imported on first use (it imports transformers.Trainer and accelerate; the TRL
    trainers import trl)."""
    if name in _TRAINER_NAMES:
        from . import trainer
        return getattr(trainer, name)
    if name in _TRL_NAMES:
        from .trainer import trl
        return getattr(trl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

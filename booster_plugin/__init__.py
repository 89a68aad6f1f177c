"""Booster and HybridParallelPlugin: compose pipeline and shardformer for training."""
from .activation_checkpoint import GradientCheckpointConfig
from .booster import Booster
from .optimizer import HybridParallelOptimizer
from .parallel_module import HybridParallelModule
from .plugin import HybridParallelPlugin
from .samplers import StatefulDistributedSampler

__all__ = ["Booster", "HybridParallelPlugin", "HybridParallelModule", "HybridParallelOptimizer",
           "GradientCheckpointConfig", "StatefulDistributedSampler"]

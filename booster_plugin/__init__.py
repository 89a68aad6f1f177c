"""Booster and HybridParallelPlugin: compose pipeline and shardformer for training."""
from .booster import Booster
from .parallel_module import HybridParallelModule, HybridParallelOptimizer
from .plugin import HybridParallelPlugin

__all__ = ["Booster", "HybridParallelPlugin", "HybridParallelModule", "HybridParallelOptimizer"]

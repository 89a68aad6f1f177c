"""Lazy initialization (ColossalAI's `colossalai.lazy`): build, or `from_pretrained`, a model without its weights;
`boost` reads or initializes each rank's shard only (context.py)."""
from .context import LazyInitContext

__all__ = ["LazyInitContext"]

"""Checkpoints of a boosted model (Hugging Face format, any layout), its optimizer and lr scheduler.

io.py: HybridParallelCheckpointIO, the collective calls; context.py: CheckpointContext, what they know of the plugin.
save.py: the one sequence of every save (prepare, agree, gather, write, commit); jobs.py: error agreement, inline or
background save jobs. model*.py / gather.py, optimizer*.py, lora.py, scheduler.py: what each checkpoint holds.
format.py: safetensors with per-tensor CRC32s, torch-file reader, JSON codecs; reads.py: a load's files and checks;
atomic.py: temporary sibling + swap.
"""
from .context import CheckpointContext
from .io import HybridParallelCheckpointIO
from .jobs import CheckpointError

__all__ = ["CheckpointContext", "CheckpointError", "HybridParallelCheckpointIO"]

"""Checkpoints of a boosted model (Hugging Face format, any layout), its optimizer and lr scheduler.

format.py: safetensors with per-tensor CRC32s, torch-file reader, JSON codecs. atomic.py: temporary sibling + swap.
jobs.py: error agreement across ranks, inline or background save jobs. model.py / optimizer.py: the save and load
logic. io.py: HybridParallelCheckpointIO, the collective calls.
"""
from .io import HybridParallelCheckpointIO
from .jobs import CheckpointError

__all__ = ["CheckpointError", "HybridParallelCheckpointIO"]

"""CheckpointSources: the `WeightSources` (shardformer/lazy_sources.py) of a model loaded lazily from safetensors
files. Each tensor is read when it is materialized, this rank's slice only (`safe_open(...).get_slice`), straight
into the tensor allocated for it; the file is opened for that read and closed after it, so the pages its mapping
touched are released tensor by tensor and the rank's peak stays near its shard."""
from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from shardformer.layer.spec import TPSpec, fill_shard, shard_ranges

from ..checkpoint.format import SafetensorsFile
from ..lora import checkpoint_key

__all__ = ["TensorSource", "CheckpointSources", "same_values"]

_COMPARE_BYTES = 64 * 1024 * 1024  # rows read at a time when comparing two checkpoint tensors


class TensorSource(NamedTuple):
    """A checkpoint tensor: its file and key."""
    path: str
    key: str


class CheckpointSources:
    """{unsharded parameter or buffer name: its checkpoint tensor}. A LoRA model's base weights (`...base_layer.`)
    are found under their module's own name, as the base checkpoint holds them."""

    def __init__(self, entries: Dict[str, TensorSource]) -> None:
        self.entries = dict(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def find(self, names: Sequence[str]) -> Optional[str]:
        for name in names:
            for candidate in (name, checkpoint_key(name)):
                if candidate in self.entries:
                    return candidate
        return None

    def fill(self, name: str, dst: Tensor, spec: Optional[TPSpec], rank: int, world: int) -> None:
        source = self.entries[name]
        f = SafetensorsFile(source.path)
        try:
            shape = f.shape(source.key)
            dim = spec.dim % len(shape) if spec is not None else 0
            expected = _shard_shape(shape, dim, spec, rank, world)
            if tuple(dst.shape) != expected:
                raise ValueError(
                    f"{source.path}: tensor {source.key!r} {list(shape)} gives this rank a shard of {list(expected)}, "
                    f"but its tensor {name!r} here is {list(dst.shape)}: the model was changed after from_pretrained "
                    f"under LazyInitContext, or split in a way lazy loading does not know (expert parallelism)")
            if not shape:  # a scalar
                dst.copy_(f.read(source.key))
                return
            fill_shard(dst, lambda lo, hi: f.read(source.key, dim, lo, hi), shape[dim], dim, spec, rank, world)
        finally:
            f.close()


def _shard_shape(shape: Tuple[int, ...], dim: int, spec: Optional[TPSpec], rank: int, world: int) -> Tuple[int, ...]:
    if spec is None:
        return tuple(shape)
    local = sum(r.stop - r.start + r.padding for r in shard_ranges(spec, shape[dim], rank, world))
    return tuple(local if d == dim else s for d, s in enumerate(shape))


def same_values(a: TensorSource, b: TensorSource) -> bool:
    """Whether two checkpoint tensors hold the same values (what `from_pretrained` checks before tying two weights
    the checkpoint both holds), read a block of rows at a time."""
    fa, fb = SafetensorsFile(a.path), SafetensorsFile(b.path)
    try:
        shape = fa.shape(a.key)
        if shape != fb.shape(b.key):
            return False
        if not shape:
            x = fa.read(a.key)
            return torch.equal(x, fb.read(b.key).to(x.dtype))
        row_bytes = max(1, math.prod(shape[1:]) * 8)
        step = max(1, _COMPARE_BYTES // row_bytes)
        for lo in range(0, shape[0], step):
            hi = min(lo + step, shape[0])
            x, y = fa.read(a.key, 0, lo, hi), fb.read(b.key, 0, lo, hi)
            if not torch.equal(x, y.to(x.dtype)):
                return False
        return True
    finally:
        fa.close()
        fb.close()

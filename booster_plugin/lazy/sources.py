"""The `WeightSources` (shardformer/lazy_sources.py) of models built under LazyInitContext.

CheckpointSources: a model loaded lazily from safetensors files. Each tensor is read when it is materialized, this
rank's slice only (`safe_open(...).get_slice`), straight into the tensor allocated for it; the file is opened for
that read and closed after it, so the pages its mapping touched are released tensor by tensor and the rank's peak
stays near its shard.

InitSources: a model built from a config. Each tensor is drawn again as eager init drew it (tape.py), whole, on the
CPU; this rank's slice is copied and the rest dropped at once: one full tensor at a time besides the shard."""
from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from shardformer.layer.spec import TPSpec, fill_shard, shard_ranges

from ..checkpoint.format import SafetensorsFile
from ..core.lora import checkpoint_key
from .tape import Replay

__all__ = ["TensorSource", "CheckpointSources", "InitSources", "same_values"]

_COMPARE_BYTES = 64 * 1024 * 1024  # rows read at a time when comparing two checkpoint tensors


class TensorSource(NamedTuple):
    """A checkpoint tensor: its file and key."""
    path: str
    key: str


class _NamedSources:
    """{unsharded parameter or buffer name: where its values come from}; `find` also finds a LoRA model's base
    weights (`...base_layer.`) under their module's own name (peft wraps the modules after the model was built)."""

    def __init__(self, entries: Dict[str, object]) -> None:
        self.entries = dict(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def find(self, names: Sequence[str]) -> Optional[str]:
        for name in names:
            for candidate in (name, checkpoint_key(name)):
                if candidate in self.entries:
                    return candidate
        return None


class CheckpointSources(_NamedSources):
    """{unsharded parameter or buffer name: its checkpoint tensor (TensorSource)}."""

    def fill(self, name: str, dst: Tensor, spec: Optional[TPSpec], rank: int, world: int,
             experts: Optional[Tuple[int, int]] = None) -> None:
        if experts is not None:
            raise NotImplementedError(f"{name!r} is split over expert parallelism: from_pretrained under "
                                      f"LazyInitContext does not read expert slices; load it outside the context")
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
                    f"under LazyInitContext, or split in a way lazy loading does not know")
            if not shape:  # a scalar
                dst.copy_(f.read(source.key))
                return
            fill_shard(dst, lambda lo, hi: f.read(source.key, dim, lo, hi), shape[dim], dim, spec, rank, world)
        finally:
            f.close()


class InitSources(_NamedSources):
    """{parameter or buffer name: its record (tape.Ref)} of a model built from a config under LazyInitContext
    (record.py)."""

    def fill(self, name: str, dst: Tensor, spec: Optional[TPSpec], rank: int, world: int,
             experts: Optional[Tuple[int, int]] = None) -> None:
        full = Replay().tensor(self.entries[name])  # eager init's tensor, whole (its draws need the full shape)
        if experts is not None:  # this rank's experts only
            full = full.narrow(0, *experts)
        dim = spec.dim % full.dim() if spec is not None else 0
        expected = _shard_shape(tuple(full.shape), dim, spec, rank, world)
        if tuple(dst.shape) != expected:
            raise ValueError(f"{name!r} was built {list(full.shape)} under LazyInitContext, which gives this rank a "
                             f"shard of {list(expected)}, but it is {list(dst.shape)} here: the model was changed "
                             f"after it was built, or split in a way lazy init does not know")
        if full.dim() == 0:
            dst.copy_(full)
            return
        fill_shard(dst, lambda lo, hi: full.narrow(dim, lo, hi - lo), full.shape[dim], dim, spec, rank, world)


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

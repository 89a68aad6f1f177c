"""File formats: safetensors written tensor by tensor with a CRC32 per tensor, readers for safetensors and
torch.save'd state dicts (weights_only), JSON codecs. Never pickle.

Checksums: the writer stores `{"crc32": "<JSON {tensor name: 8 hex digits}>"}` in the safetensors metadata (the
header is written first with zeros, the data streamed while the CRCs are computed, then the header rewritten in
place: same length). `TensorFile.verify` re-reads a tensor's bytes and compares. Files without that metadata (written
by transformers or other tools) load unverified.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

CHECKSUM_KEY = "crc32"
_READ_CHUNK = 64 * 1024 * 1024

# torch dtype <-> safetensors dtype name; the list index is the code all-reduced when planning a save
DTYPES: List[Tuple[torch.dtype, str]] = [
    (torch.float64, "F64"), (torch.float32, "F32"), (torch.float16, "F16"), (torch.bfloat16, "BF16"),
    (torch.int64, "I64"), (torch.int32, "I32"), (torch.int16, "I16"), (torch.int8, "I8"), (torch.uint8, "U8"),
    (torch.bool, "BOOL"),
]
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPES.append((getattr(torch, _name), _code))
ST_NAME = dict(DTYPES)
TORCH_DTYPE = {v: k for k, v in DTYPES}
DTYPE_CODE = {d: i for i, (d, _) in enumerate(DTYPES)}


@dataclass
class Entry:
    """One tensor of a file: its key, shape and dtype (known before the data, so headers are written first)."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _crc_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _header_bytes(entries: Sequence[Entry], metadata: Dict[str, str], crcs: Dict[str, str]) -> bytes:
    header: Dict[str, Any] = {"__metadata__": {"format": "pt", **metadata,
                                               CHECKSUM_KEY: json.dumps(crcs, separators=(",", ":"))}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": ST_NAME[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(path: str, entries: Sequence[Entry], tensors: Iterator[torch.Tensor],
                      metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a safetensors file whose header is known up front; `tensors` yields the data in `entries` order, so
    at most one tensor is held at a time. Raises (naming the tensor) if a tensor does not match its entry."""
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors stores little-endian data; big-endian hosts are not supported.")
    metadata = metadata or {}
    crcs = {e.name: _crc_hex(0) for e in entries}
    raw = _header_bytes(entries, metadata, crcs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            t = next(tensors, None)
            if t is None:
                raise RuntimeError(f"{path}: no data for tensor {e.name!r}")
            if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                raise RuntimeError(f"{path}: tensor {e.name!r} is {tuple(t.shape)} {t.dtype}, the plan says "
                                   f"{tuple(e.shape)} {e.dtype}")
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            crcs[e.name] = _crc_hex(zlib.crc32(data))
            if data.size:
                f.write(data.data)
        final = _header_bytes(entries, metadata, crcs)
        if len(final) != len(raw):
            raise RuntimeError(f"{path}: header changed length while writing checksums")
        f.seek(8)
        f.write(final)
        f.flush()
        os.fsync(f.fileno())


def write_tensor_file(path: str, entries: Sequence[Entry], tensors: Iterator[torch.Tensor],
                      torch_format: bool = False) -> None:
    """Every save's tensor files: safetensors (write_safetensors), or with `torch_format` a torch.save'd dict of
    plain tensors (it loads with weights_only=True), fsynced."""
    if not torch_format:
        write_safetensors(path, entries, tensors)
        return
    state = {e.name: next(tensors).contiguous() for e in entries}
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


class TensorFile(Protocol):
    """An open checkpoint file: safetensors (sliced lazily) or a torch.save'd state dict."""

    path: str
    checksums: Dict[str, str]  # tensor name -> CRC32 recorded at save (empty for other tools' files)

    def keys(self) -> List[str]: ...
    def shape(self, key: str) -> Tuple[int, ...]: ...
    def read(self, key: str, dim: int = 0, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor: ...
    def verify(self, key: str, expected: str) -> None: ...
    def close(self) -> None: ...


class SafetensorsFile:
    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint file {path} does not exist")
        try:
            self._f = safe_open(path, framework="pt", device="cpu").__enter__()
            meta = self._f.metadata() or {}
            self.checksums: Dict[str, str] = json.loads(meta[CHECKSUM_KEY]) if CHECKSUM_KEY in meta else {}
        except Exception as exc:  # truncated, corrupted header, not a safetensors file
            raise ValueError(f"checkpoint file {path} is corrupted or truncated ({exc})") from None
        self._offsets: Optional[Dict[str, Tuple[int, int]]] = None

    def keys(self) -> List[str]:
        return list(self._f.keys())

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def _slice(self, key: str):
        try:
            return self._f.get_slice(key)
        except Exception as exc:
            raise LookupError(f"{self.path}: cannot read tensor {key!r} ({exc})") from None

    def read(self, key: str, dim: int = 0, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        """The tensor, or entries [start, stop) of it along `dim` (only those bytes are read)."""
        sl = self._slice(key)
        if start is None:
            return self._f.get_tensor(key)
        shape = list(sl.get_shape())
        if stop <= start:
            shape[dim] = 0
            return torch.empty(shape, dtype=TORCH_DTYPE[sl.get_dtype()])
        return sl[tuple(slice(None) for _ in range(dim)) + (slice(start, stop),)]

    def verify(self, key: str, expected: str) -> None:
        """Re-read the tensor's bytes and compare their CRC32 with `expected`; ValueError naming file and tensor."""
        with open(self.path, "rb") as f:
            if self._offsets is None:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
                self._offsets = {k: (8 + length + v["data_offsets"][0], 8 + length + v["data_offsets"][1])
                                 for k, v in header.items() if k != "__metadata__"}
            begin, end = self._offsets[key]
            f.seek(begin)
            crc = 0
            while begin < end:
                chunk = f.read(min(_READ_CHUNK, end - begin))
                if not chunk:
                    break
                crc = zlib.crc32(chunk, crc)
                begin += len(chunk)
        if _crc_hex(crc) != expected:
            raise ValueError(f"{self.path}: tensor {key!r} fails its checksum (crc32 {_crc_hex(crc)}, saved "
                             f"{expected}): the file is corrupted")

    def close(self) -> None:
        try:
            self._f.__exit__(None, None, None)
        except Exception:
            pass


class TorchFile:
    """A `.pt` / `.bin` state dict of plain tensors, loaded with torch.load(weights_only=True): no pickle code runs."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.checksums: Dict[str, str] = {}
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint file {path} does not exist")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ValueError(f"checkpoint file {path} is corrupted or not a state dict of tensors ({exc})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"checkpoint file {path} is not a flat state dict of tensors")
        self._state: Dict[str, torch.Tensor] = state

    def keys(self) -> List[str]:
        return list(self._state)

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self._state[key].shape)

    def read(self, key: str, dim: int = 0, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        t = self._state[key]
        return t.clone() if start is None else t.narrow(dim, start, max(stop - start, 0)).clone()

    def verify(self, key: str, expected: str) -> None:
        """Nothing to compare: torch files carry no checksums of ours (`checksums` is empty)."""

    def close(self) -> None:
        self._state = {}


TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def open_tensor_file(path: str) -> TensorFile:
    return TorchFile(path) if path.endswith(TORCH_SUFFIXES) else SafetensorsFile(path)


def file_checksums(path: str) -> Dict[str, str]:
    """The per-tensor CRC32s recorded in a safetensors file written by write_safetensors (header only)."""
    f = SafetensorsFile(path)
    try:
        return dict(f.checksums)
    finally:
        f.close()


def write_json(path: str, obj: object) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, allow_nan=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path} is missing")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as exc:
        raise ValueError(f"{path} is corrupted ({exc})") from None


def to_json(value: object, what: str) -> Any:
    """Plain JSON for numbers / strings / lists / dicts; tuples and 0-d tensors tagged so they come back exact."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v, what) for v in value]}
    if isinstance(value, list):
        return [to_json(v, what) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: to_json(v, f"{what}.{k}") for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {"__tensor__": value.item(), "dtype": str(value.dtype).replace("torch.", "")}
    raise TypeError(f"{what} is a {type(value).__name__}, which cannot be stored as JSON (checkpoints never pickle).")


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(from_json(v) for v in value["__tuple__"])
        if set(value) == {"__tensor__", "dtype"}:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        return {k: from_json(v) for k, v in value.items()}
    return value

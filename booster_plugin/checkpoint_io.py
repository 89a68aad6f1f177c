"""Checkpoints of a boosted model in Hugging Face format, from and into any (tp, pp, dp) layout.

Model (`save_model` / `load_model`): the full, unsharded model as transformers writes it — `model.safetensors` or
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, `config.json`, `generation_config.json` —
loadable by plain `from_pretrained`. Vocab padding is stripped, fused areas (GPT-2's q|k|v) are reassembled, and
tied targets (e.g. `lm_head.weight`) are not stored (transformers re-ties them). The write plan (which tensor goes
to which file, in which order, written by which rank) is derived on every rank from `module.full_params` and
`policy.stage_of_param`; the only communication besides the tp gathers is one all-reduce of dtype codes, error
flags, and (for a single-file save with pp > 1) point-to-point sends of the gathered tensors to rank 0.
Loading reads, on each rank, only the slices of the tensors it holds (`safe_open(...).get_slice`).

Optimizer (`save_optimizer` / `load_optimizer`): per (stage, tp rank) files keyed by parameter names; loading into
another layout re-shards each state tensor through the parameters' TPSpecs.

LR scheduler: one JSON file.

Never pickle: safetensors and JSON only, written and read.

Atomicity: a save goes into a sibling directory `.<name>.partial`, then rank 0 swaps it in:
`<name>` -> `.<name>.old`, `.<name>.partial` -> `<name>`, delete `.<name>.old`. Crash windows: before the first
rename the old checkpoint is untouched (a left-over `.partial` is removed by the next save and refused by
`load_*`); between the renames only `.<name>.old` exists — `load_*` falls back to it and the next save puts it back
first; after the second rename the new checkpoint is complete and a left-over `.old` is deleted by the next save.
Errors on any rank are agreed on by an all-reduce, so every rank raises the same `CheckpointError` and nothing hangs.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardformer.layer.spec import TPSpec, gather_tensor, get_tp_spec, padded_size, shard_tensor

from .parallel_module import HybridParallelModule, HybridParallelOptimizer

__all__ = ["CheckpointError", "HybridParallelCheckpointIO"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
OPTIMIZER_INDEX_NAME = "optimizer.index.json"
PARTIAL_SUFFIX, BACKUP_SUFFIX = ".partial", ".old"
_MESSAGE_BYTES = 2048

# torch dtype <-> safetensors dtype name; the list index is the code all-reduced when planning a save
_DTYPES: List[Tuple[torch.dtype, str]] = [
    (torch.float64, "F64"), (torch.float32, "F32"), (torch.float16, "F16"), (torch.bfloat16, "BF16"),
    (torch.int64, "I64"), (torch.int32, "I32"), (torch.int16, "I16"), (torch.int8, "I8"), (torch.uint8, "U8"),
    (torch.bool, "BOOL"),
]
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES.append((getattr(torch, _name), _code))
_ST_NAME = dict(_DTYPES)
_TORCH_DTYPE = {v: k for k, v in _DTYPES}
_DTYPE_CODE = {d: i for i, (d, _) in enumerate(_DTYPES)}
# non-persistent buffers that old transformers versions saved: not an "unexpected key" when loading
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "position_ids", "attn.bias", "attn.masked_bias")


# boosted module -> the optimizers boosted with it (bf16 training keeps fp32 master weights there)
_OPTIMIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank. Loading changed nothing."""


# -- safetensors, written by hand so that a file streams tensor by tensor -------------------------------------
@dataclass
class _Entry:
    name: str          # the key in the file (the HF parameter name for models)
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _write_safetensors(path: str, entries: Sequence[_Entry], tensors: Iterator[torch.Tensor],
                       metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a safetensors file whose header is known up front; `tensors` yields the data in `entries` order, so
    at most one tensor is held at a time. Raises (naming the tensor) if a tensor does not match its entry."""
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors stores little-endian data; big-endian hosts are not supported.")
    header: Dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": _ST_NAME[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
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
            if t.numel():
                f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def _open_safetensors(path: str):
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # truncated, corrupted header, not a safetensors file
        raise ValueError(f"checkpoint file {path} is corrupted or truncated ({exc})") from None


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, allow_nan=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# -- atomic directories --------------------------------------------------------------------------------------------
def _siblings(path: str) -> Tuple[str, str, str]:
    path = os.path.abspath(path.rstrip(os.sep) or os.sep)
    parent, name = os.path.split(path)
    return path, os.path.join(parent, f".{name}{PARTIAL_SUFFIX}"), os.path.join(parent, f".{name}{BACKUP_SUFFIX}")


def _prepare_tmp(path: str) -> str:
    """Rank 0: recover from an interrupted swap, remove a stale partial save, create the temporary directory."""
    path, tmp, backup = _siblings(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path} exists and is not a directory; a checkpoint is a directory.")
    if os.path.isdir(backup):
        if os.path.exists(path):  # crashed after the swap: the backup is stale
            shutil.rmtree(backup)
        else:  # crashed between the two renames: the backup is the last complete checkpoint
            os.rename(backup, path)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def _swap_into_place(path: str) -> None:
    """Rank 0, after every file is complete in the temporary directory."""
    path, tmp, backup = _siblings(path)
    _fsync_dir(tmp)
    if os.path.exists(path):
        os.rename(path, backup)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if os.path.exists(backup):
        shutil.rmtree(backup, ignore_errors=True)


def _resolve_dir(path: str) -> str:
    """The directory to read: refuses partial saves; falls back to the backup of an interrupted swap."""
    full, tmp, backup = _siblings(path)
    if os.path.basename(full).startswith(".") and os.path.basename(full).endswith(PARTIAL_SUFFIX):
        raise ValueError(f"{full} is an incomplete checkpoint left by an interrupted save; it cannot be loaded.")
    if os.path.exists(full):
        return full
    if os.path.isdir(backup):
        warnings.warn(f"{full} is missing but {backup} holds the previous complete checkpoint (a save was "
                      f"interrupted while swapping directories); loading that.")
        return backup
    raise FileNotFoundError(f"checkpoint {full} does not exist")


# -- helpers on the boosted model ---------------------------------------------------------------------------------
def _module_of(model) -> HybridParallelModule:
    if isinstance(model, HybridParallelModule):
        return model
    raise TypeError(f"Expected the boosted model (HybridParallelModule) returned by booster.boost(), got "
                    f"{type(model).__name__}.")


def _tied_map(module: HybridParallelModule) -> Dict[str, str]:
    """{tied target: source} among the unsharded parameter names (HF's `all_tied_weights_keys`)."""
    unwrapped = module.unwrap()
    keys = getattr(unwrapped, "all_tied_weights_keys", None)
    if keys is None:
        keys = getattr(unwrapped, "_tied_weights_keys", None) if getattr(unwrapped.config, "tie_word_embeddings",
                                                                          False) else None
    if not isinstance(keys, dict):
        return {}
    full = module.full_params
    return {t: s for t, s in keys.items() if t in full and s in full and t != s}


def _stage_of(module: HybridParallelModule, name: str) -> int:
    """The first pipeline stage holding unsharded parameter `name` (its copy is the one saved)."""
    if module.pp_group is None or module.policy.stage_manager is None:
        return 0
    return module.policy.stage_of_param(name)[0]


def _local_range(spec: TPSpec, size: int, rank: int, world: int) -> List[Tuple[int, int, int]]:
    """For each fused area: (start, stop, padding) along the split dim of the UNPADDED tensor of `size`
    entries that this rank holds; `padding` zero entries follow the real ones (vocab padding)."""
    total = size
    if spec.full_size is not None:
        if spec.full_size != size:
            raise ValueError(f"the model's shard says {spec.full_size} entries along dim {spec.dim}, the tensor has {size}")
        total = spec.padded or padded_size(size, world)
    if total % (spec.n_fused * world):
        raise ValueError(f"size {total} along dim {spec.dim} does not split into {spec.n_fused} x {world}")
    area = total // spec.n_fused
    step = area // world
    out = []
    for a in range(spec.n_fused):
        lo = a * area + rank * step
        hi = lo + step
        rlo, rhi = min(lo, size), min(hi, size)
        out.append((rlo, rhi, step - (rhi - rlo)))
    return out


def _read_shard(sl, shape: Tuple[int, ...], spec: TPSpec, rank: int, world: int) -> torch.Tensor:
    """This rank's shard of a checkpoint tensor, reading only its slices (`sl` is a safetensors slice)."""
    dim = spec.dim % len(shape)
    parts = []
    for lo, hi, pad in _local_range(spec, shape[dim], rank, world):
        if hi > lo:
            index = tuple(slice(None) for _ in range(dim)) + (slice(lo, hi),)
            parts.append(sl[index])
        if pad:
            pshape = list(shape)
            pshape[dim] = pad
            parts.append(torch.zeros(pshape, dtype=_TORCH_DTYPE[sl.get_dtype()]))
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def _unshard(parts: Sequence[torch.Tensor], spec: TPSpec) -> torch.Tensor:
    """The full, unpadded tensor from every tp rank's shard (as spec.gather_tensor, from local tensors)."""
    dim = spec.dim % parts[0].dim()
    step = parts[0].size(dim) // spec.n_fused
    full = torch.cat([p.narrow(dim, a * step, step) for a in range(spec.n_fused) for p in parts], dim=dim)
    if spec.full_size is not None:
        full = full.narrow(dim, 0, spec.full_size)
    return full.contiguous()


def _spec_json(spec: Optional[TPSpec]) -> Optional[List[Any]]:
    return None if spec is None else [spec.dim, spec.n_fused, spec.full_size, spec.padded]


def _spec_from_json(value) -> Optional[TPSpec]:
    return None if value is None else TPSpec(*value)


def _json_value(value: Any, what: str) -> Any:
    """Plain JSON for numbers / strings / lists / dicts; tuples and 0-d tensors tagged so they come back exact."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_json_value(v, what) for v in value]}
    if isinstance(value, list):
        return [_json_value(v, what) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v, f"{what}.{k}") for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {"__tensor__": value.item(), "dtype": str(value.dtype).replace("torch.", "")}
    raise TypeError(f"{what} is a {type(value).__name__}, which cannot be stored as JSON (checkpoints never pickle).")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if set(value) == {"__tensor__", "dtype"}:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        return {k: _from_json(v) for k, v in value.items()}
    return value


class HybridParallelCheckpointIO:
    """Collective checkpoint operations for a HybridParallelPlugin: every rank calls each method."""

    def __init__(self, plugin) -> None:
        self.plugin = plugin

    @staticmethod
    def register_optimizer(model, optimizer) -> None:
        """Remember the optimizer boosted with `model`, so load_model also refreshes its fp32 master weights."""
        if isinstance(optimizer, HybridParallelOptimizer):
            _OPTIMIZERS.setdefault(model, weakref.WeakSet()).add(optimizer)

    # -- collectives ---------------------------------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return getattr(self.plugin, "device", torch.device("cpu"))

    def _agree(self, error: Optional[str], action: str) -> None:
        """Collective: if any rank has an error, every rank raises one CheckpointError listing them all."""
        flag = torch.tensor([1 if error else 0], dtype=torch.int64, device=self._device)
        dist.all_reduce(flag)
        if not flag.item():
            return
        raw = (error or "").encode("utf-8")[:_MESSAGE_BYTES]
        mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if raw:
            mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        parts = [torch.empty(_MESSAGE_BYTES, dtype=torch.uint8, device=self._device)
                 for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine.to(self._device))
        by_message: Dict[str, List[int]] = {}
        for rank, part in enumerate(parts):
            text = bytes(part.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")
            if text:
                by_message.setdefault(text, []).append(rank)
        details = "; ".join(f"[rank {','.join(map(str, ranks))}] {text}" for text, ranks in by_message.items())
        raise CheckpointError(f"{action} failed: {details}")

    def _agree_or_discard(self, error: Optional[str], action: str, tmp: str) -> None:
        """_agree; on failure rank 0 first removes the partial save (the previous checkpoint is untouched)."""
        try:
            self._agree(error, action)
        except CheckpointError:
            if dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    @staticmethod
    def _describe(exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"

    def _writer_rank(self, stage: int) -> int:
        """The global rank that writes a stage's tensors: dp rank 0, tp rank 0 of that stage."""
        return self.plugin.pg_mesh.ravel((0, stage, 0))

    # -- model: save ---------------------------------------------------------------------------------------------
    def _model_plan(self, module: HybridParallelModule) -> Tuple[List[_Entry], Dict[str, int], Dict[str, str]]:
        """(entries in write order: by stage, then HF order; stage of each name; tied map). Collective (dtypes)."""
        tied = _tied_map(module)
        names = [n for n in module.full_params if n not in tied]
        stages = {n: _stage_of(module, n) for n in names}
        my_stage = self.plugin.stage_manager.stage if module.pp_group is not None else 0
        held = dict(module.unwrap().named_parameters(remove_duplicate=False))
        codes = torch.full((len(names),), -1, dtype=torch.int64, device=self._device)
        for i, n in enumerate(names):
            if stages[n] == my_stage and n in held:
                codes[i] = _DTYPE_CODE.get(held[n].dtype, -2)
        dist.all_reduce(codes, op=dist.ReduceOp.MAX)
        codes = codes.tolist()
        entries = []
        for n, code in zip(names, codes):
            if code < 0:
                raise CheckpointError(f"save_model: parameter {n!r} is not held by stage {stages[n]} of any rank "
                                      f"(or has an unsupported dtype); cannot write a complete checkpoint.")
            entries.append(_Entry(n, tuple(module.full_params[n][0]), _DTYPES[code][0]))
        entries.sort(key=lambda e: stages[e.name])  # stable: HF order inside a stage
        return entries, stages, tied

    @staticmethod
    def _file_plan(entries: List[_Entry], stages: Dict[str, int], shard: bool, size_per_shard: float,
                   prefix: Optional[str]) -> List[Tuple[str, List[_Entry]]]:
        """[(file name, its entries)]; a sharded file holds one stage's tensors only (one writer per file)."""
        base = f"{prefix}-" if prefix else ""
        if not shard:
            return [(base + SAFE_WEIGHTS_NAME, entries)]
        limit = max(float(size_per_shard), 0.0) * 1024 * 1024
        files: List[List[_Entry]] = []
        current: List[_Entry] = []
        size, stage = 0, None
        for e in entries:
            if current and (stages[e.name] != stage or size + e.nbytes > limit):
                files.append(current)
                current, size = [], 0
            current.append(e)
            size += e.nbytes
            stage = stages[e.name]
        if current:
            files.append(current)
        n = len(files)
        return [(f"{base}model-{i + 1:05d}-of-{n:05d}.safetensors", f) for i, f in enumerate(files)]

    def _gathered(self, module: HybridParallelModule, entries: Iterable[_Entry], stages: Dict[str, int],
                  writer: int) -> Iterator[torch.Tensor]:
        """Collective stream of full tensors. Every dp-rank-0 rank of a stage gathers its stage's entries over tp;
        the `writer` receives other stages' entries from their stage writers, which send them."""
        rank = dist.get_rank()
        my_stage = self.plugin.stage_manager.stage if module.pp_group is not None else 0
        held = dict(module.unwrap().named_parameters(remove_duplicate=False))
        tp_group = module.tp_group
        for e in entries:
            stage = stages[e.name]
            if stage == my_stage and self.plugin.dp_rank == 0:
                p = held[e.name]
                t = p.detach()
                spec = get_tp_spec(p)
                if spec is not None:
                    if tp_group is not None:
                        t = gather_tensor(t, spec, tp_group)
                    elif spec.full_size is not None:
                        t = t.narrow(spec.dim % t.dim(), 0, spec.full_size)
                source = self._writer_rank(stage)
                if rank == source and writer != rank:
                    dist.send(t.contiguous(), dst=writer)
                yield t
            elif rank == writer:
                t = torch.empty(e.shape, dtype=e.dtype, device=self._device)
                dist.recv(t, src=self._writer_rank(stage))
                yield t

    def save_model(self, model, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: Optional[str] = None, size_per_shard: float = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        module = _module_of(model)
        if use_async:
            raise NotImplementedError("use_async=True is not supported: save_model writes synchronously.")
        if not gather_dtensor:
            raise NotImplementedError("gather_dtensor=False is not supported: models are saved unsharded, in "
                                      "Hugging Face format.")
        # use_safetensors is accepted for ColossalAI compatibility; weights are always safetensors (never pickle)
        entries, stages, _ = self._model_plan(module)
        files = self._file_plan(entries, stages, shard, size_per_shard, prefix)
        rank = dist.get_rank()
        tmp, error = None, None
        if rank == 0:
            try:
                tmp = _prepare_tmp(checkpoint)
            except Exception as exc:
                error = self._describe(exc)
        self._agree(error, f"save_model({checkpoint!r})")
        tmp = _siblings(checkpoint)[1]

        my_stage = self.plugin.stage_manager.stage if module.pp_group is not None else 0
        for file_name, file_entries in files:
            writer = self._writer_rank(stages[file_entries[0].name]) if shard else 0
            takes_part = rank == writer or (self.plugin.dp_rank == 0 and
                                            any(stages[e.name] == my_stage for e in file_entries))
            if not takes_part:
                continue
            stream = self._gathered(module, file_entries, stages, writer)
            if rank == writer and error is None:
                try:
                    _write_safetensors(os.path.join(tmp, file_name), file_entries, stream)
                except Exception as exc:
                    error = self._describe(exc)
            for _ in stream:  # the rest of the collectives, whatever happened to the file
                pass
        self._agree_or_discard(error, f"save_model({checkpoint!r})", tmp)

        if rank == 0:
            try:
                if shard:
                    weight_map = {e.name: name for name, fe in files for e in fe}
                    _write_json(os.path.join(tmp, (f"{prefix}-" if prefix else "") + SAFE_WEIGHTS_INDEX_NAME),
                                {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                                 "weight_map": weight_map})
                self._save_config(module, tmp, entries)
                _swap_into_place(checkpoint)
            except Exception as exc:
                error = self._describe(exc)
                shutil.rmtree(tmp, ignore_errors=True)
        self._agree(error, f"save_model({checkpoint!r})")

    @staticmethod
    def _save_config(module: HybridParallelModule, directory: str, entries: Sequence[_Entry]) -> None:
        import copy

        unwrapped = module.unwrap()
        config = getattr(unwrapped, "config", None)
        if config is None or not hasattr(config, "save_pretrained"):
            return
        config = copy.deepcopy(config)
        floats = [e.dtype for e in entries if e.dtype.is_floating_point]
        if floats:
            config.dtype = max(set(floats), key=floats.count)
        config.architectures = [type(unwrapped).__name__]
        config.save_pretrained(directory)
        generation_config = getattr(unwrapped, "generation_config", None)
        can_generate = getattr(unwrapped, "can_generate", lambda: False)()
        if generation_config is not None and can_generate:
            generation_config.save_pretrained(directory)

    # -- model: load ---------------------------------------------------------------------------------------------
    @staticmethod
    def _model_files(checkpoint: str) -> Tuple[str, Dict[str, str]]:
        """(directory, {tensor name: file name}) of an HF checkpoint: index, single file, or a prefixed variant."""
        if os.path.isfile(checkpoint):
            directory, name = os.path.split(os.path.abspath(checkpoint))
            candidates = [name]
        else:
            directory = _resolve_dir(checkpoint)
            listing = sorted(os.listdir(directory))
            candidates = [SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME]
            candidates += [n for n in listing if n.endswith("-" + SAFE_WEIGHTS_INDEX_NAME)]
            candidates += [n for n in listing if n.endswith("-" + SAFE_WEIGHTS_NAME)]
            candidates = [n for n in candidates if os.path.isfile(os.path.join(directory, n))]
            if not candidates:
                pickled = [n for n in listing if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
                hint = (f"; {pickled} are pickle files, which are never loaded: convert them to safetensors"
                        if pickled else "")
                raise FileNotFoundError(f"{directory} has no {SAFE_WEIGHTS_INDEX_NAME} or {SAFE_WEIGHTS_NAME} "
                                        f"(found {listing[:10]}){hint}")
        first = os.path.join(directory, candidates[0])
        if first.endswith(".json"):
            try:
                with open(first) as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"index file {first} is corrupted ({type(exc).__name__}: {exc})") from None
            for file_name in set(weight_map.values()):
                if os.path.basename(file_name) != file_name:
                    raise ValueError(f"index file {first} names a file outside its directory: {file_name!r}")
            return directory, dict(weight_map)
        if not first.endswith(".safetensors"):
            raise ValueError(f"{first} is not a safetensors file or index (checkpoints never unpickle)")
        with _open_safetensors(first) as f:
            return directory, {k: candidates[0] for k in f.keys()}

    @staticmethod
    def _check_config(module: HybridParallelModule, directory: str) -> None:
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            return
        try:
            with open(path) as f:
                saved = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{path} is corrupted ({exc})") from None
        config = getattr(module.unwrap(), "config", None)
        mine = getattr(config, "model_type", None)
        theirs = saved.get("model_type")
        if mine and theirs and mine != theirs:
            raise ValueError(f"{path}: the checkpoint is a {theirs!r} model ({saved.get('architectures')}), but the "
                             f"boosted model is {mine!r} ({type(module.unwrap()).__name__}).")

    @staticmethod
    def _key_for(name: str, weight_map: Dict[str, str], tied: Dict[str, str], base_prefix: str) -> Optional[str]:
        """The checkpoint key holding parameter `name`: its tie source first, then the name, then with the base
        model's prefix removed or added (a base-model checkpoint for a model with a head, or the reverse)."""
        candidates = ([tied[name]] if name in tied else []) + [name]
        for c in list(candidates):
            if base_prefix and c.startswith(base_prefix + "."):
                candidates.append(c[len(base_prefix) + 1:])
            elif base_prefix:
                candidates.append(f"{base_prefix}.{c}")
        return next((c for c in candidates if c in weight_map), None)

    def _guarded_read(self, read, *args) -> Tuple[Any, Optional[str]]:
        """Run a reader (its last argument: a dict it fills with open safetensors handles); always close the
        handles; return (its result, None) or (None, the error message) for `_agree`."""
        handles: Dict[str, Any] = {}
        try:
            return read(*args, handles), None
        except Exception as exc:
            return None, self._describe(exc)
        finally:
            for h in handles.values():
                try:
                    h.__exit__(None, None, None)
                except Exception:
                    pass

    def load_model(self, model, checkpoint: str, strict: bool = True) -> None:
        module = _module_of(model)
        pending, error = self._guarded_read(self._read_model, module, checkpoint, strict)
        self._agree(error, f"load_model({checkpoint!r})")  # nothing was changed on any rank before this point
        optimizers = list(_OPTIMIZERS.get(module, ()))
        with torch.no_grad():
            for p, t in pending:
                p.copy_(t)
                for opt in optimizers:  # [feat-mem] mixed precision: fp32 masters (ZeRO: this rank's slice) too
                    opt.load_master_weight(p, t)

    def _read_model(self, module: HybridParallelModule, checkpoint: str, strict: bool,
                    handles: Dict[str, Any]) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        directory, weight_map = self._model_files(checkpoint)
        self._check_config(module, directory)
        unwrapped = module.unwrap()
        tied = _tied_map(module)
        base_prefix = getattr(unwrapped, "base_model_prefix", "") or ""
        keys = {n: self._key_for(n, weight_map, tied, base_prefix) for n in module.full_params}
        missing = [n for n, k in keys.items() if k is None]
        if missing and strict:
            raise LookupError(f"{directory}: the checkpoint has no tensor for {len(missing)} parameter(s) of the model: "
                           f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if strict:
            used = set(keys.values())
            unexpected = [k for k in weight_map if k not in used and not k.endswith(_IGNORED_SUFFIXES)]
            if unexpected:
                raise LookupError(f"{directory}: the checkpoint has {len(unexpected)} tensor(s) the model does not: "
                               f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} (use strict=False to skip)")

        tp_group = module.tp_group
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        tp_world = dist.get_world_size(tp_group) if tp_group is not None else 1
        by_id: Dict[int, List[str]] = {}
        params: Dict[int, nn.Parameter] = {}
        for name, p in unwrapped.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
            params[id(p)] = p
        pending = []
        for pid, names in by_id.items():
            name = next((n for n in names if n not in tied), names[0])
            key = keys.get(name)
            if key is None:
                if name not in module.full_params:
                    raise LookupError(f"the boosted model holds {name!r}, which its unsharded layout does not know")
                continue  # strict=False
            p = params[pid]
            path = os.path.join(directory, weight_map[key])
            if path not in handles:
                handles[path] = _open_safetensors(path).__enter__()
            try:
                sl = handles[path].get_slice(key)
            except Exception as exc:
                raise LookupError(f"{path}: cannot read tensor {key!r} ({exc})") from None
            shape = tuple(sl.get_shape())
            expected = tuple(module.full_params[name][0])
            if shape != expected:
                raise ValueError(f"{path}: tensor {key!r} has shape {list(shape)}, but the model's {name!r} has "
                                 f"shape {list(expected)}")
            try:
                spec = get_tp_spec(p)
                local = handles[path].get_tensor(key) if spec is None else _read_shard(sl, shape, spec, tp_rank,
                                                                                       tp_world)
            except Exception as exc:
                raise ValueError(f"{path}: cannot read this rank's slice of tensor {key!r} ({exc})") from None
            if tuple(local.shape) != tuple(p.shape):
                raise ValueError(f"{path}: this rank's slice of {key!r} is {list(local.shape)}, but its shard of "
                                 f"{name!r} is {list(p.shape)}")
            if local.is_floating_point() != p.is_floating_point():
                raise TypeError(f"{path}: tensor {key!r} is {local.dtype}, the model's {name!r} is {p.dtype}")
            pending.append((p, local))
        return pending

    # -- optimizer -----------------------------------------------------------------------------------------------
    @staticmethod
    def _optimizer_parts(optimizer) -> Tuple[HybridParallelModule, torch.optim.Optimizer, Dict[int, str]]:
        if not isinstance(optimizer, HybridParallelOptimizer):
            raise TypeError(f"Expected the boosted optimizer (HybridParallelOptimizer) returned by booster.boost(), "
                            f"got {type(optimizer).__name__}.")
        if hasattr(optimizer, "named_parameters"):
            names = {id(p): n for n, p in optimizer.named_parameters()}
        else:
            names = {id(p): n for n, p in optimizer.model.unwrap().named_parameters()}
        return optimizer.model, optimizer.optim, names

    def _optimizer_file(self, stage: int, tp_rank: int) -> str:
        return f"optimizer-pp{stage:03d}-tp{tp_rank:03d}"

    # [feat-mem] ZeRO: save/load see the optimizer unpartitioned over dp (files are the same for any zero_stage)
    def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                       prefix: Optional[str] = None, size_per_shard: float = 1024) -> None:
        self._optimizer_parts(optimizer)  # type check before any collective
        with optimizer.unpartitioned():
            self._save_optimizer(optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard)

    def load_optimizer(self, optimizer, checkpoint: str) -> None:
        self._optimizer_parts(optimizer)
        with optimizer.unpartitioned(load=True):
            self._load_optimizer(optimizer, checkpoint)

    def _save_optimizer(self, optimizer, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                        prefix: Optional[str] = None, size_per_shard: float = 1024) -> None:
        """Sharded: each (stage, tp rank) of dp replica 0 writes its own state; `shard`, `prefix`,
        `size_per_shard` and `gather_dtensor` are accepted for ColossalAI compatibility and do not change that."""
        module, optim, names = self._optimizer_parts(optimizer)
        plugin = self.plugin
        stage = plugin.stage_manager.stage
        rank = dist.get_rank()
        error = None
        if rank == 0:
            try:
                _prepare_tmp(checkpoint)
            except Exception as exc:
                error = self._describe(exc)
        self._agree(error, f"save_optimizer({checkpoint!r})")
        tmp = _siblings(checkpoint)[1]
        layout = {"tp_size": plugin.tp_size, "pp_size": plugin.pp_size, "dp_size": plugin.dp_size}
        if plugin.dp_rank == 0:
            try:
                master_ids = {id(m) for m in getattr(optimizer, "master_of", {}).values()}
                entries, tensors, groups, scalars, info = [], [], [], {}, {}
                for gi, group in enumerate(optim.param_groups):
                    group_names = []
                    for p in group["params"]:
                        if id(p) not in names:
                            raise LookupError("the optimizer steps a parameter that is not in the boosted model")
                        name = names[id(p)]
                        group_names.append(name)
                        info[name] = {"shape": list(p.shape), "spec": _spec_json(get_tp_spec(p)),
                                      "full_shape": list(module.full_params[name][0]), "group": gi,
                                      "tensors": [], "master": id(p) in master_ids}
                        state = dict(optim.state.get(p, {}))
                        if id(p) in master_ids:
                            state["master"] = p.detach()  # the fp32 weights the optimizer steps
                        for key, value in state.items():
                            if isinstance(value, torch.Tensor) and value.dim() > 0:
                                entries.append(_Entry(f"{name}/{key}", tuple(value.shape), value.dtype))
                                tensors.append(value)
                                info[name]["tensors"].append(key)
                            else:
                                scalars.setdefault(name, {})[key] = _json_value(value, f"state of {name}.{key}")
                    hyper = {k: _json_value(v, f"param_groups[{gi}].{k}") for k, v in group.items() if k != "params"}
                    groups.append({**hyper, "params": group_names})
                base = self._optimizer_file(stage, plugin.tp_rank)
                _write_safetensors(os.path.join(tmp, base + ".safetensors"), entries, iter(tensors))
                _write_json(os.path.join(tmp, base + ".json"), {
                    "layout": layout, "stage": stage, "tp_rank": plugin.tp_rank, "optimizer": type(optim).__name__,
                    "param_groups": groups, "scalars": scalars, "params": info})
            except Exception as exc:
                error = self._describe(exc)
        self._agree_or_discard(error, f"save_optimizer({checkpoint!r})", tmp)
        if rank == 0:
            try:
                files = [self._optimizer_file(s, t) for s in range(plugin.pp_size) for t in range(plugin.tp_size)]
                _write_json(os.path.join(tmp, OPTIMIZER_INDEX_NAME), {
                    "format": "hybrid_parallel.optimizer", "version": 1, "layout": layout,
                    "optimizer": type(optim).__name__, "num_param_groups": len(optim.param_groups), "files": files,
                    **({"loss_scaler": optimizer.scaler.state_dict()} if optimizer.scaler is not None else {})})
                _swap_into_place(checkpoint)
            except Exception as exc:
                error = self._describe(exc)
                shutil.rmtree(tmp, ignore_errors=True)
        self._agree(error, f"save_optimizer({checkpoint!r})")

    def _load_optimizer(self, optimizer, checkpoint: str) -> None:
        """Into the same layout: exact, each rank reads its own file. Into another (tp, pp, layer split): every
        state tensor shaped like its parameter is reassembled from the saved tp shards and re-sharded."""
        module, optim, names = self._optimizer_parts(optimizer)
        result, error = self._guarded_read(self._read_optimizer, optimizer, module, optim, names, checkpoint)
        self._agree(error, f"load_optimizer({checkpoint!r})")
        new_state, hyper, scaler_state = result
        if optimizer.scaler is not None and scaler_state is not None:  # [feat-mem] fp16 loss scale
            optimizer.scaler.load_state_dict(scaler_state)
        with torch.no_grad():
            for group, values in zip(optim.param_groups, hyper):
                group.update(values)
            for p, state in new_state.items():
                master = state.pop("master", None)
                if master is not None:
                    p.copy_(master)
                optim.state.pop(p, None)
                if state:
                    optim.state[p] = state

    def _read_optimizer(self, optimizer, module, optim, names, checkpoint, handles):
        directory = _resolve_dir(checkpoint)
        index_path = os.path.join(directory, OPTIMIZER_INDEX_NAME)
        if not os.path.isfile(index_path):
            raise FileNotFoundError(f"{directory} is not an optimizer checkpoint: {OPTIMIZER_INDEX_NAME} is missing")
        try:
            with open(index_path) as f:
                index = json.load(f)
            old = index["layout"]
            files = index["files"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path} is corrupted ({type(exc).__name__}: {exc})") from None
        if index.get("optimizer") != type(optim).__name__:
            raise ValueError(f"{index_path} holds {index.get('optimizer')} state, this optimizer is "
                             f"{type(optim).__name__}")
        if index.get("num_param_groups") != len(optim.param_groups):
            raise ValueError(f"{index_path} has {index.get('num_param_groups')} param groups, this optimizer has "
                             f"{len(optim.param_groups)}")
        metas = {}
        for base in files:
            path = os.path.join(directory, base + ".json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"optimizer checkpoint file {path} is missing")
            try:
                with open(path) as f:
                    metas[base] = json.load(f)
            except ValueError as exc:
                raise ValueError(f"{path} is corrupted ({exc})") from None
        # where each parameter's state lives: {name: {tp rank: file base}} (first stage that has it)
        where: Dict[str, Dict[int, str]] = {}
        for base, meta in metas.items():
            for name in meta["params"]:
                stages = where.setdefault(name, {})
                holder = next(iter(stages.values()), None)
                if holder is None or metas[holder]["stage"] == meta["stage"]:
                    stages[meta["tp_rank"]] = base
        tied = _tied_map(module)
        aliases: Dict[str, List[str]] = {}
        for target, source in tied.items():
            aliases.setdefault(target, []).append(source)
            aliases.setdefault(source, []).append(target)

        plugin = self.plugin
        tp_rank, tp_world = plugin.tp_rank, plugin.tp_size
        old_tp = old["tp_size"]
        first = metas[files[0]]
        hyper = [{k: _from_json(v) for k, v in g.items() if k != "params"} for g in first["param_groups"]]
        master_ids = {id(m) for m in getattr(optimizer, "master_of", {}).values()}

        def tensor(base: str, key: str) -> torch.Tensor:
            path = os.path.join(directory, base + ".safetensors")
            if path not in handles:
                handles[path] = _open_safetensors(path).__enter__()
            try:
                return handles[path].get_tensor(key)
            except Exception as exc:
                raise LookupError(f"{path}: cannot read tensor {key!r} ({exc})") from None

        new_state: Dict[nn.Parameter, Dict[str, Any]] = {}
        for group in optim.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                found = next((n for n in [name, *aliases.get(name, [])] if n in where), None)
                if found is None:
                    raise LookupError(f"{directory}: no optimizer state saved for parameter {name!r}")
                holders = where[found]
                meta = metas[holders[min(holders)]]
                info = meta["params"][found]
                if info["full_shape"] != list(module.full_params[name][0]):
                    raise ValueError(f"{directory}: optimizer state of {found!r} is for shape {info['full_shape']}, "
                                     f"the model's is {list(module.full_params[name][0])}")
                spec, old_spec = get_tp_spec(p), _spec_from_json(info["spec"])
                same = (old_tp == tp_world and tp_rank in holders and info["shape"] == list(p.shape)
                        and _spec_json(spec) == info["spec"])
                if not same and old_spec is not None and sorted(holders) != list(range(old_tp)):
                    raise FileNotFoundError(f"{directory}: optimizer state of {found!r} lacks some of its "
                                            f"{old_tp} tp shards")
                state: Dict[str, Any] = {}
                for key in info["tensors"]:
                    if key == "master" and id(p) not in master_ids:
                        continue  # saved with bf16 master weights, loaded without: load_model set the weights
                    if same:
                        value = tensor(holders[tp_rank], f"{found}/{key}")
                    else:
                        parts = [tensor(holders[r], f"{found}/{key}") for r in sorted(holders)]
                        if list(parts[0].shape) == info["shape"]:  # shaped like the parameter: re-shard
                            full = _unshard(parts, old_spec) if old_spec is not None else parts[0]
                            value = shard_tensor(full, spec, tp_rank, tp_world) if spec is not None else full
                            if list(value.shape) != list(p.shape):
                                raise ValueError(f"{directory}: {found}/{key} re-sharded is {list(value.shape)}, "
                                                 f"this rank's {name!r} is {list(p.shape)}")
                        else:
                            value = parts[0]
                    state[key] = value.to(p.device)
                for key, value in meta["scalars"].get(found, {}).items():
                    value = _from_json(value)
                    if isinstance(value, torch.Tensor) and (group.get("capturable") or group.get("fused")):
                        value = value.to(p.device)  # else Adam keeps `step` on the CPU
                    state[key] = value
                new_state[p] = state
        return new_state, hyper, index.get("loss_scaler")

    # -- lr scheduler ----------------------------------------------------------------------------------------------
    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        """Rank 0 writes the scheduler's state_dict as JSON (atomically: temporary file, fsync, rename)."""
        error = None
        if dist.get_rank() == 0:
            try:
                state = _json_value(lr_scheduler.state_dict(), f"{type(lr_scheduler).__name__}.state_dict()")
                path = os.path.abspath(checkpoint)
                if os.path.isdir(path):
                    raise IsADirectoryError(f"{path} is a directory; an lr scheduler checkpoint is a JSON file")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{PARTIAL_SUFFIX}")
                _write_json(tmp, {"scheduler": type(lr_scheduler).__name__, "state_dict": state})
                os.replace(tmp, path)
                _fsync_dir(os.path.dirname(path))
            except Exception as exc:
                error = self._describe(exc)
        self._agree(error, f"save_lr_scheduler({checkpoint!r})")

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        error, state = None, None
        try:
            with open(checkpoint) as f:
                saved = json.load(f)
            if saved.get("scheduler") != type(lr_scheduler).__name__:
                raise ValueError(f"{checkpoint} holds a {saved.get('scheduler')} state, the scheduler is a "
                                 f"{type(lr_scheduler).__name__}")
            state = _from_json(saved["state_dict"])
        except Exception as exc:
            error = f"{checkpoint}: {self._describe(exc)}"
        self._agree(error, f"load_lr_scheduler({checkpoint!r})")
        lr_scheduler.load_state_dict(state)

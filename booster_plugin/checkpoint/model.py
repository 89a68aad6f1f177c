"""Model checkpoints: the full, unsharded model in Hugging Face format, from and into any (tp, pp, dp) layout.

Where `save_model` writes (the decision rule):
- `shard=False` and a path ending in `.safetensors`: ONE safetensors file at that path (no config);
  ending in `.pt` / `.pth` / `.bin`: one `torch.save`d dict of plain tensors (loaded with `weights_only=True`).
- any other path: an HF directory — `model.safetensors` (shard=False) or `model-0000i-of-0000n.safetensors` +
  `model.safetensors.index.json` (shard=True), `config.json`, `generation_config.json`; `from_pretrained` loads it.
Vocab padding is stripped, fused areas (GPT-2's q|k|v) reassembled, tied targets not stored (transformers
re-ties them). The write plan is derived on every rank from `module.full_params` and `policy.stage_of_param`; the only
communication besides the tp gathers is one all-reduce of dtype codes and error agreements, plus (single file, pp > 1)
point-to-point sends of the gathered tensors to rank 0. Loading reads on each rank only the slices it holds.
"""
from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardformer.layer.spec import gather_tensor, get_tp_spec, shard_from, unshard

from ..parallel_module import HybridParallelModule
from . import atomic
from . import format as fmt
from .jobs import CheckpointError, SaveJob

if TYPE_CHECKING:
    from .io import HybridParallelCheckpointIO

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
FILE_SUFFIXES = (".safetensors",) + fmt.TORCH_SUFFIXES
# non-persistent buffers that old transformers versions saved: not an "unexpected key" when loading
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "position_ids", "attn.bias", "attn.masked_bias")


def module_of(model) -> HybridParallelModule:
    if isinstance(model, HybridParallelModule):
        return model
    raise TypeError(f"Expected the boosted model (HybridParallelModule) returned by booster.boost(), got "
                    f"{type(model).__name__}.")


def tied_map(module: HybridParallelModule) -> Dict[str, str]:
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


def _key_of(module: HybridParallelModule):
    """Parameter name -> its key in the checkpoint (a LoRA model's base weights under their module's own name)."""
    if module.lora is None:
        return lambda name: name
    from ..lora import checkpoint_key
    return checkpoint_key


def _my_stage(io: "HybridParallelCheckpointIO", module: HybridParallelModule) -> int:
    return io.plugin.stage


def _stage_of(module: HybridParallelModule, name: str) -> int:
    """The first pipeline stage holding unsharded parameter `name` (its copy is the one saved)."""
    if module.pp_group is None or module.policy.stage_manager is None:
        return 0
    return module.policy.stage_of_param(name)[0]


# -- save --------------------------------------------------------------------------------------------------------
def _model_plan(io: "HybridParallelCheckpointIO", module: HybridParallelModule) -> Tuple[List[fmt.Entry], Dict[str, int]]:
    """(entries in write order: by stage, then HF order; stage of each name). Collective (dtypes)."""
    tied = tied_map(module)
    names = [n for n in module.full_params if n not in tied]
    stages = {n: _stage_of(module, n) for n in names}
    my_stage = _my_stage(io, module)
    held = dict(module.unwrap().named_parameters(remove_duplicate=False))
    codes = torch.full((len(names),), -1, dtype=torch.int64, device=io.device)
    for i, n in enumerate(names):
        if stages[n] == my_stage and n in held:
            codes[i] = fmt.DTYPE_CODE.get(held[n].dtype, -2)
    dist.all_reduce(codes, op=dist.ReduceOp.MAX)
    entries = []
    for n, code in zip(names, codes.tolist()):
        if code < 0:
            raise CheckpointError(f"save_model: parameter {n!r} is not held by stage {stages[n]} of any rank "
                                  f"(or has an unsupported dtype); cannot write a complete checkpoint.")
        entries.append(fmt.Entry(n, tuple(module.full_params[n][0]), fmt.DTYPES[code][0]))
    entries.sort(key=lambda e: stages[e.name])  # stable: HF order inside a stage
    return entries, stages


def _file_plan(entries: List[fmt.Entry], stages: Dict[str, int], shard: bool, size_per_shard: float,
               prefix: Optional[str]) -> List[Tuple[str, List[fmt.Entry]]]:
    """[(file name, its entries)]; a sharded file holds one stage's tensors only (one writer per file)."""
    base = f"{prefix}-" if prefix else ""
    if not shard:
        return [(base + SAFE_WEIGHTS_NAME, entries)]
    limit = max(float(size_per_shard), 0.0) * 1024 * 1024
    files: List[List[fmt.Entry]] = []
    current: List[fmt.Entry] = []
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


def _gathered(io: "HybridParallelCheckpointIO", module: HybridParallelModule, entries: Iterable[fmt.Entry],
              stages: Dict[str, int], writer: int, snapshot: bool) -> Iterator[torch.Tensor]:
    """Collective stream of full tensors. Every dp-rank-0 rank of a stage gathers its stage's entries over tp;
    the `writer` receives other stages' entries from their stage writers, which send them. `snapshot`: copies that
    later training steps do not change (for background writes)."""
    rank = dist.get_rank()
    my_stage = _my_stage(io, module)
    held = dict(module.unwrap().named_parameters(remove_duplicate=False))
    for e in entries:
        stage = stages[e.name]
        if stage == my_stage and io.plugin.dp_rank == 0:
            p = held[e.name]
            t = p.detach()
            spec = get_tp_spec(p)
            if spec is not None:
                t = gather_tensor(t, spec, module.tp_group) if module.tp_group is not None else unshard([t], spec)
            source = io.writer_rank(stage)
            if rank == source and writer != rank:
                dist.send(t.contiguous(), dst=writer)
            yield t.clone() if snapshot and rank == writer else t
        elif rank == writer:
            t = torch.empty(e.shape, dtype=e.dtype, device=io.device)
            dist.recv(t, src=io.writer_rank(stage))
            yield t


def gather_on_rank0(io: "HybridParallelCheckpointIO", module: HybridParallelModule,
                    names: Iterable[str]) -> Dict[str, torch.Tensor]:
    """Collective: {name: the full (unsharded, unpadded) tensor} of the unsharded parameters `names` on global rank
    0, from whichever stage and tp ranks hold them; {} on the other ranks."""
    tied = tied_map(module)
    wanted = {n: tied.get(n, n) for n in names}
    entries, stages = _model_plan(io, module)
    entries = [e for e in entries if e.name in set(wanted.values())]
    stream = _gathered(io, module, entries, stages, writer=0, snapshot=True)
    if dist.get_rank() != 0:
        for _ in stream:  # this rank's part of the collectives
            pass
        return {}
    full = {e.name: t for e, t in zip(entries, stream)}
    return {n: full[source] for n, source in wanted.items()}


def _write_file(path: str, entries: Sequence[fmt.Entry], tensors: Iterator[torch.Tensor], torch_format: bool) -> None:
    if not torch_format:
        fmt.write_safetensors(path, entries, tensors)
        return
    state = {e.name: next(tensors).contiguous() for e in entries}  # plain tensors: loads with weights_only=True
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def save_model(io: "HybridParallelCheckpointIO", model, checkpoint: str, shard: bool, gather_dtensor: bool,
               prefix: Optional[str], size_per_shard: float, use_async: bool) -> None:
    module = module_of(model)
    if not gather_dtensor:
        raise NotImplementedError("gather_dtensor=False is not supported: models are saved unsharded.")
    single, torch_format = checkpoint.endswith(FILE_SUFFIXES), checkpoint.endswith(fmt.TORCH_SUFFIXES)
    if single and shard:
        raise ValueError(f"shard=True writes a directory, but {checkpoint!r} names a file; drop the suffix or use "
                         f"shard=False for one file.")
    action = f"save_model({checkpoint!r})"
    entries, stages = _model_plan(io, module)
    files = _file_plan(entries, stages, shard, size_per_shard, prefix)
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            atomic.prepare_file(checkpoint) if single else atomic.prepare_dir(checkpoint)
        except Exception as exc:
            error = io.describe(exc)
    io.agree(error, action)
    tmp = atomic.siblings(checkpoint)[1]

    my_stage = _my_stage(io, module)
    key_of = _key_of(module)
    writers, snapshots = set(), []
    for file_name, file_entries in files:
        writer = io.writer_rank(stages[file_entries[0].name]) if shard else 0
        writers.add(writer)
        if not (rank == writer or (io.plugin.dp_rank == 0 and any(stages[e.name] == my_stage for e in file_entries))):
            continue
        stream = _gathered(io, module, file_entries, stages, writer, snapshot=use_async)
        path = tmp if single else os.path.join(tmp, file_name)
        keyed = [fmt.Entry(key_of(e.name), e.shape, e.dtype) for e in file_entries]
        if rank == writer and error is None:
            try:
                if use_async:
                    snapshots.append((path, keyed, list(stream)))
                else:
                    _write_file(path, keyed, stream, torch_format)
            except Exception as exc:
                error = io.describe(exc)
        for _ in stream:  # the rest of the collectives, whatever happened to the file
            pass

    def write() -> None:
        for path, file_entries, tensors in snapshots:
            _write_file(path, file_entries, iter(tensors), torch_format)

    def commit() -> None:
        if single:
            atomic.replace_file(tmp, checkpoint)
            return
        if shard:
            checksums = {}
            for file_name, _ in files:
                checksums.update(fmt.file_checksums(os.path.join(tmp, file_name)))
            fmt.write_json(os.path.join(tmp, (f"{prefix}-" if prefix else "") + SAFE_WEIGHTS_INDEX_NAME), {
                "metadata": {"total_size": sum(e.nbytes for e in entries)},
                "weight_map": {key_of(e.name): name for name, fe in files for e in fe},
                "checksums": {"algorithm": fmt.CHECKSUM_KEY, "tensors": checksums}})
        _save_config(module, tmp, entries)
        atomic.swap_into_place(checkpoint)

    io.finish(SaveJob(action, tmp, frozenset(writers - {0}), write, commit, error), use_async)


def _save_config(module: HybridParallelModule, directory: str, entries: Sequence[fmt.Entry]) -> None:
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


# -- load --------------------------------------------------------------------------------------------------------
def _model_files(checkpoint: str) -> Tuple[str, Dict[str, str], Dict[str, str], bool]:
    """(directory, {tensor name: file name}, {tensor name: CRC32 from the index}, is a directory) of an HF
    checkpoint: index, single file, a prefixed variant, or one file given by its path."""
    if os.path.isfile(checkpoint):
        directory, name = os.path.split(os.path.abspath(checkpoint))
        if not name.endswith(FILE_SUFFIXES + (".json",)):
            raise ValueError(f"{checkpoint} is not a safetensors, .pt/.bin file or index")
        candidates, is_dir = [name], False
    else:
        directory = atomic.resolve_dir(checkpoint)
        listing = sorted(os.listdir(directory))
        candidates = [SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME]
        candidates += [n for n in listing if n.endswith("-" + SAFE_WEIGHTS_INDEX_NAME)]
        candidates += [n for n in listing if n.endswith("-" + SAFE_WEIGHTS_NAME)]
        candidates = [n for n in candidates if os.path.isfile(os.path.join(directory, n))]
        if not candidates:
            pickled = [n for n in listing if n.endswith(fmt.TORCH_SUFFIXES)]
            hint = f"; to load {pickled[0]} (torch.load, weights_only=True) pass its path" if pickled else ""
            raise FileNotFoundError(f"{directory} has no {SAFE_WEIGHTS_INDEX_NAME} or {SAFE_WEIGHTS_NAME} "
                                    f"(found {listing[:10]}){hint}")
        is_dir = True
    first = os.path.join(directory, candidates[0])
    if first.endswith(".json"):
        try:
            index = fmt.read_json(first, "index file")
            weight_map = dict(index["weight_map"])
            checksums = dict(index.get("checksums", {}).get("tensors", {}))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"index file {first} is corrupted ({type(exc).__name__}: {exc})") from None
        for file_name in set(weight_map.values()):
            if os.path.basename(file_name) != file_name:
                raise ValueError(f"index file {first} names a file outside its directory: {file_name!r}")
        return directory, weight_map, checksums, is_dir
    f = fmt.open_tensor_file(first)
    try:
        return directory, {k: candidates[0] for k in f.keys()}, {}, is_dir
    finally:
        f.close()


def _check_config(module: HybridParallelModule, directory: str) -> None:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return
    saved = fmt.read_json(path, "config")
    config = getattr(module.unwrap(), "config", None)
    mine = getattr(config, "model_type", None)
    theirs = saved.get("model_type")
    if mine and theirs and mine != theirs:
        raise ValueError(f"{path}: the checkpoint is a {theirs!r} model ({saved.get('architectures')}), but the "
                         f"boosted model is {mine!r} ({type(module.unwrap()).__name__}).")


def _key_for(name: str, weight_map: Dict[str, str], tied: Dict[str, str], base_prefix: str,
             key_of=lambda n: n) -> Optional[str]:
    """The checkpoint key holding parameter `name`: its tie source first, then the name (as `key_of` writes it),
    then with the base model's prefix removed or added (a base-model checkpoint for a model with a head, or the
    reverse)."""
    candidates = ([key_of(tied[name])] if name in tied else []) + [key_of(name)]
    for c in list(candidates):
        if base_prefix and c.startswith(base_prefix + "."):
            candidates.append(c[len(base_prefix) + 1:])
        elif base_prefix:
            candidates.append(f"{base_prefix}.{c}")
    return next((c for c in candidates if c in weight_map), None)


def read_model(io: "HybridParallelCheckpointIO", module: HybridParallelModule, checkpoint: str, strict: bool,
               verify: bool, num_threads: int, handles: Dict[str, fmt.TensorFile]) -> List[Tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, this rank's new value) for every parameter; raises, changing nothing, on any problem."""
    directory, weight_map, index_checksums, is_dir = _model_files(checkpoint)
    if is_dir:
        _check_config(module, directory)
    unwrapped = module.unwrap()
    tied = tied_map(module)
    base_prefix = getattr(unwrapped, "base_model_prefix", "") or ""
    keys = {n: _key_for(n, weight_map, tied, base_prefix, _key_of(module)) for n in module.full_params}
    adapters = {n for files in module.lora.adapter_keys.values() for n in files.values()} if module.lora else set()
    if adapters and all(keys[n] is None for n in adapters):  # the base model's checkpoint: adapters stay as they are
        keys = {n: k for n, k in keys.items() if n not in adapters}
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

    tp_rank, tp_world = io.plugin.tp_rank, io.plugin.tp_size
    by_id: Dict[int, List[str]] = {}
    params: Dict[int, nn.Parameter] = {}
    for name, p in unwrapped.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        params[id(p)] = p
    pending, checks = [], {}
    for pid, names in by_id.items():
        name = next((n for n in names if n not in tied), names[0])
        key = keys.get(name)
        if key is None:
            if name in adapters and name not in keys:
                continue
            if name not in module.full_params:
                raise LookupError(f"the boosted model holds {name!r}, which its unsharded layout does not know")
            continue  # strict=False
        p = params[pid]
        path = os.path.join(directory, weight_map[key])
        if path not in handles:
            handles[path] = fmt.open_tensor_file(path)
        f = handles[path]
        shape = f.shape(key)
        expected = tuple(module.full_params[name][0])
        if shape != expected:
            raise ValueError(f"{path}: tensor {key!r} has shape {list(shape)}, but the model's {name!r} has "
                             f"shape {list(expected)}")
        spec = get_tp_spec(p)
        try:
            if spec is None:
                local = f.read(key)
            else:
                dim = spec.dim % len(shape)
                local = shard_from(lambda lo, hi: f.read(key, dim, lo, hi), shape[dim], dim, spec, tp_rank, tp_world)
        except Exception as exc:
            raise ValueError(f"{path}: cannot read this rank's slice of tensor {key!r} ({exc})") from None
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"{path}: this rank's slice of {key!r} is {list(local.shape)}, but its shard of "
                             f"{name!r} is {list(p.shape)}")
        if local.is_floating_point() != p.is_floating_point():
            raise TypeError(f"{path}: tensor {key!r} is {local.dtype}, the model's {name!r} is {p.dtype}")
        crc = fmt.expected_checksum(f, key, index_checksums) if verify else None
        if crc is not None:
            checks[(path, key)] = (f, key, crc)
        pending.append((p, local))
    # the dp x tp ranks of a stage read the same tensors: each verifies its share, the agreement tells the others
    share = io.plugin.dp_size * tp_world
    mine = io.plugin.dp_rank * tp_world + tp_rank
    fmt.verify_all([checks[k] for k in sorted(checks)][mine::share], num_threads)
    return pending

"""read_model: a Hugging Face checkpoint (ours, any safetensors directory or file, a `.pt`/`.bin` state dict) into
the boosted model of any layout, in three steps: locate (which files hold which tensors), validate (which tensor
each parameter takes: strict checks, config), reshard (this rank's slice of each, read and checked). Nothing is
changed here: the caller installs the values once every rank read everything.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import nn

from shardformer.layer.spec import get_tp_spec, shard_from, shard_tensor

from ..core.parallel_module import HybridParallelModule
from .atomic import resolve_dir
from .context import CheckpointContext
from .format import TORCH_SUFFIXES, open_tensor_file, read_json
from .jobs import listed
from .model import FILE_SUFFIXES, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, key_of, tied_map
from .reads import TensorReads

# non-persistent buffers that old transformers versions saved: not an "unexpected key" when loading
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "position_ids", "attn.bias", "attn.masked_bias")


class ModelFiles(NamedTuple):
    """Where a checkpoint's tensors are."""

    directory: str
    weight_map: Dict[str, str]  # tensor key -> file name in `directory`
    checksums: Dict[str, str]   # tensor key -> CRC32 recorded in the index
    is_dir: bool                # the checkpoint is a directory (not one file given by its path)


class Target(NamedTuple):
    """A parameter this rank holds and the checkpoint tensor it takes."""

    name: str            # unsharded parameter name
    key: str             # tensor key in the checkpoint
    param: nn.Parameter  # this rank's shard


def read_model(ctx: CheckpointContext, module: HybridParallelModule, checkpoint: str, strict: bool,
               reads: TensorReads) -> List[Tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, this rank's new value) for every parameter; raises, changing nothing, on any problem."""
    files = locate(checkpoint)
    if files.is_dir:
        _check_config(module, files.directory)
    pending = [(t.param, reshard(ctx, module, files, t, reads)) for t in validate(module, files, strict)]
    # the dp x tp ranks of a stage read the same tensors: each verifies its share, the agreement tells the others
    reads.verify(share=ctx.dp_size * ctx.tp_size, mine=ctx.dp_rank * ctx.tp_size + ctx.tp_rank)
    return pending


# -- locate ------------------------------------------------------------------------------------------------------
def _candidates(checkpoint: str) -> Tuple[str, List[str], bool]:
    """(directory, the files that may describe the checkpoint, best first, is a directory)."""
    if os.path.isfile(checkpoint):
        directory, name = os.path.split(os.path.abspath(checkpoint))
        if not name.endswith(FILE_SUFFIXES + (".json",)):
            raise ValueError(f"{checkpoint} is not a safetensors, .pt/.bin file or index")
        return directory, [name], False
    directory = resolve_dir(checkpoint)
    listing = sorted(os.listdir(directory))
    candidates = [SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME]
    candidates += [n for n in listing if n.endswith("-" + SAFE_WEIGHTS_INDEX_NAME)]
    candidates += [n for n in listing if n.endswith("-" + SAFE_WEIGHTS_NAME)]
    candidates = [n for n in candidates if os.path.isfile(os.path.join(directory, n))]
    if not candidates:
        pickled = [n for n in listing if n.endswith(TORCH_SUFFIXES)]
        hint = f"; to load {pickled[0]} (torch.load, weights_only=True) pass its path" if pickled else ""
        raise FileNotFoundError(f"{directory} has no {SAFE_WEIGHTS_INDEX_NAME} or {SAFE_WEIGHTS_NAME} "
                                f"(found {listing[:10]}){hint}")
    return directory, candidates, True


def locate(checkpoint: str) -> ModelFiles:
    """The files of an HF checkpoint: index, single file, a prefixed variant, or one file given by its path."""
    directory, candidates, is_dir = _candidates(checkpoint)
    first = os.path.join(directory, candidates[0])
    if first.endswith(".json"):
        try:
            index = read_json(first, "index file")
            weight_map = dict(index["weight_map"])
            checksums = dict(index.get("checksums", {}).get("tensors", {}))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"index file {first} is corrupted ({type(exc).__name__}: {exc})") from None
        for file_name in set(weight_map.values()):
            if os.path.basename(file_name) != file_name:
                raise ValueError(f"index file {first} names a file outside its directory: {file_name!r}")
        return ModelFiles(directory, weight_map, checksums, is_dir)
    f = open_tensor_file(first)
    try:
        return ModelFiles(directory, {k: candidates[0] for k in f.keys()}, {}, is_dir)
    finally:
        f.close()


# -- validate ----------------------------------------------------------------------------------------------------
def _check_config(module: HybridParallelModule, directory: str) -> None:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return
    saved = read_json(path, "config")
    config = getattr(module.unwrap(), "config", None)
    mine = getattr(config, "model_type", None)
    theirs = saved.get("model_type")
    if mine and theirs and mine != theirs:
        raise ValueError(f"{path}: the checkpoint is a {theirs!r} model ({saved.get('architectures')}), but the "
                         f"boosted model is {mine!r} ({type(module.unwrap()).__name__}).")


def _key_for(name: str, weight_map: Dict[str, str], tied: Dict[str, str], base_prefix: str,
             keyed_as: Callable[[str], str]) -> Optional[str]:
    """The checkpoint key holding parameter `name`: its tie source first, then the name (as `keyed_as` writes it),
    then with the base model's prefix removed or added (a base-model checkpoint for a model with a head, or the
    reverse)."""
    candidates = ([keyed_as(tied[name])] if name in tied else []) + [keyed_as(name)]
    for c in list(candidates):
        if base_prefix and c.startswith(base_prefix + "."):
            candidates.append(c[len(base_prefix) + 1:])
        elif base_prefix:
            candidates.append(f"{base_prefix}.{c}")
    return next((c for c in candidates if c in weight_map), None)


def _match_keys(module: HybridParallelModule, files: ModelFiles, strict: bool,
                adapters: Set[str]) -> Dict[str, Optional[str]]:
    """{unsharded parameter name: its checkpoint key, None if absent}; adapters are left out of a base model's
    checkpoint (they stay as they are). `strict`: a missing or unexpected tensor is an error."""
    unwrapped = module.unwrap()
    tied = tied_map(module)
    base_prefix = getattr(unwrapped, "base_model_prefix", "") or ""
    keyed_as = key_of(module)
    keys = {n: _key_for(n, files.weight_map, tied, base_prefix, keyed_as) for n in module.full_params}
    if adapters and all(keys[n] is None for n in adapters):  # the base model's checkpoint: adapters stay as they are
        keys = {n: k for n, k in keys.items() if n not in adapters}
    missing = [n for n, k in keys.items() if k is None]
    if missing and strict:
        raise LookupError(f"{files.directory}: the checkpoint has no tensor for {len(missing)} parameter(s) of the "
                          f"model: {listed(missing)}")
    if strict:
        used = set(keys.values())
        unexpected = [k for k in files.weight_map if k not in used and not k.endswith(_IGNORED_SUFFIXES)]
        if unexpected:
            raise LookupError(f"{files.directory}: the checkpoint has {len(unexpected)} tensor(s) the model does not: "
                              f"{listed(unexpected)} (use strict=False to skip)")
    return keys


def validate(module: HybridParallelModule, files: ModelFiles, strict: bool) -> List[Target]:
    """The tensor each parameter this rank holds takes (a tied one: under its untied name); strict=False leaves out
    those the checkpoint lacks."""
    adapters = {n for keys in module.lora.adapter_keys.values() for n in keys.values()} if module.lora else set()
    keys = _match_keys(module, files, strict, adapters)
    tied = tied_map(module)
    by_id: Dict[int, List[str]] = {}
    params: Dict[int, nn.Parameter] = {}
    for name, p in module.unwrap().named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        params[id(p)] = p
    targets = []
    for pid, names in by_id.items():
        name = next((n for n in names if n not in tied), names[0])
        key = keys.get(name)
        if key is not None:
            targets.append(Target(name, key, params[pid]))
        elif name not in module.full_params and not (name in adapters and name not in keys):
            raise LookupError(f"the boosted model holds {name!r}, which its unsharded layout does not know")
    return targets


# -- reshard -----------------------------------------------------------------------------------------------------
def reshard(ctx: CheckpointContext, module: HybridParallelModule, files: ModelFiles, target: Target,
                reads: TensorReads) -> torch.Tensor:
    """This rank's slice of the target's tensor (only its bytes are read), checked against the parameter."""
    name, key, p = target
    path = os.path.join(files.directory, files.weight_map[key])
    f = reads.open(path)
    shape = f.shape(key)
    expected = tuple(module.full_params[name][0])
    if shape != expected:
        raise ValueError(f"{path}: tensor {key!r} has shape {list(shape)}, but the model's {name!r} has "
                         f"shape {list(expected)}")
    spec = get_tp_spec(p)
    try:
        if name in module.info.expert_params:  # this ep rank's experts (dim 0), then its tp shard of them
            local = f.read(key, 0, ctx.ep_rank * p.shape[0], (ctx.ep_rank + 1) * p.shape[0])
            if spec is not None:
                local = shard_tensor(local, spec, ctx.tp_rank, ctx.tp_size)
        elif spec is None:
            local = f.read(key)
        else:
            dim = spec.dim % len(shape)
            local = shard_from(lambda lo, hi: f.read(key, dim, lo, hi), shape[dim], dim, spec, ctx.tp_rank,
                               ctx.tp_size)
    except Exception as exc:
        raise ValueError(f"{path}: cannot read this rank's slice of tensor {key!r} ({exc})") from None
    if tuple(local.shape) != tuple(p.shape):
        raise ValueError(f"{path}: this rank's slice of {key!r} is {list(local.shape)}, but its shard of "
                         f"{name!r} is {list(p.shape)}")
    if local.is_floating_point() != p.is_floating_point():
        raise TypeError(f"{path}: tensor {key!r} is {local.dtype}, the model's {name!r} is {p.dtype}")
    reads.expect(f, key, files.checksums)
    return local

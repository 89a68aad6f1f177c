"""read_optimizer: an optimizer checkpoint into any layout, in three steps: locate (the index and every file's JSON:
where each parameter's state is), validate (state matched to the model by name, param groups by membership),
reshard (each state tensor: this rank's own file in the same layout; in another, shaped like its parameter,
reassembled from the saved tp shards and re-sharded through the TPSpecs). `apply_optimizer` installs the result
once every rank read everything. State for parameters the model does not have is refused (`strict=False`: a
warning naming them).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from shardformer.layer.spec import TPSpec, get_tp_spec, shard_tensor, unshard

from .atomic import resolve_dir
from .context import CheckpointContext
from .format import from_json, read_json
from .jobs import listed
from .model import tied_map
from .optimizer import OptimizerParts, file_names, spec_json
from .optimizer_groups import GroupMember, matched_hyper
from .reads import TensorReads


class Loaded(NamedTuple):
    state: Dict[nn.Parameter, Dict[str, Any]]      # new state of each parameter this rank steps
    hyper: List[Optional[Dict[str, Any]]]          # new hyperparameters of each param group (None: keep)
    warning: Optional[str]                         # strict=False: what was skipped
    loss_scaler: Optional[Dict[str, float]] = None  # fp16: the saved loss scaler's state
    members: Tuple[GroupMember, ...] = ()          # for agree_on_groups: each param group's saved hyperparameters


class SavedOptimizer(NamedTuple):
    """What a checkpoint's index and JSON files say."""

    directory: str
    index: Dict[str, Any]
    tp_size: int                          # of the layout that saved it
    checksums: Dict[str, Dict[str, str]]  # file base -> {tensor key: CRC32}
    metas: Dict[str, Dict[str, Any]]      # file base -> its JSON
    where: Dict[str, Dict[int, str]]      # parameter name -> {tp rank: file base} (of the first stage that has it)


def read_optimizer(ctx: CheckpointContext, parts: OptimizerParts, checkpoint: str, prefix: Optional[str],
                   strict: bool, reads: TensorReads) -> Loaded:
    """The new state and hyperparameters for this rank; raises, changing nothing, on any problem."""
    saved = locate(parts, checkpoint, prefix)
    resolve = _resolver(parts, saved.where)
    problems = _problems(parts, saved.where, resolve)
    if problems and strict:
        raise LookupError(f"{saved.directory}: {'; '.join(problems)} (strict=False skips them)")
    groups = matched_hyper(parts, saved.metas, resolve)
    new_state: Dict[nn.Parameter, Dict[str, Any]] = {}
    for group in parts.optim.param_groups:
        for p in group["params"]:
            found = resolve(parts.names[id(p)])
            if found is not None:  # else (strict=False) its state stays as it is
                new_state[p] = reshard(ctx, parts, saved, reads, p, found, group)
    reads.verify()
    return Loaded(new_state, groups.hyper,
                  f"load_optimizer({checkpoint!r}): {'; '.join(problems)}" if problems else None,
                  saved.index.get("loss_scaler"), tuple(groups.members))


# -- locate ------------------------------------------------------------------------------------------------------
def locate(parts: OptimizerParts, checkpoint: str, prefix: Optional[str]) -> SavedOptimizer:
    directory = resolve_dir(checkpoint)
    index_name = file_names(prefix).index
    index_path = os.path.join(directory, index_name)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"{directory} is not an optimizer checkpoint: {index_name} is missing")
    index = read_json(index_path, "optimizer index")
    try:
        old_tp, files = index["layout"]["tp_size"], index["files"]
        checksums = index.get("checksums", {}).get("files", {})
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index_path} is corrupted ({type(exc).__name__}: {exc})") from None
    mine = type(parts.optim).__name__
    if index.get("optimizer") != mine:
        raise ValueError(f"{index_path} holds {index.get('optimizer')} state, this optimizer is {mine}")
    metas = {base: read_json(os.path.join(directory, base + ".json"), "optimizer checkpoint file") for base in files}
    where: Dict[str, Dict[int, str]] = {}
    for base, meta in metas.items():
        for name in meta["params"]:
            stages = where.setdefault(name, {})
            holder = next(iter(stages.values()), None)
            if holder is None or metas[holder]["stage"] == meta["stage"]:
                stages[meta["tp_rank"]] = base
    return SavedOptimizer(directory, index, old_tp, checksums, metas, where)


# -- validate ----------------------------------------------------------------------------------------------------
def _resolver(parts: OptimizerParts, where: Dict[str, Dict[int, str]]) -> Callable[[str], Optional[str]]:
    """Model parameter name -> the name its state is saved under (its own or a tied one's); None if not saved."""
    aliases: Dict[str, List[str]] = {}
    for target, source in tied_map(parts.module).items():
        aliases.setdefault(target, []).append(source)
        aliases.setdefault(source, []).append(target)

    def resolve(name: str) -> Optional[str]:
        return next((n for n in [name, *aliases.get(name, [])] if n in where), None)

    return resolve


def _problems(parts: OptimizerParts, where: Dict[str, Dict[int, str]],
              resolve: Callable[[str], Optional[str]]) -> List[str]:
    """State for parameters the model does not have; parameters stepped here without saved state."""
    module, optim, names, _ = parts
    problems = []
    unexpected = sorted(set(where) - set(module.full_params))
    if unexpected:
        problems.append(f"the checkpoint has state for {len(unexpected)} parameter(s) the model does not have: "
                        f"{listed(unexpected)}")
    missing = sorted({names[id(p)] for g in optim.param_groups for p in g["params"] if resolve(names[id(p)]) is None})
    if missing:
        problems.append(f"no optimizer state saved for {len(missing)} parameter(s): {listed(missing)}")
    return problems


# -- reshard -----------------------------------------------------------------------------------------------------
def _tensor(saved: SavedOptimizer, reads: TensorReads, base: str, key: str) -> torch.Tensor:
    f = reads.open(os.path.join(saved.directory, base + ".safetensors"))
    reads.expect(f, key, saved.checksums.get(base, {}))
    return f.read(key)


def reshard(ctx: CheckpointContext, parts: OptimizerParts, saved: SavedOptimizer, reads: TensorReads,
            p: nn.Parameter, found: str, group: Dict[str, Any]) -> Dict[str, Any]:
    """The new state of stepped parameter `p`, saved under `found`, for this rank's shard of it."""
    name = parts.names[id(p)]
    holders = saved.where[found]
    meta = saved.metas[holders[min(holders)]]
    info = meta["params"][found]
    full_shape = list(parts.module.full_params[name][0])
    if info["full_shape"] != full_shape:
        raise ValueError(f"{saved.directory}: optimizer state of {found!r} is for shape {info['full_shape']}, "
                         f"the model's is {full_shape}")
    spec = get_tp_spec(p)
    old_spec = None if info["spec"] is None else TPSpec(*info["spec"])
    same = (saved.tp_size == ctx.tp_size and ctx.tp_rank in holders and info["shape"] == list(p.shape)
            and spec_json(spec) == info["spec"])
    if not same and old_spec is not None and sorted(holders) != list(range(saved.tp_size)):
        raise FileNotFoundError(f"{saved.directory}: optimizer state of {found!r} lacks some of its {saved.tp_size} "
                                f"tp shards")
    state: Dict[str, Any] = {}
    for key in info["tensors"]:
        if key == "master" and id(p) not in parts.master_ids:
            continue  # saved with bf16 master weights, loaded without: load_model set the weights
        if same:
            value = _tensor(saved, reads, holders[ctx.tp_rank], f"{found}/{key}")
        else:
            shards = [_tensor(saved, reads, holders[r], f"{found}/{key}") for r in sorted(holders)]
            if list(shards[0].shape) == info["shape"]:  # shaped like the parameter: re-shard
                full = unshard(shards, old_spec) if old_spec is not None else shards[0]
                if name in parts.module.info.expert_params:  # saved with every expert: this ep rank's
                    full = full.narrow(0, ctx.ep_rank * p.shape[0], p.shape[0])
                value = shard_tensor(full, spec, ctx.tp_rank, ctx.tp_size) if spec is not None else full
                if list(value.shape) != list(p.shape):
                    raise ValueError(f"{saved.directory}: {found}/{key} re-sharded is {list(value.shape)}, this "
                                     f"rank's {name!r} is {list(p.shape)}")
            else:
                value = shards[0]
        state[key] = value.to(p.device)
    for key, value in meta["scalars"].get(found, {}).items():
        value = from_json(value)
        if isinstance(value, torch.Tensor) and (group.get("capturable") or group.get("fused")):
            value = value.to(p.device)  # else Adam keeps `step` on the CPU
        state[key] = value
    return state


def apply_optimizer(optim: torch.optim.Optimizer, loaded: Loaded) -> None:
    """Install what read_optimizer validated (after every rank agreed)."""
    if loaded.warning:
        warnings.warn(loaded.warning)
    with torch.no_grad():
        for group, values in zip(optim.param_groups, loaded.hyper):
            if values is not None:
                group.update(values)
        for p, state in loaded.state.items():
            master = state.pop("master", None)
            if master is not None:
                p.copy_(master)
            optim.state.pop(p, None)
            if state:
                optim.state[p] = state

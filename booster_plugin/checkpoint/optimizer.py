"""Optimizer checkpoints: one safetensors + JSON file per (stage, tp rank) of dp replica 0, keyed by parameter
names, and `optimizer.index.json` (layout, files, per-tensor CRC32s).

Loading into the same layout is exact (each rank reads its own file); into another (tp, pp, layer split) every state
tensor shaped like its parameter is reassembled from the saved tp shards and re-sharded through the TPSpecs.
Hyperparameters are matched by name: each current param group takes those of the saved group its parameters were
in (refused if they were in groups with different hyperparameters, over the parameters of every pipeline stage).
State for parameters the model does not have is refused (`strict=False`: a warning naming them).
"""
from __future__ import annotations

import json
import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardformer.layer.spec import TPSpec, get_tp_spec, shard_tensor, unshard

from ..optimizer import HybridParallelOptimizer
from ..parallel_module import HybridParallelModule
from . import atomic
from . import format as fmt
from .jobs import SaveJob
from .model import tied_map

if TYPE_CHECKING:
    from .io import HybridParallelCheckpointIO

OPTIMIZER_INDEX_NAME = "optimizer.index.json"


class OptimizerParts(NamedTuple):
    module: HybridParallelModule
    optim: torch.optim.Optimizer
    names: Dict[int, str]  # id(stepped parameter) -> model parameter name
    master_ids: set        # ids of fp32 master copies (bf16 training)


def optimizer_parts(optimizer) -> OptimizerParts:
    if not isinstance(optimizer, HybridParallelOptimizer):
        raise TypeError(f"Expected the boosted optimizer (HybridParallelOptimizer) returned by booster.boost(), "
                        f"got {type(optimizer).__name__}.")
    names = {id(p): n for n, p in optimizer.named_parameters()}
    master_ids = {id(m) for m in getattr(optimizer, "master_of", {}).values()}
    return OptimizerParts(optimizer.model, optimizer.optim, names, master_ids)


def _spec_json(spec: Optional[TPSpec]) -> Optional[List[Any]]:
    return None if spec is None else [spec.dim, spec.n_fused, spec.full_size, spec.padded]


def _names(prefix: Optional[str]) -> Tuple[str, str]:
    """(index file name, per-rank file base format) for a prefix."""
    base = f"{prefix}-" if prefix else ""
    return base + OPTIMIZER_INDEX_NAME, base + "optimizer-pp{:03d}-tp{:03d}"


# -- save --------------------------------------------------------------------------------------------------------
def _snapshot(parts: OptimizerParts, snapshot: bool) -> Tuple[List[fmt.Entry], List[torch.Tensor], Dict[str, Any]]:
    """(entries, tensors, JSON of groups / scalars / parameter info) of this rank's optimizer state."""
    module, optim, names, master_ids = parts
    entries, tensors, groups, scalars, info = [], [], [], {}, {}
    for gi, group in enumerate(optim.param_groups):
        group_names = []
        for p in group["params"]:
            if id(p) not in names:
                raise LookupError("the optimizer steps a parameter that is not in the boosted model")
            name = names[id(p)]
            group_names.append(name)
            info[name] = {"shape": list(p.shape), "spec": _spec_json(get_tp_spec(p)),
                          "full_shape": list(module.full_params[name][0]), "group": gi, "tensors": [],
                          "master": id(p) in master_ids}
            state = dict(optim.state.get(p, {}))
            if id(p) in master_ids:
                state["master"] = p.detach()  # the fp32 weights the optimizer steps
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    entries.append(fmt.Entry(f"{name}/{key}", tuple(value.shape), value.dtype))
                    tensors.append(value.detach().clone() if snapshot else value)
                    info[name]["tensors"].append(key)
                else:
                    scalars.setdefault(name, {})[key] = fmt.to_json(value, f"state of {name}.{key}")
        hyper = {k: fmt.to_json(v, f"param_groups[{gi}].{k}") for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": group_names})
    return entries, tensors, {"param_groups": groups, "scalars": scalars, "params": info}


def save_optimizer(io: "HybridParallelCheckpointIO", optimizer, checkpoint: str, prefix: Optional[str],
                   use_async: bool) -> None:
    parts = optimizer_parts(optimizer)
    plugin = io.plugin
    action = f"save_optimizer({checkpoint!r})"
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            atomic.prepare_dir(checkpoint)
        except Exception as exc:
            error = io.describe(exc)
    io.agree(error, action)
    tmp = atomic.siblings(checkpoint)[1]
    index_name, base_format = _names(prefix)
    layout = {"tp_size": plugin.tp_size, "pp_size": plugin.pp_size, "dp_size": plugin.dp_size}
    stage = plugin.stage
    base = base_format.format(stage, plugin.tp_rank)
    entries, tensors, meta = [], [], None
    if plugin.dp_rank == 0:
        try:
            entries, tensors, meta = _snapshot(parts, snapshot=use_async)
            meta = {"layout": layout, "stage": stage, "tp_rank": plugin.tp_rank,
                    "optimizer": type(parts.optim).__name__, **meta}
        except Exception as exc:
            error = io.describe(exc)

    def write() -> None:
        if meta is not None:
            fmt.write_safetensors(os.path.join(tmp, base + ".safetensors"), entries, iter(tensors))
            fmt.write_json(os.path.join(tmp, base + ".json"), meta)

    files = [base_format.format(s, t) for s in range(plugin.pp_size) for t in range(plugin.tp_size)]

    scaler_state = optimizer.scaler.state_dict() if optimizer.scaler is not None else None

    def commit() -> None:
        checksums = {f: fmt.file_checksums(os.path.join(tmp, f + ".safetensors")) for f in files}
        fmt.write_json(os.path.join(tmp, index_name), {
            "format": "hybrid_parallel.optimizer", "version": 2, "layout": layout,
            "optimizer": type(parts.optim).__name__, "num_param_groups": len(parts.optim.param_groups),
            "files": files, "checksums": {"algorithm": fmt.CHECKSUM_KEY, "files": checksums},
            **({"loss_scaler": scaler_state} if scaler_state is not None else {})})
        atomic.swap_into_place(checkpoint)

    writers = {plugin.pg_mesh.ravel((0, s, t)) for s in range(plugin.pp_size) for t in range(plugin.tp_size)}
    io.finish(SaveJob(action, tmp, frozenset(writers - {0}), write, commit, error), use_async)


# -- load --------------------------------------------------------------------------------------------------------
class GroupMember(NamedTuple):
    """Of a current param group on this rank: which saved hyperparameters it takes (an index into the checkpoint's
    distinct ones, the same on every rank) and for which parameter (an index into the sorted model parameter names);
    -1, -1 for a group without saved state here."""
    hyper: int
    param: int


class Loaded(NamedTuple):
    state: Dict[nn.Parameter, Dict[str, Any]]      # new state of each parameter this rank steps
    hyper: List[Optional[Dict[str, Any]]]          # new hyperparameters of each param group (None: keep)
    warning: Optional[str]                         # strict=False: what was skipped
    loss_scaler: Optional[Dict[str, Any]] = None   # fp16: the saved loss scaler's state
    members: Tuple[GroupMember, ...] = ()          # for agree_on_groups: each param group's saved hyperparameters


def _matched_hyper(parts: OptimizerParts, metas: Dict[str, Any],
                   resolve) -> Tuple[List[Optional[Dict[str, Any]]], List[GroupMember]]:
    """For each current param group: the hyperparameters of the saved group its parameters were in (this stage's
    parameters; `agree_on_groups` then compares the stages)."""
    saved: Dict[str, Dict[str, Any]] = {}
    for meta in metas.values():
        for g in meta["param_groups"]:
            hyper = {k: v for k, v in g.items() if k != "params"}
            for n in g["params"]:
                saved.setdefault(n, hyper)
    distinct = sorted({json.dumps(h, sort_keys=True) for h in saved.values()})
    param_index = {n: i for i, n in enumerate(sorted(parts.module.full_params))}
    out, members = [], []
    for gi, group in enumerate(parts.optim.param_groups):
        chosen, first = None, None
        for p in group["params"]:
            found = resolve(parts.names[id(p)])
            if found not in saved:
                continue
            if chosen is None:
                chosen, first = saved[found], found
            elif saved[found] != chosen:
                raise ValueError(f"param group {gi} holds {first!r} and {found!r}, which the checkpoint has in "
                                 f"groups with different hyperparameters; group the parameters as when saving")
        out.append(None if chosen is None else {k: fmt.from_json(v) for k, v in chosen.items()})
        members.append(GroupMember(-1, -1) if chosen is None else GroupMember(
            distinct.index(json.dumps(chosen, sort_keys=True)), param_index.get(first, -1)))
    return out, members


def agree_on_groups(parts: OptimizerParts, loaded: "Loaded", stage: int, device: torch.device) -> Optional[str]:
    """Collective: the error (the same on every rank) if a param group takes different saved hyperparameters on
    different pipeline stages, i.e. regroups the checkpoint's groups over the whole model; None if none does.

    An all-reduce of the group count, then one all-gather of [stage, (hyper, param) per group] per rank."""
    count = torch.tensor([len(loaded.members), -len(loaded.members)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    most, fewest = int(count[0]), -int(count[1])
    if most != fewest:
        return (f"the optimizer has {fewest} param groups on some ranks and {most} on others: build it the same "
                f"way on every rank")
    mine = torch.tensor([stage, *(v for m in loaded.members for v in m)], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    rows = [r.tolist() for r in rows]
    names = sorted(parts.module.full_params)
    for gi in range(most):
        held = [(r[0], GroupMember(*r[1 + 2 * gi:3 + 2 * gi])) for r in rows]
        held = [(s, m) for s, m in held if m.hyper >= 0]
        conflict = next(((s, m) for s, m in held if m.hyper != held[0][1].hyper), None)
        if conflict is not None:
            (s0, m0), (s1, m1) = held[0], conflict
            return (f"param group {gi} holds {_name(names, m0.param)} (pipeline stage {s0}) and "
                    f"{_name(names, m1.param)} (pipeline stage {s1}), which the checkpoint has in groups with "
                    f"different hyperparameters; group the parameters as when saving")
    return None


def _name(names: List[str], index: int) -> str:
    return repr(names[index]) if index >= 0 else "a parameter"


def read_optimizer(io: "HybridParallelCheckpointIO", parts: OptimizerParts, checkpoint: str, prefix: Optional[str],
                   strict: bool, verify: bool, num_threads: int, handles: Dict[str, fmt.TensorFile]) -> Loaded:
    module, optim, names, master_ids = parts
    directory = atomic.resolve_dir(checkpoint)
    index_name, _ = _names(prefix)
    index_path = os.path.join(directory, index_name)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"{directory} is not an optimizer checkpoint: {index_name} is missing")
    index = fmt.read_json(index_path, "optimizer index")
    try:
        old_tp, files = index["layout"]["tp_size"], index["files"]
        index_checksums = index.get("checksums", {}).get("files", {})
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index_path} is corrupted ({type(exc).__name__}: {exc})") from None
    if index.get("optimizer") != type(optim).__name__:
        raise ValueError(f"{index_path} holds {index.get('optimizer')} state, this optimizer is {type(optim).__name__}")
    metas = {base: fmt.read_json(os.path.join(directory, base + ".json"), "optimizer checkpoint file")
             for base in files}
    # where each parameter's state lives: {name: {tp rank: file base}} (first stage that has it)
    where: Dict[str, Dict[int, str]] = {}
    for base, meta in metas.items():
        for name in meta["params"]:
            stages = where.setdefault(name, {})
            holder = next(iter(stages.values()), None)
            if holder is None or metas[holder]["stage"] == meta["stage"]:
                stages[meta["tp_rank"]] = base
    aliases: Dict[str, List[str]] = {}
    for target, source in tied_map(module).items():
        aliases.setdefault(target, []).append(source)
        aliases.setdefault(source, []).append(target)

    def resolve(name: str) -> Optional[str]:
        return next((n for n in [name, *aliases.get(name, [])] if n in where), None)

    problems = []
    unexpected = sorted(set(where) - set(module.full_params))
    if unexpected:
        problems.append(f"the checkpoint has state for {len(unexpected)} parameter(s) the model does not have: "
                        f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    missing = sorted({names[id(p)] for g in optim.param_groups for p in g["params"] if resolve(names[id(p)]) is None})
    if missing:
        problems.append(f"no optimizer state saved for {len(missing)} parameter(s): {missing[:8]}"
                        f"{' ...' if len(missing) > 8 else ''}")
    if problems and strict:
        raise LookupError(f"{directory}: {'; '.join(problems)} (strict=False skips them)")
    hyper, members = _matched_hyper(parts, metas, resolve)
    tp_rank, tp_world = io.plugin.tp_rank, io.plugin.tp_size
    checks: Dict[Tuple[str, str], Tuple[fmt.TensorFile, str, str]] = {}

    def tensor(base: str, key: str) -> torch.Tensor:
        path = os.path.join(directory, base + ".safetensors")
        if path not in handles:
            handles[path] = fmt.open_tensor_file(path)
        f = handles[path]
        crc = fmt.expected_checksum(f, key, index_checksums.get(base, {})) if verify else None
        if crc is not None:
            checks[(path, key)] = (f, key, crc)
        return f.read(key)

    new_state: Dict[nn.Parameter, Dict[str, Any]] = {}
    for group in optim.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            found = resolve(name)
            if found is None:
                continue  # strict=False: its state stays as it is
            holders = where[found]
            meta = metas[holders[min(holders)]]
            info = meta["params"][found]
            if info["full_shape"] != list(module.full_params[name][0]):
                raise ValueError(f"{directory}: optimizer state of {found!r} is for shape {info['full_shape']}, "
                                 f"the model's is {list(module.full_params[name][0])}")
            spec = get_tp_spec(p)
            old_spec = None if info["spec"] is None else TPSpec(*info["spec"])
            same = (old_tp == tp_world and tp_rank in holders and info["shape"] == list(p.shape)
                    and _spec_json(spec) == info["spec"])
            if not same and old_spec is not None and sorted(holders) != list(range(old_tp)):
                raise FileNotFoundError(f"{directory}: optimizer state of {found!r} lacks some of its {old_tp} tp "
                                        f"shards")
            state: Dict[str, Any] = {}
            for key in info["tensors"]:
                if key == "master" and id(p) not in master_ids:
                    continue  # saved with bf16 master weights, loaded without: load_model set the weights
                if same:
                    value = tensor(holders[tp_rank], f"{found}/{key}")
                else:
                    shards = [tensor(holders[r], f"{found}/{key}") for r in sorted(holders)]
                    if list(shards[0].shape) == info["shape"]:  # shaped like the parameter: re-shard
                        full = unshard(shards, old_spec) if old_spec is not None else shards[0]
                        value = shard_tensor(full, spec, tp_rank, tp_world) if spec is not None else full
                        if list(value.shape) != list(p.shape):
                            raise ValueError(f"{directory}: {found}/{key} re-sharded is {list(value.shape)}, this "
                                             f"rank's {name!r} is {list(p.shape)}")
                    else:
                        value = shards[0]
                state[key] = value.to(p.device)
            for key, value in meta["scalars"].get(found, {}).items():
                value = fmt.from_json(value)
                if isinstance(value, torch.Tensor) and (group.get("capturable") or group.get("fused")):
                    value = value.to(p.device)  # else Adam keeps `step` on the CPU
                state[key] = value
            new_state[p] = state
    fmt.verify_all(list(checks.values()), num_threads)
    return Loaded(new_state, hyper, f"load_optimizer({checkpoint!r}): {'; '.join(problems)}" if problems else None,
                  index.get("loss_scaler"), tuple(members))


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

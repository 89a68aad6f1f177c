"""save_optimizer: dp rank 0 of each (stage, tp rank) writes its optimizer state (safetensors: the tensors; JSON:
param groups, scalars, each parameter's shapes and TPSpec); rank 0 writes `optimizer.index.json` and swaps."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from shardformer.layer.spec import get_tp_spec

from ..core.optimizer import HybridParallelOptimizer
from .atomic import swap_into_place
from .context import CheckpointContext
from .gather import gather_experts
from .format import CHECKSUM_KEY, Entry, file_checksums, to_json, write_json, write_tensor_file
from .jobs import describe
from .optimizer import FileNames, OptimizerParts, file_names, optimizer_parts, spec_json
from .save import LocalPhase, collective_save


class Snapshot(NamedTuple):
    """This rank's optimizer state, as its files hold it."""

    entries: List[Entry]
    tensors: List[torch.Tensor]
    meta: Dict[str, Any]  # the JSON: header (layout, stage, tp rank, optimizer), param groups, scalars, parameters


def save_optimizer(ctx: CheckpointContext, optimizer: HybridParallelOptimizer, checkpoint: str,
                   prefix: Optional[str], use_async: bool) -> None:
    parts = optimizer_parts(optimizer)
    names = file_names(prefix)
    scaler = optimizer.scaler

    def collect(tmp: str) -> LocalPhase:
        scaler_state = scaler.state_dict() if scaler is not None else None
        commit = functools.partial(_commit, ctx, parts, names, scaler_state, checkpoint, tmp)
        return _snapshot_files(ctx, parts, names, tmp, use_async, commit)

    collective_save(ctx, f"save_optimizer({checkpoint!r})", checkpoint, collect, use_async=use_async)


def _layout(ctx: CheckpointContext) -> Dict[str, int]:
    return {"tp_size": ctx.tp_size, "pp_size": ctx.num_stages, "dp_size": ctx.dp_size}


def _snapshot_files(ctx: CheckpointContext, parts: OptimizerParts, names: FileNames, tmp: str, use_async: bool,
                    commit: Callable[[], None]) -> LocalPhase:
    """dp rank 0: this (stage, tp rank)'s state (copies if `use_async`), and the write of its two files. Expert
    parameters' state is saved whole (every expert), gathered over the ep ranks of moe_dp rank 0."""
    base = os.path.join(tmp, names.base.format(ctx.stage, ctx.tp_rank))
    snapshot, error = None, None
    if ctx.gathers(expert=True):  # (dp rank 0, and without ep the only one)
        try:
            header = {"layout": _layout(ctx), "stage": ctx.stage, "tp_rank": ctx.tp_rank,
                      "optimizer": type(parts.optim).__name__}
            snapshot = _snapshot(parts, header, copy=use_async, ep_group=ctx.ep_group)
        except Exception as exc:
            error = describe(exc)

    def write() -> None:
        if snapshot is not None and ctx.writes:
            write_tensor_file(base + ".safetensors", snapshot.entries, iter(snapshot.tensors))
            write_json(base + ".json", snapshot.meta)

    writers = frozenset(w for stage_writers in ctx.stage_writers for w in stage_writers)
    return LocalPhase(commit, write, writers, error)


def _snapshot(parts: OptimizerParts, header: Dict[str, Any], copy: bool,
              ep_group: Optional[dist.ProcessGroup] = None) -> Snapshot:
    """This rank's optimizer state: tensors (copies that later steps do not change if `copy`) and JSON (`header`
    first). Expert parameters' tensors are gathered over `ep_group` (collective), so the files hold every expert."""
    module, optim, names, master_ids = parts
    experts = module.info.expert_params
    entries, tensors, groups, scalars = [], [], [], {}
    info: Dict[str, Dict[str, Any]] = {}  # the JSON of each parameter
    for gi, group in enumerate(optim.param_groups):
        group_names = []
        for p in group["params"]:
            if id(p) not in names:
                raise LookupError("the optimizer steps a parameter that is not in the boosted model")
            name = names[id(p)]
            group_names.append(name)
            whole = name in experts and ep_group is not None
            shape = [p.shape[0] * dist.get_world_size(ep_group), *p.shape[1:]] if whole else list(p.shape)
            info[name] = {"shape": shape, "spec": spec_json(get_tp_spec(p)),
                          "full_shape": list(module.full_params[name][0]), "group": gi, "tensors": [],
                          "master": id(p) in master_ids}
            state = dict(optim.state.get(p, {}))
            if id(p) in master_ids:
                state["master"] = p.detach()  # the fp32 weights the optimizer steps
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if whole and value.shape == p.shape:
                        value = gather_experts(value.detach(), ep_group)
                    entries.append(Entry(f"{name}/{key}", tuple(value.shape), value.dtype))
                    tensors.append(value.detach().clone() if copy else value)
                    info[name]["tensors"].append(key)
                else:
                    scalars.setdefault(name, {})[key] = to_json(value, f"state of {name}.{key}")
        hyper = {k: to_json(v, f"param_groups[{gi}].{k}") for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": group_names})
    return Snapshot(entries, tensors, {**header, "param_groups": groups, "scalars": scalars, "params": info})


def _commit(ctx: CheckpointContext, parts: OptimizerParts, names: FileNames, scaler_state: Optional[Dict[str, float]],
            checkpoint: str, tmp: str) -> None:
    """Rank 0, once every file is written: the index (layout, files, checksums, loss scaler), then the swap."""
    files = [names.base.format(s, t) for s in range(ctx.num_stages) for t in range(ctx.tp_size)]
    checksums = {f: file_checksums(os.path.join(tmp, f + ".safetensors")) for f in files}
    write_json(os.path.join(tmp, names.index), {
        "format": "hybrid_parallel.optimizer", "version": 2, "layout": _layout(ctx),
        "optimizer": type(parts.optim).__name__, "num_param_groups": len(parts.optim.param_groups),
        "files": files, "checksums": {"algorithm": CHECKSUM_KEY, "files": checksums},
        **({"loss_scaler": scaler_state} if scaler_state is not None else {})})
    swap_into_place(checkpoint)

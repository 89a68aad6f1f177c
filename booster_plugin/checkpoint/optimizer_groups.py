"""Param groups of a loaded optimizer, matched by name: each current param group takes the hyperparameters of the
saved group its parameters were in; refused if they were in groups with different hyperparameters, on this stage
(`matched_hyper`) or over the parameters of every pipeline stage (`agree_on_groups`)."""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from pipeline.groups import world_group

from .format import from_json
from .optimizer import OptimizerParts


class GroupMember(NamedTuple):
    """Of a current param group on this rank: which saved hyperparameters it takes (an index into the checkpoint's
    distinct ones, the same on every rank) and for which parameter (an index into the sorted model parameter names);
    -1, -1 for a group without saved state here."""
    hyper: int
    param: int


class GroupMatch(NamedTuple):
    """For each current param group (this stage's parameters; `agree_on_groups` then compares the stages)."""
    hyper: List[Optional[Dict[str, Any]]]  # the hyperparameters of the saved group its parameters were in (None: keep)
    members: List[GroupMember]


def matched_hyper(parts: OptimizerParts, metas: Dict[str, Any], resolve: Callable[[str], Optional[str]]) -> GroupMatch:
    """`resolve`: a model parameter name -> the name its state is saved under (None: not saved)."""
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
        out.append(None if chosen is None else {k: from_json(v) for k, v in chosen.items()})
        members.append(GroupMember(-1, -1) if chosen is None else GroupMember(
            distinct.index(json.dumps(chosen, sort_keys=True)), param_index.get(first, -1)))
    return GroupMatch(out, members)


def agree_on_groups(parts: OptimizerParts, members: Sequence[GroupMember], stage: int,
                    device: torch.device) -> Optional[str]:
    """Collective: the error (the same on every rank) if a param group takes different saved hyperparameters on
    different pipeline stages, i.e. regroups the checkpoint's groups over the whole model; None if none does.

    An all-reduce of the group count, then one all-gather of [stage, (hyper, param) per group] per rank."""
    count = torch.tensor([len(members), -len(members)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=world_group())
    most, fewest = int(count[0]), -int(count[1])
    if most != fewest:
        return (f"the optimizer has {fewest} param groups on some ranks and {most} on others: build it the same "
                f"way on every rank")
    mine = torch.tensor([stage, *(v for m in members for v in m)], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine, group=world_group())
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

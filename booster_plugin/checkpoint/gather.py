"""Collective streams of the model's full (unsharded, unpadded) tensors, for saves.

The plan is derived on every rank from `module.full_params` and `module.placement` (decided at boost); the only
communication besides the tp gathers is one all-reduce of dtype codes, plus point-to-point sends of gathered tensors
to a writer of another stage.
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, NamedTuple

import torch
import torch.distributed as dist

from pipeline.groups import world_group

from shardformer.layer.spec import gather_tensor, get_tp_spec, unshard

from ..core.parallel_module import HybridParallelModule
from .context import CheckpointContext
from .format import DTYPE_CODE, DTYPES, Entry
from .jobs import CheckpointError
from .model import stage_of, tied_map


class TensorPlan(NamedTuple):
    """The unsharded tensors a model save writes."""

    entries: List[Entry]    # in write order: by stage, then HF order (tied targets left out)
    stages: Dict[str, int]  # the stage whose copy of each is saved


def model_plan(ctx: CheckpointContext, module: HybridParallelModule) -> TensorPlan:
    """Collective (dtypes)."""
    tied = tied_map(module)
    names = [n for n in module.full_params if n not in tied]
    stages = {n: stage_of(module, n) for n in names}
    held = dict(module.unwrap().named_parameters(remove_duplicate=False))
    codes = torch.full((len(names),), -1, dtype=torch.int64, device=ctx.device)
    for i, n in enumerate(names):
        if stages[n] == ctx.stage and n in held:
            codes[i] = DTYPE_CODE.get(held[n].dtype, -2)
    dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=world_group())
    entries = []
    for n, code in zip(names, codes.tolist()):
        if code < 0:
            raise CheckpointError(f"save_model: parameter {n!r} is not held by stage {stages[n]} of any rank "
                                  f"(or has an unsupported dtype); cannot write a complete checkpoint.")
        entries.append(Entry(n, tuple(module.full_params[n][0]), DTYPES[code][0]))
    entries.sort(key=lambda e: stages[e.name])  # stable: HF order inside a stage
    return TensorPlan(entries, stages)


def gathered(ctx: CheckpointContext, module: HybridParallelModule, entries: Iterable[Entry], stages: Dict[str, int],
             writer: int, snapshot: bool) -> Iterator[torch.Tensor]:
    """Collective stream of full tensors. Every dp-rank-0 rank of a stage gathers its stage's entries over tp
    (expert parameters: every ep rank of moe_dp rank 0, over tp then ep); the `writer` receives other stages'
    entries from their stage writers, which send them. `snapshot`: copies that later training steps do not change
    (for background writes)."""
    held = dict(module.unwrap().named_parameters(remove_duplicate=False))
    experts = module.info.expert_params
    for e in entries:
        stage = stages[e.name]
        if stage == ctx.stage and ctx.gathers(e.name in experts):
            p = held[e.name]
            t = p.detach()
            spec = get_tp_spec(p)
            if spec is not None:
                t = gather_tensor(t, spec, module.tp_group) if module.tp_group is not None else unshard([t], spec)
            if e.name in experts:
                t = gather_experts(t, ctx.ep_group)
            if ctx.rank == ctx.writer_rank(stage) and writer != ctx.rank:
                dist.send(t.contiguous(), dst=writer, group=world_group())
            yield t.clone() if snapshot and ctx.rank == writer else t
        elif ctx.rank == writer:
            t = torch.empty(e.shape, dtype=e.dtype, device=ctx.device)
            dist.recv(t, src=ctx.writer_rank(stage), group=world_group())
            yield t


def gather_experts(local: torch.Tensor, group) -> torch.Tensor:
    """Every ep rank's experts (dim 0), in ep rank order: the tensor of all experts. Collective over `group`."""
    if group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def gather_on_rank0(ctx: CheckpointContext, module: HybridParallelModule,
                    names: Iterable[str]) -> Dict[str, torch.Tensor]:
    """Collective: {name: the full (unsharded, unpadded) tensor} of the unsharded parameters `names` on global rank
    0, from whichever stage and tp ranks hold them; {} on the other ranks."""
    tied = tied_map(module)
    wanted = {n: tied.get(n, n) for n in names}
    plan = model_plan(ctx, module)
    entries = [e for e in plan.entries if e.name in set(wanted.values())]
    stream = gathered(ctx, module, entries, plan.stages, writer=0, snapshot=True)
    if ctx.rank != 0:
        for _ in stream:  # this rank's part of the collectives
            pass
        return {}
    full = {e.name: t for e, t in zip(entries, stream)}
    return {n: full[source] for n, source in wanted.items()}

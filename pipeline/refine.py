"""A schedule re-planned for measured costs.

The generators (pipeline/schedules.py) order compute under unit costs (F = I = W = 1). Real stages differ: the
first holds the embedding, the last the head and the loss, and I, W and F are not equal. `refine` starts from a
valid schedule and improves its simulated makespan under a cost table: it moves compute actions within a rank's
order, and merges an I with its W into one full backward B where that does not lengthen the step (a B costs less
CPU than its I and W apart, and keeps no weight-gradient work pending). Every candidate is checked by the simulator
(pipeline/simulator.py) against the original schedule's activation promise, so a refined schedule is as valid as
the one it came from; it is never slower under the given costs.

`agree_on_refined` is the runtime's side: after a training step, the per-stage costs measured on every rank are
averaged over the world (tensor- and data-parallel peers must run the same order, or their collectives would
interleave differently), rank 0 refines and broadcasts the per-rank orders, and every rank re-derives the
transfers. torch.distributed.pipelining's schedules keep their unit-cost order.
"""
from __future__ import annotations

import statistics
import time
import warnings
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .groups import world_group

from .actions import B, COMPUTE, F, I, W, Action, Schedule, add_communication
from .simulator import ScheduleError, simulate

__all__ = ["CostTable", "agree_on_refined", "cost_of", "refine"]

CostTable = Mapping[Tuple[str, int], float]  # (kind, virtual stage) -> seconds (or any unit)
_KINDS = (F, I, W, B)


def cost_of(table: CostTable) -> Callable[[Action], float]:
    """The cost function of a table; a B without its own entry costs its stage's I + W."""
    def cost(action: Action) -> float:
        key = (action.kind, action.stage)
        if key not in table and action.kind == B:
            return table[(I, action.stage)] + table[(W, action.stage)]
        return table[key]
    return cost


def _compute_orders(schedule: Schedule) -> List[List[Action]]:
    return [[a for a in actions if a.kind in COMPUTE] for actions in schedule.actions]


def _makespan(schedule: Schedule, orders: Sequence[Sequence[Action]], cost) -> Optional[float]:
    candidate = schedule._replace(actions=add_communication(orders, schedule.layout))
    try:
        return simulate(candidate, cost).makespan
    except ScheduleError:
        return None


def refine(schedule: Schedule, cost: Callable[[Action], float], reach: int = 6, max_trials: int = 3000,
           max_seconds: float = 2.0, merge: bool = True) -> Schedule:
    """Improve `schedule` for `cost` by local search (first improvement), within its activation promise.

    Args:
        schedule: a valid schedule (what the simulator accepts).
        cost: time of a compute action (`cost_of(table)`).
        reach: how many places an action may move in one trial.
        merge: also try merging an I with its W into one B.
        max_trials, max_seconds: the search stops at whichever comes first (each trial is one simulation).
    """
    orders = _compute_orders(schedule)
    best = _makespan(schedule, orders, cost)
    if best is None:
        raise ScheduleError("refine needs a valid schedule to start from")
    trials, deadline = 0, time.perf_counter() + max_seconds

    def budget_left() -> bool:
        return trials < max_trials and time.perf_counter() < deadline

    for merging in (False, True)[:1 + merge]:  # first the order, then which backwards need not be split
        improved = True
        while improved and budget_left():
            improved = False
            for r in range(len(orders)):
                i = 0
                while i < len(orders[r]) and budget_left():
                    for candidate, is_merge in _moves(orders[r], i, reach, merging):
                        trial = orders[:r] + [candidate] + orders[r + 1:]
                        span = _makespan(schedule, trial, cost)
                        trials += 1
                        if span is not None and (span < best or (is_merge and span <= best)):
                            best, orders, improved = span, trial, True
                            break
                    i += 1
    return schedule._replace(actions=add_communication(orders, schedule.layout))


def _moves(order: List[Action], i: int, reach: int, merging: bool):
    """Candidate orders from moving action i: merged with its W (when merging), else shifted by up to `reach`."""
    action = order[i]
    if merging:
        if action.kind == I:
            merged = [a for a in order if a != Action(W, action.stage, action.microbatch)]
            merged[merged.index(action)] = Action(B, action.stage, action.microbatch)
            yield merged, True
        return
    for j in range(max(0, i - reach), min(len(order), i + reach + 1)):
        if j != i:
            moved = list(order)
            moved.insert(j, moved.pop(i))
            yield moved, False


def agree_on_refined(schedule: Schedule, durations: Mapping[Tuple[str, int], Sequence[float]],
                     device: torch.device) -> Tuple[Schedule, float]:
    """The schedule refined for the costs measured on every rank, identical on every rank; and its simulated bubble
    under those costs. Collective over the world (`groups.world_group`): every rank calls it after the same step.

    Args:
        schedule: the schedule the step ran (the same on every rank).
        durations: this rank's measured seconds per (kind, virtual stage) of the step's compute actions.
        device: where collectives take tensors (cpu for gloo).
    """
    stages = schedule.layout.num_stages
    table = torch.zeros(stages, len(_KINDS), 2, dtype=torch.float64)  # (sum of medians, ranks), built on the CPU
    for (kind, stage), seconds in durations.items():
        if seconds:
            table[stage, _KINDS.index(kind)] += torch.tensor([statistics.median(seconds), 1.0], dtype=torch.float64)
    table = table.to(device)
    dist.all_reduce(table, group=world_group())
    table = table.cpu()
    costs = {(kind, s): (table[s, k, 0] / table[s, k, 1]).item()
             for s in range(stages) for k, kind in enumerate(_KINDS) if table[s, k, 1] > 0}
    cost = cost_of(costs)
    missing = []  # compute the step ran but no rank timed (then the order stays as it is)
    for a in (a for order in _compute_orders(schedule) for a in order):
        try:
            cost(a)
        except KeyError:
            missing.append(a)
    width = 3 * schedule.layout.num_chunks * schedule.num_microbatches
    encoded = torch.full((schedule.layout.num_ranks, width, 3), -1, dtype=torch.int64)
    if dist.get_rank() == 0:
        try:  # whatever happens here, rank 0 reaches the broadcast the other ranks wait in
            _encode(schedule if missing else refine(schedule, cost), encoded)
        except Exception as error:  # noqa: BLE001 - a planning failure must not hang the job: keep the order
            warnings.warn(f"Re-planning the pipeline schedule failed ({error!r}); keeping the unit-cost order.")
            encoded.fill_(-1)
            _encode(schedule, encoded)
    encoded = encoded.to(device)
    dist.broadcast(encoded, src=0, group=world_group())
    encoded = encoded.cpu()
    orders = [[Action(_KINDS[k], s, mb) for k, s, mb in row.tolist() if k >= 0] for row in encoded]
    refined = schedule._replace(actions=add_communication(orders, schedule.layout))
    return refined, (simulate(refined, cost).bubble if not missing else simulate(refined).bubble)


def _encode(schedule: Schedule, out: torch.Tensor) -> None:
    """Per-rank compute orders as rows of (kind index, virtual stage, microbatch); -1 pads."""
    for r, order in enumerate(_compute_orders(schedule)):
        if order:
            out[r, :len(order)] = torch.tensor([[_KINDS.index(a.kind), a.stage, a.microbatch] for a in order])

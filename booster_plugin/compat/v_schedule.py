"""ColossalAI's zero-bubble V schedule nodes: `scheduler_nodes=` and `PipelineGraph(...).get_v_schedule()`.

A ColossalAI zbv script builds its order with `colossalai.pipeline.schedule.v_schedule.PipelineGraph` and passes it
to the plugin as `scheduler_nodes` (ColossalAI requires it for pp_style="zbv"): per pipeline rank, a list of nodes
with `type` ("F", "B" = backward for the inputs, "W" = backward for the weights, and the SEND_/RECV_ transfers),
`chunk` (0: the V's way down, 1: its way back up), `stage` (the rank) and `minibatch`. `nodes_to_schedule` turns
such lists (ColossalAI's own `ScheduledNode`s or ours) into a schedule of ours: the compute nodes give each rank's
order, the transfers are derived from it (pipeline/actions.py), and the simulator checks it. `PipelineGraph` here
takes ColossalAI's arguments and returns our zbv order refined for its F/B/W costs (pipeline/refine.py), as nodes.
"""
from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence

from pipeline.actions import COMPUTE, B, F, I, W, Action, Schedule, add_communication
from pipeline.layout import StageLayout
from pipeline.refine import refine
from pipeline.schedules import zero_bubble_v
from pipeline.simulator import ScheduleError, simulate

__all__ = ["PipelineGraph", "ScheduleNode", "ScheduledNode", "fingerprint", "nodes_to_schedule"]

_KIND = {"F": F, "B": I, "W": W}  # ColossalAI's B is the backward for the inputs (our I)


class ScheduleNode(Protocol):
    """What `nodes_to_schedule` reads of a node: ColossalAI's own `ScheduledNode`s or ours."""

    @property
    def type(self) -> str: ...
    @property
    def chunk(self) -> int: ...
    @property
    def stage(self) -> int: ...
    @property
    def minibatch(self) -> int: ...


@dataclass(eq=True, frozen=True)
class ScheduledNode:
    """ColossalAI's node: one action of one pipeline rank (`stage`)."""
    type: str
    chunk: int
    stage: int
    minibatch: int
    start_time: int = 0
    completion_time: int = 0
    rollback: bool = False


def nodes_to_schedule(nodes: Sequence[Sequence[ScheduleNode]], layout: StageLayout) -> Schedule:
    """The schedule of ColossalAI-style zbv nodes (raises ValueError naming what is wrong).

    Args:
        nodes: per pipeline rank, its nodes in order (only F, B and W are read; transfers are derived).
        layout: the V layout of this pipeline (p ranks, 2 chunks).
    """
    if len(nodes) != layout.num_ranks:
        raise ValueError(f"scheduler_nodes has {len(nodes)} lists, one per pipeline stage is needed "
                         f"(pp_size={layout.num_ranks}).")
    orders: List[List[Action]] = []
    for rank, rank_nodes in enumerate(nodes):
        order = []
        for node in rank_nodes:
            if node.type not in _KIND:
                continue  # SEND_/RECV_ nodes and ColossalAI's POST_VALIDATION markers
            if node.stage != rank or node.chunk not in (0, 1):
                raise ValueError(f"scheduler_nodes[{rank}] holds {node!r}: its stage must be {rank} and its chunk "
                                 f"0 or 1.")
            order.append(Action(_KIND[node.type], layout.stage_of(rank, node.chunk), int(node.minibatch)))
        orders.append(order)
    minibatches = {a.microbatch for order in orders for a in order}
    if not minibatches:
        raise ValueError("scheduler_nodes hold no F, B or W node: build them with PipelineGraph(...).get_v_schedule().")
    m = max(minibatches) + 1
    unbounded = Schedule(layout, m, add_communication(orders, layout), [2 * layout.num_stages * m] * layout.num_ranks)
    try:
        peak = simulate(unbounded).peak_activations
    except ScheduleError as err:
        raise ValueError(f"scheduler_nodes do not form a valid zero-bubble schedule: {err}") from None
    return unbounded._replace(max_activations=list(peak))


def schedule_from_nodes(nodes: Optional[Sequence[Sequence[ScheduleNode]]], pp_style: str, layout: StageLayout,
                        num_microbatches: Optional[int], rank: int) -> Optional[Schedule]:
    """The plugin's `scheduler_nodes`: None when unset; ignored with a warning (as ColossalAI does) when pp_style is
    not "zbv"; else the checked schedule, whose number of microbatches must match `num_microbatches` if given."""
    if nodes is None:
        return None
    if pp_style != "zbv":
        if rank == 0:
            warnings.warn(f"scheduler_nodes only orders pp_style='zbv'; ignored with pp_style={pp_style!r}.",
                          stacklevel=3)
        return None
    schedule = nodes_to_schedule(nodes, layout)
    if num_microbatches is not None and schedule.num_microbatches != num_microbatches:
        raise ValueError(f"scheduler_nodes order {schedule.num_microbatches} microbatches but "
                         f"num_microbatches={num_microbatches}; build them with n_micro={num_microbatches}.")
    return schedule


def fingerprint(schedule: Optional[Schedule]) -> int:
    """A checksum of a schedule's per-rank orders (0 for None), so that ranks can check they were given the same."""
    if schedule is None:
        return 0
    return zlib.crc32(repr(schedule.actions).encode()) + 1


class PipelineGraph:
    """ColossalAI's `PipelineGraph` (colossalai.pipeline.schedule.v_schedule): `get_v_schedule()` gives the zbv
    order as nodes for `scheduler_nodes`. Ours is the zbv generator's order refined for `f_cost`, `b_cost` (input
    backward) and `w_cost`; the transfer cost and the memory arguments are accepted and not used (the order keeps
    zbv's activation promise of 2 * n_stage chunk activations, ColossalAI's default `max_mem`)."""

    def __init__(self, n_stage: int, n_micro: int, f_cost: float, b_cost: float, w_cost: float, c_cost: float,
                 f_mem: float, b_mem: float, w_mem: float, max_mem: Optional[float] = None) -> None:
        self.n_stage, self.n_micro = n_stage, n_micro
        self.costs = {F: f_cost, I: b_cost, W: w_cost}

    def _schedule(self) -> Schedule:
        unit = zero_bubble_v(self.n_stage, self.n_micro)
        # ColossalAI's nodes have no full backward: its merged B (virtual stage 0) becomes I then W again
        compute = [[x for a in actions if a.kind in COMPUTE
                    for x in ((a._replace(kind=I), a._replace(kind=W)) if a.kind == B else (a,))]
                   for actions in unit.actions]
        schedule = unit._replace(actions=add_communication(compute, unit.layout))
        # every rank builds its nodes: a search bounded by trials only gives all of them the same order
        return refine(schedule, self._cost, merge=False, max_seconds=float("inf"))

    def _cost(self, action: Action) -> float:
        return self.costs[action.kind]

    def get_v_schedule(self, only_run_time: bool = False):
        """Per pipeline rank, its compute nodes in order (or, with `only_run_time`, the simulated step time)."""
        schedule = self._schedule()
        if only_run_time:
            return simulate(schedule, self._cost).makespan
        layout = schedule.layout
        return [[ScheduledNode({F: "F", I: "B", W: "W"}[a.kind], layout.chunk_of(a.stage), rank, a.microbatch)
                 for a in actions if a.kind in COMPUTE] for rank, actions in enumerate(schedule.actions)]

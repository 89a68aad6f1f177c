"""Schedule actions, whole schedules, and the communication a compute order implies.

A schedule is, for every pipeline rank, a list of `Action`s run in order by one runtime (pipeline/runtime.py):
compute (F forward, B full backward, I backward for the input only, W backward for the weights only),
point-to-point transfers (SEND_F/RECV_F activations, SEND_B/RECV_B their gradients) of one microbatch through
one virtual stage, and REDUCE_GRAD, the data-parallel reduction of the rank's gradients (as torch's pipelining
schedules have it). Generators (pipeline/schedules.py) only order the compute; `add_communication` derives the
transfers: a send right after the compute that produced the tensor, and receives in the sender's order on each
(sender, receiver) channel (transfers on a channel are matched first-in first-out), each as late as possible
before the compute that needs it; and a rank that computes gradients ends with REDUCE_GRAD. Its reduction is
launched, bucket by bucket, during the rank's last gradient action (the B or W before it), overlapping that
backward; REDUCE_GRAD waits for it, after the rank's last transfers.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Dict, List, NamedTuple, Sequence, Tuple

from .layout import StageLayout


class ActionKind(StrEnum):
    """What an action does (its value is its name, so an action prints as `F3.1`)."""
    F = "F"  # forward
    B = "B"  # full backward
    I = "I"  # backward for the input only (its weight gradients are left to W)  # noqa: E741
    W = "W"  # backward for the weights only
    SEND_F = "SEND_F"  # activations to the next virtual stage
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"  # their gradients back to the previous one
    RECV_B = "RECV_B"
    REDUCE_GRAD = "REDUCE_GRAD"  # the rank's gradients final: their data-parallel reduction finished


F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
REDUCE_GRAD = ActionKind.REDUCE_GRAD
COMPUTE = (F, B, I, W)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)


class Action(NamedTuple):
    """One step of a rank's schedule: `kind` of `microbatch` at virtual stage `stage`.

    For SEND_F/SEND_B, `stage` is the sending virtual stage; for RECV_F/RECV_B the receiving one; REDUCE_GRAD
    carries the stage and microbatch of the gradient action that launched its reduction."""
    kind: ActionKind
    stage: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


class Schedule(NamedTuple):
    """A whole pipeline step: per-rank action lists and the activation memory each rank is promised to stay in
    (the most (virtual stage, microbatch) activations alive at once, from forward to the end of its backward)."""
    layout: StageLayout
    num_microbatches: int
    actions: List[List[Action]]
    max_activations: List[int]


def peer_stage(action: Action) -> int:
    """The virtual stage on the other end of a transfer."""
    return action.stage + (1 if action.kind in (SEND_F, RECV_B) else -1)


def _sends_after(action: Action, layout: StageLayout) -> List[Action]:
    """The send a compute action needs when its result goes to a virtual stage on another rank."""
    last = layout.num_stages - 1
    if action.kind == F and action.stage < last and layout.rank_of(action.stage + 1) != layout.rank_of(action.stage):
        return [Action(SEND_F, action.stage, action.microbatch)]
    if action.kind in (B, I) and action.stage > 0 and \
            layout.rank_of(action.stage - 1) != layout.rank_of(action.stage):
        return [Action(SEND_B, action.stage, action.microbatch)]
    return []


def _needed_recv(action: Action, layout: StageLayout) -> List[Action]:
    """The receive a compute action needs when its input comes from a virtual stage on another rank."""
    last = layout.num_stages - 1
    if action.kind == F and action.stage > 0 and layout.rank_of(action.stage - 1) != layout.rank_of(action.stage):
        return [Action(RECV_F, action.stage, action.microbatch)]
    if action.kind in (B, I) and action.stage < last and \
            layout.rank_of(action.stage + 1) != layout.rank_of(action.stage):
        return [Action(RECV_B, action.stage, action.microbatch)]
    return []


def _recv_of(send: Action) -> Action:
    return Action(RECV_F if send.kind == SEND_F else RECV_B, peer_stage(send), send.microbatch)


def add_communication(compute: Sequence[Sequence[Action]], layout: StageLayout) -> List[List[Action]]:
    """Per-rank compute orders -> per-rank action lists with the sends and receives they imply."""
    with_sends = []
    for actions in compute:
        ranked: List[Action] = []
        for action in actions:
            ranked.append(action)
            ranked.extend(_sends_after(action, layout))
        with_sends.append(ranked)
    # the order in which each receiver must take its messages: the sender's order on that channel
    channel_order: Dict[Tuple[int, int], List[Action]] = {}
    for rank, actions in enumerate(with_sends):
        for a in actions:
            if a.kind in (SEND_F, SEND_B):
                channel_order.setdefault((rank, layout.rank_of(peer_stage(a))), []).append(_recv_of(a))
    result = []
    for rank, actions in enumerate(with_sends):
        position = {key: 0 for key in channel_order if key[1] == rank}
        out: List[Action] = []
        for action in actions:
            for recv in _needed_recv(action, layout):
                channel = (layout.rank_of(peer_stage(recv)), rank)
                queue = channel_order[channel]
                if recv not in queue[:position[channel]]:
                    upto = queue.index(recv, position[channel]) + 1
                    out.extend(queue[position[channel]:upto])
                    position[channel] = upto
            out.append(action)
        result.append(out + _reduction(out))
    return result


def _reduction(actions: Sequence[Action]) -> List[Action]:
    """REDUCE_GRAD at the end of a rank that computes gradients, naming its last gradient action."""
    last = [a for a in actions if a.kind in (B, W)]
    return [Action(REDUCE_GRAD, last[-1].stage, last[-1].microbatch)] if last else []

"""Check a schedule without running a model: every rank's actions are executed in order against a clock.

Semantics are those of the runtime with the "p2p" transport: a send is posted and does not wait; a receive blocks
until the matching send was posted, and the sends of one (sender, receiver) channel are matched first-in
first-out, so a receive that takes a message it did not ask for is an error. `simulate` raises `ScheduleError` when
a dependency is violated (forward before its input, backward before its output gradient, W before I), a
microbatch misses or repeats a computation, a transfer is unmatched, the ranks deadlock, or a rank keeps more
activations alive than the schedule promises. It returns the timings under unit costs.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Set, Tuple, Union

from .actions import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, peer_stage
from .schedules import Schedule, unit_cost


class ScheduleError(AssertionError):
    """A schedule that would compute wrong results, hang, or exceed its memory promise."""


class SimulationResult(NamedTuple):
    makespan: float             # time from the first action to the last, in cost units
    busy: List[float]           # compute time per rank
    peak_activations: List[int]  # most activations alive at once, per rank

    @property
    def bubble(self) -> float:
        """Idle fraction of all ranks over the makespan."""
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def simulate(schedule: Schedule, costs: Union[None, Dict[str, float], Callable[[Action], float]] = None
             ) -> SimulationResult:
    """Run `schedule` on a simulated clock; raise ScheduleError on any violation.

    Args:
        schedule: the schedule to check.
        costs: time of F, B, I and W, or a function of the compute action (default `unit_cost`); transfers take
            no time.
    """
    table = costs or unit_cost
    cost = table if callable(table) else lambda a: table[a.kind]  # noqa: E731
    layout, m = schedule.layout, schedule.num_microbatches
    p, last = layout.num_ranks, layout.num_stages - 1
    training = any(a.kind in (B, I, W) for actions in schedule.actions for a in actions)
    if len(schedule.actions) != p:
        raise ScheduleError(f"{len(schedule.actions)} action lists for {p} ranks.")
    done: Dict[Tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> finish time
    channels: Dict[Tuple[int, int], Deque[Tuple[Action, float]]] = {}
    received: Set[Action] = set()
    pc, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    alive, peak = [0] * p, [0] * p

    def fail(rank: int, action: Action, why: str) -> None:
        raise ScheduleError(f"rank {rank}, action {pc[rank]} ({action!r}): {why}")

    def local_input(rank: int, action: Action, kind: str, stage: int, recv: str) -> Optional[float]:
        """Finish time of the input a compute needs (None: not available yet, which is an error here)."""
        if layout.rank_of(stage) == rank:
            return done.get((kind, stage, action.microbatch))
        return 0.0 if Action(recv, action.stage, action.microbatch) in received else None

    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while pc[rank] < len(schedule.actions[rank]):
                a = schedule.actions[rank][pc[rank]]
                if layout.rank_of(a.stage) != rank:
                    fail(rank, a, f"virtual stage {a.stage} lives on rank {layout.rank_of(a.stage)}")
                if not 0 <= a.microbatch < m:
                    fail(rank, a, f"microbatch out of range 0..{m - 1}")
                start = clock[rank]
                if a.kind in (SEND_F, SEND_B):
                    produced = done.get((F if a.kind == SEND_F else "BI", a.stage, a.microbatch))
                    if produced is None:
                        fail(rank, a, "sends a result not computed yet")
                    dst = layout.rank_of(peer_stage(a))
                    channels.setdefault((rank, dst), deque()).append((a, start))
                elif a.kind in (RECV_F, RECV_B):
                    queue = channels.get((layout.rank_of(peer_stage(a)), rank))
                    if not queue:
                        break  # blocked: wait for the sender
                    sent, at = queue.popleft()
                    if peer_stage(sent) != a.stage or sent.microbatch != a.microbatch or \
                            (sent.kind == SEND_F) != (a.kind == RECV_F):
                        fail(rank, a, f"takes {sent!r} off its channel (transfers are first-in first-out)")
                    received.add(a)
                    clock[rank] = max(start, at)
                else:
                    key = (a.kind, a.stage, a.microbatch)
                    if key in done or (a.kind in (B, I) and ("BI", a.stage, a.microbatch) in done):
                        fail(rank, a, "computed twice")
                    if a.kind == F:
                        ready = 0.0 if a.stage == 0 else local_input(rank, a, F, a.stage - 1, RECV_F)
                    else:
                        if (F, a.stage, a.microbatch) not in done:
                            fail(rank, a, "backward before its forward")
                        if a.kind == W:
                            ready = done.get((I, a.stage, a.microbatch))
                        else:
                            ready = 0.0 if a.stage == last else local_input(rank, a, "BI", a.stage + 1, RECV_B)
                    if ready is None:
                        fail(rank, a, "its input is neither computed on this rank nor received before")
                    begin = max(start, ready)
                    clock[rank] = begin + cost(a)
                    busy[rank] += cost(a)
                    done[key] = clock[rank]
                    if a.kind in (B, I):
                        done[("BI", a.stage, a.microbatch)] = clock[rank]
                    if training:
                        alive[rank] += 1 if a.kind == F else -1 if a.kind in (B, W) else 0
                        peak[rank] = max(peak[rank], alive[rank])
                pc[rank] += 1
                progress = True
    stuck = [r for r in range(p) if pc[r] < len(schedule.actions[r])]
    if stuck:
        raise ScheduleError("deadlock: " + ", ".join(f"rank {r} waits at {schedule.actions[r][pc[r]]!r}" for r in stuck))
    leftover = [k for k, q in channels.items() if q]
    if leftover:
        raise ScheduleError(f"sends never received on channels {leftover}")
    for stage in range(last + 1):
        for mb in range(m):
            if (F, stage, mb) not in done:
                raise ScheduleError(f"microbatch {mb} never runs forward at virtual stage {stage}")
            if training and not ((B, stage, mb) in done or {(I, stage, mb), (W, stage, mb)} <= done.keys()):
                raise ScheduleError(f"microbatch {mb} misses its backward at virtual stage {stage}")
    for rank in range(p):
        if peak[rank] > schedule.max_activations[rank]:
            raise ScheduleError(f"rank {rank} keeps {peak[rank]} activations alive, promised "
                                f"{schedule.max_activations[rank]}")
    return SimulationResult(max(clock), busy, peak)

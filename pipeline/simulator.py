"""Check a schedule without running a model: every rank's actions are executed in order against a clock.

Semantics are those of the runtime with the "p2p" transport: a send is posted and does not wait; a receive blocks
until the matching send was posted, and the sends of one (sender, receiver) channel are matched first-in
first-out, so a receive that takes a message it did not ask for is an error. `simulate` raises `ScheduleError` when
a dependency is violated (forward before its input, backward before its output gradient, W before I), a
microbatch misses or repeats a computation, a transfer is unmatched, the ranks deadlock, a rank that computes
gradients does not end them with one REDUCE_GRAD, or a rank keeps more activations alive than the schedule
promises. It returns the timings under unit costs.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, NamedTuple, NoReturn, Optional, Set, Tuple, Union

from .actions import B, F, I, RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, W, Action, Schedule, peer_stage

_BI = "BI"  # the key of "B or I done" (what a SEND_B and the previous stage's backward wait for)


def unit_cost(action: Action) -> float:
    """The cost model of the generators and the simulator's default: F = I = W = 1 and B = 2 per chunk (I computes
    the linear layers' input gradients, W their weight gradients: pipeline/split_backward.py)."""
    return 2.0 if action.kind == B else 1.0


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
    if len(schedule.actions) != schedule.layout.num_ranks:
        raise ScheduleError(f"{len(schedule.actions)} action lists for {schedule.layout.num_ranks} ranks.")
    run = _Run(schedule, cost)
    run.run()
    run.check_finished()
    return SimulationResult(max(run.clock), run.busy, run.peak)


class _Run:
    """The simulated ranks: where each is in its list, its clock, and what was computed and sent so far."""

    def __init__(self, schedule: Schedule, cost: Callable[[Action], float]) -> None:
        self.schedule, self.cost, self.layout = schedule, cost, schedule.layout
        p = self.layout.num_ranks
        self.last = self.layout.num_stages - 1
        self.training = any(a.kind in (B, I, W) for actions in schedule.actions for a in actions)
        self.done: Dict[Tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> finish time
        self.channels: Dict[Tuple[int, int], Deque[Tuple[Action, float]]] = {}
        self.received: Set[Action] = set()
        self.pc, self.clock, self.busy = [0] * p, [0.0] * p, [0.0] * p
        self.alive, self.peak = [0] * p, [0] * p

    def fail(self, rank: int, action: Action, why: str) -> NoReturn:
        raise ScheduleError(f"rank {rank}, action {self.pc[rank]} ({action!r}): {why}")

    def run(self) -> None:
        """Advance every rank as far as it can, round after round, until none moves."""
        progress = True
        while progress:
            progress = False
            for rank, actions in enumerate(self.schedule.actions):
                while self.pc[rank] < len(actions) and self._step(rank, actions[self.pc[rank]]):
                    self.pc[rank] += 1
                    progress = True

    def _step(self, rank: int, a: Action) -> bool:
        """Run `a` on `rank`; False when it blocks (a receive whose message was not sent yet)."""
        if self.layout.rank_of(a.stage) != rank:
            self.fail(rank, a, f"virtual stage {a.stage} lives on rank {self.layout.rank_of(a.stage)}")
        if not 0 <= a.microbatch < self.schedule.num_microbatches:
            self.fail(rank, a, f"microbatch out of range 0..{self.schedule.num_microbatches - 1}")
        if a.kind in (SEND_F, SEND_B):
            if self.done.get((F if a.kind == SEND_F else _BI, a.stage, a.microbatch)) is None:
                self.fail(rank, a, "sends a result not computed yet")
            dst = self.layout.rank_of(peer_stage(a))
            self.channels.setdefault((rank, dst), deque()).append((a, self.clock[rank]))
            return True
        if a.kind in (RECV_F, RECV_B):
            return self._receive(rank, a)
        if a.kind == REDUCE_GRAD:
            self._check_reduction(rank, a)
            return True
        self._compute(rank, a)
        return True

    def _receive(self, rank: int, a: Action) -> bool:
        queue = self.channels.get((self.layout.rank_of(peer_stage(a)), rank))
        if not queue:
            return False  # blocked: wait for the sender
        sent, at = queue.popleft()
        if peer_stage(sent) != a.stage or sent.microbatch != a.microbatch or \
                (sent.kind == SEND_F) != (a.kind == RECV_F):
            self.fail(rank, a, f"takes {sent!r} off its channel (transfers are first-in first-out)")
        self.received.add(a)
        self.clock[rank] = max(self.clock[rank], at)
        return True

    def _compute(self, rank: int, a: Action) -> None:
        key = (a.kind, a.stage, a.microbatch)
        if key in self.done or (a.kind in (B, I) and (_BI, a.stage, a.microbatch) in self.done):
            self.fail(rank, a, "computed twice")
        ready = self._ready(rank, a)
        if ready is None:
            self.fail(rank, a, "its input is neither computed on this rank nor received before")
        self.clock[rank] = max(self.clock[rank], ready) + self.cost(a)
        self.busy[rank] += self.cost(a)
        self.done[key] = self.clock[rank]
        if a.kind in (B, I):
            self.done[(_BI, a.stage, a.microbatch)] = self.clock[rank]
        if self.training:
            self.alive[rank] += 1 if a.kind == F else -1 if a.kind in (B, W) else 0
            self.peak[rank] = max(self.peak[rank], self.alive[rank])

    def _ready(self, rank: int, a: Action) -> Optional[float]:
        """When the input of compute `a` is available (None: it is not, which is an error here)."""
        if a.kind == F:
            return 0.0 if a.stage == 0 else self._input(rank, a, F, a.stage - 1, RECV_F)
        if (F, a.stage, a.microbatch) not in self.done:
            self.fail(rank, a, "backward before its forward")
        if a.kind == W:
            return self.done.get((I, a.stage, a.microbatch))
        return 0.0 if a.stage == self.last else self._input(rank, a, _BI, a.stage + 1, RECV_B)

    def _check_reduction(self, rank: int, a: Action) -> None:
        """REDUCE_GRAD: after the rank's last gradient action (the one it names), which launched the reduction."""
        later = self.schedule.actions[rank][self.pc[rank] + 1:]
        if any(b.kind in (B, I, W, REDUCE_GRAD) for b in later):
            self.fail(rank, a, "gradient work follows the reduction of the rank's gradients")
        if (a.kind, a.stage, a.microbatch) in self.done or \
                not any(k in self.done for k in ((B, a.stage, a.microbatch), (W, a.stage, a.microbatch))):
            self.fail(rank, a, "does not follow the gradient action it names")
        self.done[(a.kind, a.stage, a.microbatch)] = self.clock[rank]

    def _input(self, rank: int, action: Action, kind: str, stage: int, recv: str) -> Optional[float]:
        """Finish time of the input a compute needs, made at `stage` by `kind` (locally) or received by `recv`."""
        if self.layout.rank_of(stage) == rank:
            return self.done.get((kind, stage, action.microbatch))
        return 0.0 if Action(recv, action.stage, action.microbatch) in self.received else None

    def check_finished(self) -> None:
        """Every rank at its end, every message taken, every computation done, every promise kept."""
        actions, m = self.schedule.actions, self.schedule.num_microbatches
        stuck = [r for r in range(len(actions)) if self.pc[r] < len(actions[r])]
        if stuck:
            raise ScheduleError("deadlock: " + ", ".join(f"rank {r} waits at {actions[r][self.pc[r]]!r}"
                                                         for r in stuck))
        leftover = [k for k, q in self.channels.items() if q]
        if leftover:
            raise ScheduleError(f"sends never received on channels {leftover}")
        for stage in range(self.last + 1):
            for mb in range(m):
                if (F, stage, mb) not in self.done:
                    raise ScheduleError(f"microbatch {mb} never runs forward at virtual stage {stage}")
                if self.training and not ((B, stage, mb) in self.done
                                          or {(I, stage, mb), (W, stage, mb)} <= self.done.keys()):
                    raise ScheduleError(f"microbatch {mb} misses its backward at virtual stage {stage}")
        for rank, ranked in enumerate(actions):
            if self.training and any(a.kind in (B, W) for a in ranked) and ranked[-1].kind != REDUCE_GRAD:
                raise ScheduleError(f"rank {rank} computes gradients but does not end with REDUCE_GRAD (their "
                                    f"data-parallel reduction): build action lists with add_communication")
        for rank, peak in enumerate(self.peak):
            if peak > self.schedule.max_activations[rank]:
                raise ScheduleError(f"rank {rank} keeps {peak} activations alive, promised "
                                    f"{self.schedule.max_activations[rank]}")

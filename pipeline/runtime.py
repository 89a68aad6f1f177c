"""The pipeline runtime: runs training (or evaluation) steps over given microbatches, by executing this rank's
actions (pipeline/actions.py) of the schedule its style generates (pipeline/styles.py); this file knows no schedule.

A step gets this rank's model chunks as callables (one per virtual stage the rank holds, in chunk order) and the
step's microbatches; the last virtual stage applies `criterion(outputs, micro_batch)` and the mean over
microbatches (or the given `LossWeights`) is the step's loss, broadcast to every stage (pipeline/step.py).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .actions import Schedule
from .nested import merge_outputs
from .p2p import PipelineP2PCommunication
from .refine import agree_on_refined
from .schedules import forward_only
from .simulator import simulate
from .stage_manager import PipelineStageManager
from .step import Chunk, MicroBatch, StepOptions, StepRun
from .styles import ScheduleStyle
from .trace import ScheduleTracer

__all__ = ["Plan", "PipelineSchedule", "StepResult"]

_NO_SPAN = contextlib.nullcontext()


class Plan(NamedTuple):
    """The schedule for a number of microbatches, and its simulated bubble (the theory the trace compares with):
    under unit costs, or under the measured costs it was re-planned for."""
    schedule: Schedule
    bubble: float


class StepResult(NamedTuple):
    loss: Optional[torch.Tensor]  # the step's loss on every stage (with return_loss and a criterion), else None
    outputs: object               # the last stage's outputs merged over microbatches (with return_outputs)


class PipelineSchedule:
    """Runs steps over the pipeline by executing this rank's actions of the schedule generated for `style`.

    Args:
        stage_manager: this rank's stage, layout of the virtual stages and pipeline group.
        p2p: transfers between ranks.
        style: the schedule style (pipeline/styles.py).
        measured_costs: for a style that re-plans for measured costs (zbv, dualpipev), time the compute of the first
            training step with a number of microbatches and re-plan the order for those costs (pipeline/refine.py;
            a collective at the end of that step); False keeps the unit-cost order.
        tracer: records a timeline of every step (pipeline/trace.py); None: none.
    """

    def __init__(self, stage_manager: PipelineStageManager, p2p: PipelineP2PCommunication, style: ScheduleStyle,
                 measured_costs: bool = False, tracer: Optional[ScheduleTracer] = None) -> None:
        if not style.runs_on_broadcast and p2p.transport != "p2p":
            raise ValueError(f"pp_style={style.name!r} needs p2p_transport='p2p' (the broadcast transport's sends "
                             f"wait for the receiver, which only the 1f1b order allows).")
        self.stage_manager, self.p2p, self.style, self.tracer = stage_manager, p2p, style, tracer
        self._plans: Dict[int, Plan] = {}
        # numbers of microbatches whose plan is re-planned after their first training step
        self._to_measure = style.replans_for_measured_costs and measured_costs
        self._measured: set = set()
        self.num_microbatches: Optional[int] = None  # microbatches of the last step
        self.peak_inflight_microbatches = 0  # (virtual stage, microbatch) activations alive at once on this rank

    def plan(self, m: int) -> Plan:
        """The schedule for m microbatches and its simulated bubble (raises ValueError for an m the style cannot
        run)."""
        if m not in self._plans:
            sm = self.stage_manager
            schedule = self.style.make(sm.num_stages, sm.num_model_chunks, m)
            self._plans[m] = Plan(schedule, simulate(schedule).bubble)
        return self._plans[m]

    def use_schedule(self, schedule: Schedule) -> None:
        """Run `schedule` (e.g. one built or refined by hand: pipeline/refine.py) for its number of microbatches;
        it must be the same on every rank. Checked by the simulator first (raises ScheduleError).

        Args:
            schedule: per-rank action lists for this pipeline's layout.
        """
        if schedule.layout != self.stage_manager.layout:
            raise ValueError(f"The schedule is for {schedule.layout}, this pipeline is {self.stage_manager.layout}.")
        self._plans[schedule.num_microbatches] = Plan(schedule, simulate(schedule).bubble)
        self._measured.add(schedule.num_microbatches)

    def _span(self, kind: str, microbatch: int) -> ContextManager[None]:
        return _NO_SPAN if self.tracer is None else self.tracer.span(kind, microbatch)

    def forward_backward_step(self, chunks: Sequence[Chunk], microbatches: Sequence[MicroBatch],
                              criterion: Optional[Callable], options: StepOptions) -> StepResult:
        """One step: forwards and (with grad enabled) backwards of every microbatch.

        Args:
            chunks: this rank's model chunks, in chunk order, each called as `chunk(**micro_batch, **received)`.
            microbatches: the step's microbatches (dicts of tensors of one shape).
            criterion: `criterion(outputs, micro_batch)` on the last virtual stage (None: no loss).
            options: loss weighting, what to return, the backward of the loss, the reduction switch.
        """
        m, sm = len(microbatches), self.stage_manager
        schedule, theory = self.plan(m)
        training = torch.is_grad_enabled()
        if not training:
            schedule = forward_only(schedule)
        if self.tracer is not None:
            self.tracer.start_step(m, sm.pp_group, theory)
        self.p2p.new_step()
        self.num_microbatches = m
        step = StepRun(chunks, microbatches, criterion, options, sm, self.p2p, self._span)
        measuring = training and self._to_measure and m not in self._measured
        step.run(schedule, measuring)
        self.peak_inflight_microbatches = step.peak_inflight
        loss = None
        if criterion is not None and options.return_loss:
            loss = step.loss
            if sm.num_stages > 1:  # the loss lives with the last virtual stage; give it to every stage
                dist.broadcast(loss, src=sm.last_rank, group=sm.pp_group)
        if measuring:  # every rank re-plans from the same measured costs (a collective over all ranks)
            self._plans[m] = Plan(*agree_on_refined(schedule, step.durations, self.p2p.device))
            self._measured.add(m)
        outputs = merge_outputs([step.outputs[i] for i in sorted(step.outputs)]) if step.outputs else None
        return StepResult(loss, outputs)

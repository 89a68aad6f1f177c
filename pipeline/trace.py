"""Optional per-rank timeline of a pipeline schedule: forward, backward, send, receive and optimizer spans.

Off by default (the schedule then holds no tracer and pays one `is None` check per span). When on, every rank
records (kind, microbatch, start, end) against a clock aligned by a barrier at the start of each step;
`gather_and_write` collects all ranks' events as tensors (no pickle) on rank 0, which writes a Chrome trace JSON
(open in Perfetto or chrome://tracing), a PNG timeline of all stages, and the measured vs theoretical bubble with
the step's work bound (the shortest any order of the same actions could take).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .groups import world_group

KINDS = ("forward", "backward", "send", "recv", "send+recv", "optimizer", "backward_input", "backward_weight")
COMPUTE_KINDS = (0, 1, 6, 7)
COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "send": "#55A868", "recv": "#8C8C8C", "send+recv": "#8172B3",
          "optimizer": "#C44E52", "backward_input": "#E5AE38", "backward_weight": "#937860"}


class ScheduleTracer:
    def __init__(self, stage: int, num_stages: int) -> None:
        self.stage, self.num_stages = stage, num_stages
        self.events: List[tuple] = []  # (kind index, microbatch, start s, end s, step)
        self.step = -1
        self.num_microbatches = 0
        self.theoretical_bubble = 0.0
        self._epoch = 0.0

    def start_step(self, num_microbatches: int, group: Optional[dist.ProcessGroup] = None,
                   theoretical_bubble: float = 0.0) -> None:
        """Align the ranks' clocks (a barrier) and note the schedule's bubble under unit costs."""
        dist.barrier(group=group if group is not None else world_group())
        self.step += 1
        self.num_microbatches = num_microbatches
        self.theoretical_bubble = theoretical_bubble
        if self.step == 0:
            self._epoch = time.perf_counter()

    @contextlib.contextmanager
    def span(self, kind: str, microbatch: int = -1):
        start = time.perf_counter() - self._epoch
        try:
            yield
        finally:
            self.events.append((KINDS.index(kind), microbatch, start, time.perf_counter() - self._epoch, self.step))

    def gather_and_write(self, out_dir: str, group: Optional[dist.ProcessGroup] = None) -> Optional[Dict[str, float]]:
        """Collective over `group` (default: the world): rank 0 of it writes trace.json, timeline.png, bubble.json."""
        group = group if group is not None else world_group()
        rank = dist.get_rank(group)
        mine = torch.tensor([[k, mb, s, e, st, self.stage] for k, mb, s, e, st in self.events] or
                            torch.zeros(0, 6).tolist(), dtype=torch.float64).view(-1, 6)
        world = dist.get_world_size(group)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([mine.shape[0]]), group=group)
        longest = max(int(c.item()) for c in counts)
        padded = torch.zeros(longest, 6, dtype=torch.float64)
        padded[: mine.shape[0]] = mine
        parts = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        if rank != 0:
            return None
        per_rank = [p[: int(c.item())] for p, c in zip(parts, counts)]
        os.makedirs(out_dir, exist_ok=True)
        summary = bubble_summary(per_rank, self.num_stages, self.num_microbatches, self.theoretical_bubble)
        write_chrome_trace(per_rank, os.path.join(out_dir, "trace.json"))
        write_png(per_rank, os.path.join(out_dir, "timeline.png"), summary)
        with open(os.path.join(out_dir, "bubble.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary


def last_training_step(per_rank: List[torch.Tensor]) -> int:
    """The last step with backward passes (evaluation steps run forwards only); else the last step."""
    rows = torch.cat([r for r in per_rank if r.numel()] or [torch.zeros(0, 6, dtype=torch.float64)])
    if rows.numel() == 0:
        return 0
    training = rows[rows[:, 0] == KINDS.index("backward")]
    return int((training if training.numel() else rows)[:, 4].max())


def bubble_summary(per_rank: List[torch.Tensor], num_stages: int, num_microbatches: int,
                   theoretical_bubble: float) -> Dict[str, float]:
    """Bubble of the last training step: 1 - compute time / pipeline time (first forward to last backward or
    send, the optimizer step left out), averaged over ranks."""
    fractions = []
    step = last_training_step(per_rank)
    for events in per_rank:
        if events.numel() == 0:
            continue
        last = events[(events[:, 4] == step) & (events[:, 0] != KINDS.index("optimizer"))]
        compute = last[sum(last[:, 0] == k for k in COMPUTE_KINDS) > 0]
        span = last[:, 3].max() - last[:, 2].min()
        busy = (compute[:, 3] - compute[:, 2]).sum()
        fractions.append(float(1 - busy / span) if span > 0 else 0.0)
    p, m = num_stages, num_microbatches
    return {"measured_bubble": sum(fractions) / max(len(fractions), 1),
            "theoretical_bubble": theoretical_bubble, "num_stages": p, "num_microbatches": m,
            "step": step, **work_bound(per_rank, step)}


def work_bound(per_rank: List[torch.Tensor], step: int) -> Dict[str, float]:
    """The step's wall time (first event to the end of the last optimizer step) and the shortest any order of the
    same actions could take: rank r is busy for its compute and optimizer time, and cannot start before the first
    forwards of ranks 0..r-1 (its own first forward needs their outputs); the bound is the longest such rank, in
    ms. A schedule at its bound has no bubble left to remove: only less work makes it faster."""
    start, bound, first, last = 0.0, 0.0, float("inf"), 0.0
    for events in per_rank:
        rows = events[events[:, 4] == step] if events.numel() else events
        if rows.numel() == 0:
            continue
        work = rows[sum(rows[:, 0] == k for k in (*COMPUTE_KINDS, KINDS.index("optimizer"))) > 0]
        bound = max(bound, start + float((work[:, 3] - work[:, 2]).sum()))
        forwards = rows[rows[:, 0] == KINDS.index("forward")]
        start += float(forwards[0, 3] - forwards[0, 2]) if len(forwards) else 0.0
        first, last = min(first, float(rows[:, 2].min())), max(last, float(rows[:, 3].max()))
    return {"step_ms": (last - first) * 1e3 if last > first else 0.0, "work_bound_ms": bound * 1e3}


def write_chrome_trace(per_rank: List[torch.Tensor], path: str) -> None:
    events = []
    for rank, rows in enumerate(per_rank):
        for k, mb, s, e, step, stage in rows.tolist():
            name = KINDS[int(k)] + (f" mb{int(mb)}" if mb >= 0 else "")
            events.append({"name": name, "cat": KINDS[int(k)], "ph": "X", "ts": s * 1e6, "dur": (e - s) * 1e6,
                           "pid": 0, "tid": rank, "args": {"step": int(step), "stage": int(stage)}})
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank} (stage {int(rows[0, 5]) if len(rows) else '?'})"}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def write_png(per_rank: List[torch.Tensor], path: str, summary: Dict[str, float]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:  # the PNG is optional; the JSON trace is always written
        return
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(per_rank) + 1.5))
    step = last_training_step(per_rank)  # the picture shows the last two training steps
    for rank, rows in enumerate(per_rank):
        for k, mb, s, e, st, _ in rows.tolist():
            if not step - 1 <= st <= step:
                continue
            kind = KINDS[int(k)]
            ax.barh(rank, (e - s) * 1e3, left=s * 1e3, color=COLORS[kind], edgecolor="white", linewidth=0.3)
            if int(k) in COMPUTE_KINDS and (e - s) * 1e3 > 0.5:
                ax.text((s + e) / 2 * 1e3, rank, str(int(mb)), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"pipeline timeline — bubble measured {summary['measured_bubble']:.1%}, "
                 f"schedule's own (unit costs) {summary['theoretical_bubble']:.1%}")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.35), fontsize=7, ncol=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

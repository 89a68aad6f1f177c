"""Pipeline schedules as data: generators of per-rank action lists (see pipeline/actions.py).

- `one_f_one_b(p, m)`: warm-up forwards, one forward one backward, cool-down backwards; stage r keeps at most
  p - r microbatches of activations; bubble (p-1)/(m+p-1).
- `interleaved(p, v, m)`: Megatron's interleaved 1F1B over v chunks per rank ("loop" layout); bubble
  (p-1)/(v·m+p-1); needs m to be a multiple of p.
- `zero_bubble_v(p, m)`: two chunks per rank in a V, backward split into input (I) and weight (W) parts; a greedy
  list scheduler (under `unit_cost`) runs I as soon as possible, forwards while at most 2p chunk activations are alive, and W to fill
  what would be bubble.
- `forward_only(schedule)`: the forwards of a schedule, for evaluation.
Every generator's result is checked by pipeline/simulator.py in the tests.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

from .actions import B, F, I, W, Action, add_communication
from .layout import LOOP, V, StageLayout


def unit_cost(action: Action) -> float:
    """The cost model of the generators and the simulator's default: F = I = W = 1 and B = 2 per chunk (I computes
    the linear layers' input gradients, W their weight gradients: pipeline/split_backward.py)."""
    return 2.0 if action.kind == B else 1.0


class Schedule(NamedTuple):
    """A whole pipeline step: per-rank action lists and the activation memory each rank is promised to stay in
    (the most (virtual stage, microbatch) activations alive at once, from forward to the end of its backward)."""
    layout: StageLayout
    num_microbatches: int
    actions: List[List[Action]]
    max_activations: List[int]


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B.

    Args:
        num_ranks: pipeline stages p.
        num_microbatches: microbatches m (at least p).
    """
    p, m = num_ranks, num_microbatches
    _check(m >= p, f"1F1B needs num_microbatches >= pp_size to fill the pipeline; got num_microbatches={m} with "
                   f"pp_size={p}.")
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [Action(F, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(F, r, warmup + i), Action(B, r, i)]
        order += [Action(B, r, i) for i in range(m - warmup, m)]
        orders.append(order)
    layout = StageLayout(p)
    return Schedule(layout, m, add_communication(orders, layout), [min(p - r, m) for r in range(p)])


def interleaved(num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): microbatches advance in groups of p through the v chunks of each rank.

    Args:
        num_ranks: pipeline ranks p.
        num_chunks: model chunks per rank v (v·p virtual stages, chunk c of rank r is virtual stage c·p + r).
        num_microbatches: microbatches m, a multiple of p.
    """
    p, v, m = num_ranks, num_chunks, num_microbatches
    _check(v >= 2, f"The interleaved schedule needs num_model_chunks >= 2, got {v}.")
    _check(m >= p and m % p == 0, f"The interleaved schedule needs num_microbatches to be a multiple of pp_size "
                                  f"(as torch's ScheduleInterleaved1F1B); got num_microbatches={m}, pp_size={p}.")
    total = v * m

    def virtual(k: int, backward: bool) -> Tuple[int, int]:
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    orders, promise = [], []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        fwd = [Action(F, c * p + r, mb) for c, mb in (virtual(k, False) for k in range(total))]
        bwd = [Action(B, c * p + r, mb) for c, mb in (virtual(k, True) for k in range(total))]
        order = fwd[:warmup]
        for i in range(total - warmup):
            order += [fwd[warmup + i], bwd[i]]
        orders.append(order + bwd[total - warmup:])
        promise.append(min(warmup + 1, total))
    layout = StageLayout(p, v, LOOP)
    return Schedule(layout, m, add_communication(orders, layout), promise)


def zero_bubble_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """Zero-bubble V (ZB-V, Qi et al. 2024): 2 chunks per rank in a V, backward split into I and W.

    Args:
        num_ranks: pipeline ranks p (2p virtual stages).
        num_microbatches: microbatches m (at least p).
    """
    p, m = num_ranks, num_microbatches
    _check(m >= p, f"The zbv schedule needs num_microbatches >= pp_size; got num_microbatches={m}, pp_size={p}.")
    layout = StageLayout(p, 2, V)
    cap = 2 * p
    orders = _greedy(layout, m, cap)
    return Schedule(layout, m, add_communication(orders, layout), [min(cap, 2 * m)] * p)


def _greedy(layout: StageLayout, m: int, cap: int) -> List[List[Action]]:
    """List scheduling under `unit_cost`: each free rank runs a ready I (the critical path), else a ready F while
    fewer than `cap` activations are alive (the later virtual stage first), else a pending W."""
    p, last = layout.num_ranks, layout.num_stages - 1
    done: Dict[Action, float] = {}  # compute action -> finish time
    orders: List[List[Action]] = [[] for _ in range(p)]
    free = [0.0] * p
    next_f = {s: 0 for s in range(last + 1)}
    next_i = {s: 0 for s in range(last + 1)}
    pending_w: List[List[Action]] = [[] for _ in range(p)]
    alive = [0] * p
    total, idle = 3 * (last + 1) * m, 0
    while len(done) < total:
        rank = min(range(p), key=lambda r: free[r])
        t = free[rank]

        def ready(a: Action) -> bool:
            if a.kind == F:
                return a.stage == 0 or done.get(Action(F, a.stage - 1, a.microbatch), t + 1) <= t
            return done.get(Action(F, a.stage, a.microbatch), t + 1) <= t and \
                (a.stage == last or done.get(Action(I, a.stage + 1, a.microbatch), t + 1) <= t)

        stages = sorted(layout.stages_of(rank), reverse=True)
        inputs = [Action(I, s, next_i[s]) for s in stages if next_i[s] < m and ready(Action(I, s, next_i[s]))]
        forwards = [Action(F, s, next_f[s]) for s in stages if next_f[s] < m and ready(Action(F, s, next_f[s]))]
        if inputs:
            action = inputs[0]
            next_i[action.stage] += 1
            pending_w[rank].append(Action(W, action.stage, action.microbatch))
        elif forwards and alive[rank] < cap:
            action = forwards[0]
            next_f[action.stage] += 1
            alive[rank] += 1
        elif pending_w[rank]:
            action = pending_w[rank].pop(0)
            alive[rank] -= 1
        else:  # nothing to do yet: wait for the next result anywhere
            idle += 1
            if idle > 2 * p:
                raise RuntimeError(f"Schedule generation stalled (activation cap {cap} too small).")
            free[rank] = min([f for f in done.values() if f > t] + [t + 1])
            continue
        idle = 0
        orders[rank].append(action)
        done[action] = free[rank] = t + unit_cost(action)
    return orders


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards (and their transfers) in the same order: evaluation, no activations kept."""
    compute = [[a for a in actions if a.kind == F] for actions in schedule.actions]
    return Schedule(schedule.layout, schedule.num_microbatches, add_communication(compute, schedule.layout),
                    [0] * schedule.layout.num_ranks)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


STYLES = ("1f1b", "interleaved", "zbv")


def layout_for(style: str, num_ranks: int, num_chunks: int) -> StageLayout:
    """Where the virtual stages of `style` live.

    Args:
        style: "1f1b", "interleaved" or "zbv".
        num_ranks: pipeline ranks.
        num_chunks: model chunks per rank (1 for "1f1b", 2 for "zbv").
    """
    if style not in STYLES:
        raise ValueError(f"Unknown pp_style {style!r}; use one of {STYLES}.")
    expected = {"1f1b": num_chunks == 1, "interleaved": num_chunks >= 2, "zbv": num_chunks == 2}[style]
    if not expected:
        need = {"1f1b": "num_model_chunks=1", "interleaved": "num_model_chunks >= 2", "zbv": "num_model_chunks=2"}
        raise ValueError(f"pp_style={style!r} needs {need[style]}, got num_model_chunks={num_chunks}.")
    return StageLayout(num_ranks, num_chunks, V if style == "zbv" else LOOP)


def make_schedule(style: str, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """The schedule of `style` for p ranks, v chunks per rank and m microbatches (raises ValueError if invalid).

    Args:
        style: "1f1b", "interleaved" or "zbv".
        num_ranks: pipeline ranks p.
        num_chunks: model chunks per rank v.
        num_microbatches: microbatches m per step.
    """
    layout_for(style, num_ranks, num_chunks)
    if style == "1f1b":
        return one_f_one_b(num_ranks, num_microbatches)
    if style == "interleaved":
        return interleaved(num_ranks, num_chunks, num_microbatches)
    return zero_bubble_v(num_ranks, num_microbatches)

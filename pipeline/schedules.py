"""Pipeline schedules as data: generators of per-rank action lists (see pipeline/actions.py).

- `one_f_one_b(p, m)`: warm-up forwards, one forward one backward, cool-down backwards; stage r keeps at most
  p - r microbatches of activations; bubble (p-1)/(m+p-1).
- `interleaved(p, v, m)`: Megatron's interleaved 1F1B over v chunks per rank ("loop" layout); bubble
  (p-1)/(v·m+p-1); needs m to be a multiple of p.
- `zero_bubble_v(p, m)`: two chunks per rank in a V, backward split into input (I) and weight (W) parts, W filling
  what would be bubble: the ZB-V paper's order, or for few microbatches a greedy list schedule; 2p activations.
- `dual_pipe_v(p, m)`: the same V, full backwards (B) in the steady state and split ones on the ramps (DualPipeV);
  2p + 1 activations.
- `forward_only(schedule)`: the forwards of a schedule, for evaluation.
Which generator a `pp_style` uses, and what else it implies, is in pipeline/styles.py. Every generator's result is
checked by pipeline/simulator.py in the tests.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from .actions import B, F, I, W, Action, Schedule, add_communication
from .layout import LOOP, V, StageLayout
from .simulator import simulate, unit_cost


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

    The paper's hand-made order (`_zbv_tokens`: each W right after its I in the steady state, which keeps the
    ranks in step when real F, I and W times differ) or, where it is shorter under `unit_cost` (few microbatches:
    the hand-made order needs 2p - 1 and drops the missing ones), the greedy list schedule. At most 2p chunk
    activations alive per rank, as 1F1B with p stages of two chunks.

    Args:
        num_ranks: pipeline ranks p (2p virtual stages).
        num_microbatches: microbatches m (at least p).
    """
    p, m = num_ranks, num_microbatches
    _check(m >= p, f"The zbv schedule needs num_microbatches >= pp_size; got num_microbatches={m}, pp_size={p}.")
    layout, promise = StageLayout(p, 2, V), [min(2 * p, 2 * m)] * p
    candidates = [[_from_tokens(layout, r, _zbv_tokens(p, r, max(m, 2 * p - 1)), m) for r in range(p)],
                  _greedy(layout, m, 2 * p)]
    schedules = [Schedule(layout, m, add_communication([_merge_first_stage(o) for o in orders], layout), promise)
                 for orders in candidates]
    return min(schedules, key=lambda s: simulate(s).makespan)  # ties: the hand-made order


def dual_pipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe folded into a V, as torch's ScheduleDualPipeV): in the steady state each
    rank runs a forward of one chunk then a full backward (B) of the other; I and W are split only to fill the
    ramps. Fewer split backwards than zbv (a B costs less than I + W), one more chunk activation: 2p + 1.

    Args:
        num_ranks: pipeline ranks p (2p virtual stages).
        num_microbatches: microbatches m (at least 2p).
    """
    p, m = num_ranks, num_microbatches
    _check(m >= 2 * p, f"The dualpipev schedule needs num_microbatches >= 2 * pp_size; got num_microbatches={m}, "
                       f"pp_size={p}: give num_microbatches >= {2 * p} or use pp_style='zbv'.")
    layout = StageLayout(p, 2, V)
    orders = [_merge_first_stage(_from_tokens(layout, r, _dual_tokens(p, r, m), m)) for r in range(p)]
    return Schedule(layout, m, add_communication(orders, layout), [2 * p + 1] * p)


# A hand-made V order is a list of (chunk, kind) tokens per rank; `_from_tokens` numbers the microbatches.
_ANY = -1  # the chunk of a W token: the oldest pending W of any chunk


def _zbv_tokens(p: int, r: int, m: int) -> List[Tuple[int, str]]:
    """ZB-V on rank r for m >= 2p - 1 microbatches: forwards of chunk 0, then of both chunks, F I W of chunk 1,
    the steady state F0 I0 W0 F1 I1 W1 (without F0 once all are in), and the cool-down's I then the Ws."""
    tokens = [(0, F)] * (2 * (p - r) - 1) + [(1, F), (0, F)] * r + [(1, F), (1, I), (1, W)] * (p - r)
    forwards0 = 2 * p - r - 1
    for k in range(m - p):
        tokens += [(0, F)] * (forwards0 + k < m) + [(0, I), (0, W), (1, F), (1, I), (1, W)]
    return tokens + [(0, I), (1, I)] * r + [(0, I), (0, W)] * (p - r) + [(1, W)] * r + [(0, W)] * r


def _dual_tokens(p: int, r: int, m: int) -> List[Tuple[int, str]]:
    """DualPipeV on rank r for m >= 2p microbatches (the phases of torch's ScheduleDualPipeV, whose overlapped
    F + B pairs run one after the other here)."""
    tokens = [(0, F)] * (2 * (p - r - 1)) + [(0, F), (1, F)] * (r + 1) + [(1, I), (_ANY, W), (1, F)] * (p - r - 1)
    for k in range(m - 2 * p + r + 1):
        tokens += [(0, F), (1, B), (1, F), (0, B)]
    tokens += [(1, B), (1, F), (0, B)] * (p - r - 1)
    split = False  # the second half of the cool-down splits its backwards
    for k in range(r + 1):
        split = split or (k == (r + 1) // 2 and r % 2 == 1)
        tokens.append((1, I if split else B))
        split = split or (k == (r + 1) // 2 and r % 2 == 0)
        tokens.append((0, I if split else B))
    return tokens + [(_ANY, W), (0, I if split else B)] * (p - r - 1) + [(_ANY, W)] * (r + 1)


def _from_tokens(layout: StageLayout, rank: int, tokens: List[Tuple[int, str]], m: int) -> List[Action]:
    """Rank `rank`'s actions: F, I and B take the chunk's next microbatch, W the oldest pending W (of its chunk,
    or of any); microbatches >= m are left out (with their W)."""
    stages, nxt, pending, order = layout.stages_of(rank), {}, [], []
    for chunk, kind in tokens:
        if kind == W:
            due = [w for w in pending if chunk == _ANY or w.stage == stages[chunk]]
            if due:
                pending.remove(due[0])
                order.append(due[0])
            continue
        key = (chunk, F if kind == F else I)
        mb = nxt[key] = nxt.get(key, -1) + 1
        if mb < m:
            order.append(Action(kind, stages[chunk], mb))
            if kind == I:
                pending.append(Action(W, stages[chunk], mb))
    return order


def _merge_first_stage(order: List[Action]) -> List[Action]:
    """Virtual stage 0's I sends nothing, so an I there followed by its W becomes one B (one autograd pass: a
    full backward costs less than the two halves)."""
    out: List[Action] = []
    for a in order:
        if a.kind == W and a.stage == 0 and out and out[-1] == Action(I, 0, a.microbatch):
            out[-1] = Action(B, 0, a.microbatch)
        else:
            out.append(a)
    return out


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


"""Expert parallelism: a mixture-of-experts layer's routed experts split over the ep group (a rank holds E / ep of
them whole), tokens sent to the ranks holding their experts by all-to-all and the results sent back, dropless, so
the layer computes what one process computes.

Works on transformers 5's experts modules as they are (stacked 3-D weights, `forward(hidden_states, top_k_index,
top_k_weights)`, the family's own or the experts interface's implementation), by two hooks around the module's own
forward:

- dispatch (forward pre-hook): each token goes once to every ep rank holding at least one of its top-k experts
  (never twice to one rank, and not at all to a rank holding none of them: the minimum traffic), with its routing
  weights; counts are exchanged first, so every rank receives a variable number of rows. The receiver expands its
  rows into one (token, local expert) pair per routed choice and calls the module's own forward on the pairs with
  top-1 routing over its local experts (valid indices only: no sentinel the family's forward must know).
- combine (forward hook): the pairs' outputs are summed per received row, sent back by the reverse all-to-all and
  added up per token.

Both exchanges are autograd functions doing their collectives in a fixed order, so backward runs the same
all-to-alls in reverse on every rank. A dispatch sends the rows, routing weights and expert indices as one byte-packed
all-to-all (its backward the two gradients as one): per layer and microbatch, a count exchange and four row
exchanges (two forward, two backward). A rank that receives no tokens still ties what it received and its expert
parameters into the graph with a zero term: its dispatch's backward exchange runs (the senders wait for it), and
every rank produces a (zero) gradient for its experts in every backward, so the data-parallel buckets of expert
gradients launch in the same order on every rank and nothing waits for a gradient that never comes.

Tensor parallel inside an expert (tp > 1, transformers' `moe_tp_experts`) composes: dispatch runs before the tp
split's hooks and combine after them (each tp rank exchanges with the ep ranks of its own tp rank).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from pipeline.context import Axis

from ..lazy_sources import set_expert_rows
from ..layer.spec import copy_tp_spec

__all__ = ["ExpertTraffic", "TRAFFIC", "expert_parameters", "split_experts_over_ep"]

_ROUTING = ("hidden_states", "top_k_index", "top_k_weights")  # the experts forward's first three arguments


@dataclass
class ExpertTraffic:
    """Bytes of token activations the dispatch and combine all-to-alls sent to other ranks (forward and backward),
    for benchmarks; `reset()` between measurements."""
    bytes_sent: int = 0
    rows_sent: int = 0  # token rows sent to another rank by dispatches (each comes back once by a combine)

    def reset(self) -> None:
        self.bytes_sent = self.rows_sent = 0


TRAFFIC = ExpertTraffic()


def expert_parameters(module: nn.Module, num_experts: int) -> List[Tuple[str, nn.Parameter]]:
    """The experts module's own parameters stacked over its experts (leading dimension `num_experts`)."""
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == num_experts]


def split_experts_over_ep(module: nn.Module, ep: Axis, num_experts: int) -> List[str]:
    """Keep this ep rank's E / ep experts of `module` (its stacked parameters sliced along dim 0; `num_experts`
    becomes the local count) and hook the dispatch / combine exchanges; returns the names of the sliced
    parameters (relative to `module`). Call after the tp split's hooks are registered, if any."""
    size, rank, group = ep.size, ep.rank, ep.group
    local = num_experts // size
    names = []
    for name, p in expert_parameters(module, num_experts):
        kept = nn.Parameter(p.detach().narrow(0, rank * local, local).clone(), requires_grad=p.requires_grad)
        copy_tp_spec(p, kept)  # split over tp on another dimension as well, if at all
        set_expert_rows(kept, (rank * local, local))  # (lazy init: which experts to materialize)
        setattr(module, name, kept)
        names.append(name)
    module.num_experts = local
    exchange = _Exchange(group, size, rank, local, _routing_positions(module))
    module.register_forward_pre_hook(exchange.dispatch, with_kwargs=True, prepend=True)
    module.register_forward_hook(exchange.combine)
    return names


def _routing_positions(module: nn.Module) -> Dict[str, int]:
    """{name: position} of the experts forward's hidden states, expert indices and routing weights (its first three
    parameters, whatever the family calls them, e.g. GPT-OSS's `router_indices, routing_weights`)."""
    forward = inspect.unwrap(type(module).forward)
    params = [p for p in inspect.signature(forward).parameters][1:4]
    if len(params) < 3:
        raise TypeError(f"{type(module).__name__}.forward takes {params}; expert parallelism needs transformers' "
                        f"experts signature (hidden_states, top_k_index, top_k_weights).")
    return {name: i for i, name in enumerate(params)}


class _Route(NamedTuple):
    """One dispatch's plan, kept until its combine."""
    send_tokens: Tensor       # [rows sent] the token of each row sent, grouped by destination rank
    send_counts: List[int]    # rows sent to each rank
    recv_counts: List[int]    # rows received from each rank
    pair_rows: Tensor         # [pairs] the received row of each (row, local expert) pair
    num_tokens: int
    received: Tuple[Tensor, ...]      # the rows and weights received, and this rank's expert parameters: with no
    # pairs the experts' output may not depend on them, so a zero term keeps them (and the dispatch's backward
    # exchange, which the senders wait for) in the graph


@dataclass
class _Exchange:
    """The dispatch / combine hooks of one experts module (see the module docstring)."""
    group: ProcessGroup
    size: int
    rank: int
    local: int  # experts per rank
    positions: Dict[str, int]
    pending: List[_Route] = field(default_factory=list)

    # eager inside a compiled layer (regional compilation): the exchange's row counts depend on the routing (data):
    # each hook is one graph break
    @torch.compiler.disable
    def dispatch(self, module: nn.Module, args: tuple, kwargs: dict):
        args, kwargs = list(args), dict(kwargs)
        hidden, index, weights = (_take(args, kwargs, name, pos) for name, pos in self.positions.items())
        dest = index // self.local                                             # [T, K] the rank of each choice
        to = torch.stack([(dest == r).any(-1) for r in range(self.size)])      # [ep, T] token goes to rank r
        send_tokens = torch.cat([to[r].nonzero().squeeze(-1) for r in range(self.size)])
        send_counts = to.sum(-1).tolist()
        recv_counts = _exchange_counts(send_counts, self.group)
        row_rank = torch.repeat_interleave(torch.arange(self.size, device=index.device),
                                           torch.tensor(send_counts, device=index.device))
        mine = dest[send_tokens] == row_rank[:, None]                          # [rows, K] choices on that rank
        local_index = torch.where(mine, index[send_tokens] - row_rank[:, None] * self.local, -1)
        row_weights = torch.where(mine, weights[send_tokens], torch.zeros((), dtype=weights.dtype,
                                                                          device=weights.device))
        recv_hidden, recv_weights, recv_index = _Dispatch.apply(hidden[send_tokens], row_weights, local_index,
                                                                send_counts, recv_counts, self.group)
        pair_rows, pair_choice = (recv_index >= 0).nonzero(as_tuple=True)      # one pair per local routed choice
        received = (recv_hidden, recv_weights, *(p for p in module.parameters(recurse=False) if p.requires_grad))
        self.pending.append(_Route(send_tokens, send_counts, recv_counts, pair_rows, hidden.shape[0], received))
        values = {"hidden_states": recv_hidden[pair_rows], "top_k_index": recv_index[pair_rows, pair_choice, None],
                  "top_k_weights": recv_weights[pair_rows, pair_choice, None]}
        for (name, pos), key in zip(self.positions.items(), _ROUTING):
            _put(args, kwargs, name, pos, values[key])
        return tuple(args), kwargs

    @torch.compiler.disable
    def combine(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        route = self.pending.pop()
        rows = sum(route.recv_counts)
        summed = output.new_zeros((rows, output.shape[-1])).index_add(0, route.pair_rows, output)
        if route.pair_rows.numel() == 0:  # no tokens here: the exchange's backward still runs, the expert
            # parameters still get a (zero) gradient
            summed = summed + sum(t.sum() for t in route.received if t.requires_grad) * 0
        back = _Combine.apply(summed, route.recv_counts, route.send_counts, self.group)
        return output.new_zeros((route.num_tokens, output.shape[-1])).index_add(0, route.send_tokens, back)


def _take(args: list, kwargs: dict, name: str, pos: int) -> Tensor:
    if len(args) > pos:
        return args[pos]
    if name in kwargs:
        return kwargs[name]
    raise TypeError(f"the experts module was called without `{name}` (positional argument {pos}); expert "
                    f"parallelism needs it to route tokens.")


def _put(args: list, kwargs: dict, name: str, pos: int, value: Tensor) -> None:
    if len(args) > pos:
        args[pos] = value
    else:
        kwargs[name] = value


def _exchange_counts(send_counts: List[int], group: ProcessGroup) -> List[int]:
    mine = torch.tensor(send_counts, dtype=torch.int64)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=group)
    return theirs.tolist()


def _all_to_all(x: Tensor, out_counts: List[int], in_counts: List[int], group: ProcessGroup) -> Tensor:
    """Rows of `x` ([sum(in_counts), ...], grouped by destination rank) exchanged over `group`."""
    out = x.new_empty((sum(out_counts),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_counts, in_counts, group=group)
    return out


def _exchange_rows(parts: Tuple[Tensor, ...], out_counts: List[int], in_counts: List[int],
                   group: ProcessGroup) -> Tuple[Tensor, ...]:
    """Several row-aligned tensors (any dtypes) exchanged in ONE all-to-all: each row's bytes are laid side by side
    and split apart again on arrival (bit-exact; one collective's latency instead of one per tensor). Counts the
    first tensor's bytes sent to other ranks in TRAFFIC (the token activations; the others are routing data)."""
    rows = parts[0].shape[0]
    flat = [_dense_rows(t, rows) for t in parts]
    sent = sum(in_counts) - in_counts[dist.get_rank(group)]
    TRAFFIC.bytes_sent += sent * flat[0].shape[1] * flat[0].element_size()
    if len(parts) == 1:
        return (_all_to_all(parts[0], out_counts, in_counts, group),)
    out = _all_to_all(torch.cat([f.view(torch.uint8) for f in flat], dim=1), out_counts, in_counts, group)
    received, at = [], 0
    for t, f in zip(parts, flat):
        width = f.shape[1] * f.element_size()
        part = out[:, at:at + width].clone(memory_format=torch.contiguous_format)  # own storage: aligned for the view
        received.append(part.view(t.dtype).reshape((out.shape[0],) + t.shape[1:]))
        at += width
    return tuple(received)


def _dense_rows(t: Tensor, rows: int) -> Tensor:
    """`t` as [rows, features] with unit stride along features (a byte view needs it; autograd's zero gradients
    may be expanded with stride 0 even where `is_contiguous()` holds)."""
    flat = t.reshape(rows, math.prod(t.shape[1:]))
    return flat if flat.stride(-1) == 1 and flat.is_contiguous() else flat.clone(memory_format=torch.contiguous_format)


class _Dispatch(torch.autograd.Function):
    """Token rows, their routing weights and local expert indices to the ranks holding their experts, in one
    exchange; backward sends the gradients of the rows and weights back (one exchange)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weights: Tensor, index: Tensor, send_counts: List[int],
                recv_counts: List[int], group: ProcessGroup):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        TRAFFIC.rows_sent += sum(send_counts) - send_counts[dist.get_rank(group)]
        received = _exchange_rows((hidden, weights, index), recv_counts, send_counts, group)
        ctx.mark_non_differentiable(received[2])
        return received

    @staticmethod
    def backward(ctx, grad_hidden: Tensor, grad_weights: Tensor, grad_index: Optional[Tensor]):
        send_counts, recv_counts = ctx.counts
        grad_hidden, grad_weights = _exchange_rows((grad_hidden, grad_weights), send_counts, recv_counts, ctx.group)
        return grad_hidden, grad_weights, None, None, None, None


class _Combine(torch.autograd.Function):
    """The experts' outputs back to the tokens' ranks; backward sends their gradients to the experts again."""

    @staticmethod
    def forward(ctx, out: Tensor, recv_counts: List[int], send_counts: List[int], group: ProcessGroup):
        ctx.counts, ctx.group = (recv_counts, send_counts), group
        return _exchange_rows((out,), send_counts, recv_counts, group)[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        recv_counts, send_counts = ctx.counts
        return _exchange_rows((grad,), recv_counts, send_counts, ctx.group)[0], None, None, None

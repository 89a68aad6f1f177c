"""Backward split in two (zero-bubble schedules): I computes the gradients of a stage's inputs, W later those of
its weights, without computing anything twice.

I finds the "split points" of the autograd graph: nodes on a path to an input that also feed a weight through
nodes that do not lead to any input (e.g. the matmul of a linear layer: one edge to its input activation, one to
its weight). It runs the backward restricted to the inputs and records, with a pre-hook, the gradient arriving at
each split point. W then runs, for each split point, a backward from that node (a `GradientEdge`) restricted to the
weights behind it; gradients accumulate into `.grad` as usual (post-accumulate hooks fire). This follows the idea of
torch.distributed.pipelining's stage_backward_input / stage_backward_weight.

When the weights behind two split points overlap (a weight used twice in one stage), I falls back to the full
backward and W has nothing left to do; without inputs (the first stage) I has nothing to do and W runs the full
backward. Both stay exact.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


class WeightBackward(NamedTuple):
    """What W still has to run: per split point, the edges into it, their gradients and the weights behind it."""
    calls: List[tuple]


def _children(node: Node) -> List[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[torch.Tensor]) -> WeightBackward:
    """The I half: accumulate the gradients of `inputs` (leaves) and return the W half's work.

    Args:
        roots: output tensors (or the loss) to backpropagate from.
        grads: their gradients (None for a scalar loss).
        inputs: the stage's input tensors that require grad (received activations); may be empty.
    """
    roots, grads = list(roots), list(grads)
    if not inputs:  # the first stage: everything is weight gradient
        return WeightBackward([(roots, grads, None)])
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    reaches: Dict[Node, bool] = {}
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:  # post-order: does the node lead to an input?
        node = stack[-1]
        if node in reaches:
            stack.pop()
            continue
        pending = [c for c in _children(node) if c not in reaches]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        reaches[node] = node in input_nodes or any(reaches[c] for c in _children(node))
    behind: Dict[Node, Dict[Node, None]] = {}  # split point -> accumulators of the weights behind it
    owner: Dict[Node, Node] = {}   # weight accumulator -> its split point
    shared = False
    for node, on_path in reaches.items():
        if not on_path:
            continue
        for child in _children(node):
            if reaches[child]:
                continue
            for acc in _weights_below(child, reaches):
                if owner.setdefault(acc, node) is not node:
                    shared = True
                behind.setdefault(node, {})[acc] = None
    free_roots = [(t, g) for t, g in zip(roots, grads) if t.grad_fn is not None and not reaches[t.grad_fn]]
    if shared or free_roots:  # not separable into disjoint parts: do it all now
        torch.autograd.backward(roots, grads)
        return WeightBackward([])
    captured: Dict[Node, tuple] = {}
    handles = [node.register_prehook(lambda g, node=node: captured.__setitem__(node, g)) for node in behind]
    try:
        torch.autograd.backward(roots, grads, inputs=list(inputs), retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    calls = []
    for node, accs in behind.items():
        slots = [(GradientEdge(node, i), g) for i, g in enumerate(captured.get(node, ())) if g is not None]
        if slots:
            calls.append(([e for e, _ in slots], [g for _, g in slots], [acc.variable for acc in accs]))
    return WeightBackward(calls)


def _weights_below(node: Node, reaches: Dict[Node, bool]) -> List[Node]:
    """AccumulateGrad nodes reachable from `node` through nodes that lead to no input."""
    found, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if hasattr(n, "variable"):
            found.append(n)
        stack.extend(c for c in _children(n) if not reaches.get(c, False))
    return found


def backward_weight(work: WeightBackward) -> None:
    """The W half: accumulate the weights' gradients recorded by `backward_input`.

    Args:
        work: the result of `backward_input` for the same microbatch and stage.
    """
    for edges, grads, weights in work.calls:
        if weights is None:
            torch.autograd.backward(edges, grads)
        else:
            torch.autograd.backward(edges, grads, inputs=weights)

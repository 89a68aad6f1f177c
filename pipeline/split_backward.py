"""Backward split in two (zero-bubble schedules): I computes the gradients of a stage's inputs, W later those of
its linear layers' weights, without computing anything twice.

Linear layers compute through `linear(x, weight, bias, transposed)`. A forward run under `deferring(store)` binds
its linear layers to `store`: their backward then computes the input gradient only and leaves the layer input and
output gradient in the store; every other gradient (norms, embeddings, the stage's inputs) comes out of that
backward as usual. `store.run()` (W) computes the weight and bias gradients (one matmul and one sum each) and
accumulates them through autograd in one engine call, so tensor hooks and post-accumulate hooks fire as for any
gradient. Without a store a linear layer is `F.linear`. This is Megatron-LM / zero-bubble's WeightGradStore idea;
torch.distributed.pipelining instead splits the autograd graph (stage_backward_input / stage_backward_weight),
which costs a graph walk and an engine call per weight-feeding node (measured here: the split backward took 14%
longer than the plain one).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["WeightGradStore", "bound_store", "deferring", "linear", "linear_param_grads", "stored_linear"]

_store: Optional["WeightGradStore"] = None  # the store the running forward binds its linear layers to


def linear_param_grads(x: Tensor, grad: Tensor, transposed: bool, has_bias: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """(weight gradient, bias gradient or None) of `x @ W^T + b` (`transposed`: W stored (in, out), `x @ W + b`)
    for the output gradient `grad`."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    weight = x2.t() @ g2 if transposed else g2.t() @ x2
    return weight, (g2.sum(0) if has_bias else None)


class WeightGradStore:
    """Weight-gradient work left for later: one entry per linear layer call (its input and output gradient)."""

    def __init__(self) -> None:
        self._work: List[tuple] = []

    def add(self, weight: Tensor, bias: Optional[Tensor], x: Tensor, grad: Tensor, transposed: bool) -> None:
        self._work.append((weight, bias, x, grad, transposed))

    def __len__(self) -> int:
        return len(self._work)

    def take(self) -> Dict[int, Tuple[Tensor, Tensor]]:
        """{id(parameter): (parameter, its gradient)} over the stored calls (a layer called twice: summed); the store
        is emptied."""
        out: Dict[int, Tuple[Tensor, Tensor]] = {}
        for weight, bias, x, grad, transposed in self._work:
            for param, g in zip((weight, bias), linear_param_grads(x, grad, transposed, bias is not None)):
                if param is not None:
                    out[id(param)] = (param, g if id(param) not in out else out[id(param)][1] + g)
        self._work = []
        return out

    def run(self) -> None:
        """W: accumulate the stored weight (and bias) gradients into `.grad` (one autograd call); the store is
        emptied."""
        taken = list(self.take().values())
        if taken:
            torch.autograd.backward(_Deliver.apply([g for _, g in taken], *[p for p, _ in taken]))


@contextlib.contextmanager
def deferring(store: Optional[WeightGradStore]) -> Iterator[None]:
    """Bind the linear layers of the forward run inside to `store` (None: compute weight gradients as usual)."""
    global _store
    previous, _store = _store, store
    try:
        yield
    finally:
        _store = previous


def bound_store() -> Optional[WeightGradStore]:
    """The store the running forward binds its linear layers to (None outside `deferring`)."""
    return _store


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, transposed: bool = False) -> Tensor:
    """`x @ W^T + b` (`transposed`: `x @ W + b`, W stored (in, out) as transformers' Conv1D); inside `deferring`
    its weight gradient goes to the store."""
    if _store is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight.t() if transposed else weight, bias)
    return stored_linear(x, weight, bias, transposed, _store)


def stored_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool,
                  store: WeightGradStore) -> Tensor:
    """`linear` whose backward computes the input gradient only and leaves the weight and bias gradients to
    `store` (their autograd gradient is None)."""
    return _StoredLinear.apply(x, weight, bias, transposed, store)


class _StoredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool,
                store: WeightGradStore) -> Tensor:
        ctx.save_for_backward(x, weight)
        # the parameters themselves, for the store: a saved tensor may come back as another tensor object (activation
        # checkpointing's recomputation returns detached copies), which autograd could not deliver a gradient to
        ctx.params, ctx.transposed, ctx.store = (weight, bias), transposed, store
        return F.linear(x, weight.t() if transposed else weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        ctx.store.add(*ctx.params, x, grad, ctx.transposed)
        grad_x = grad @ (weight.t() if ctx.transposed else weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


class _Deliver(torch.autograd.Function):
    """Forward: a scalar that depends on `params`. Backward: the precomputed gradients of `params`."""

    @staticmethod
    def forward(ctx, grads: List[Tensor], *params: Tensor) -> Tensor:
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)

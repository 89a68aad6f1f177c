"""Column- and row-parallel linear layers (Megatron style) that keep the native weight layout and parameter names.

Both accept torch.nn.Linear (weight (out, in)) and transformers' Conv1D (weight (in, out), forward x @ W + b), so
the sharded model's state_dict keys stay the Hugging Face ones.

With `sequence_dim` set (split_gather sequence parallelism, in training mode) the input of a column layer is this
rank's sequence shard: it is all-gathered along that dimension, and only the shard is kept for backward, which
gathers it again (as Megatron-LM does), so the saved activation is 1/tp of the full one. A row layer then
reduce-scatters its output along the sequence instead of all-reducing it. Inside a compiled layer (regional
compilation) the compiled graph decides what its backward keeps (the gathered input, or its recomputation).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.split_backward import linear, linear_param_grads, stored_linear

from .axis import Axis, OnAxis, checked_axis
from .comm import gather_from_sequence, gather_from_tp, reduce_from_tp, reduce_scatter_to_sequence, split_to_tp
from .conv1d import is_conv1d
from .region import RegionInput, RegionSlot
from .sequence_shard import SequenceShard, split_dim
from .spec import UnshardedStateDict, TPSpec, get_tp_spec, set_tp_spec, shard_parameter, zero_padding

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _native_shape(module: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, is_conv1d) of an nn.Linear or a transformers Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if is_conv1d(module):
        in_features, out_features = module.weight.shape
        return in_features, out_features, True
    raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}")


def _load_native(layer: nn.Module, module: nn.Module, rank: int, world: int) -> None:
    """Replace the layer's (meta) parameters by this rank's shards of the native module's parameters."""
    for name in ("weight", "bias"):
        if getattr(layer, name) is not None:
            setattr(layer, name, shard_parameter(getattr(module, name), get_tp_spec(getattr(layer, name)), rank, world))


class _LinearOnGathered(torch.autograd.Function):
    """`full @ W^T + b` (Conv1D: `full @ W + b`) that saves the sequence shard instead of `full` and gathers it
    again in backward. `full` is the all-gather of `shard` (its gradient flows back through that gather)."""

    @staticmethod
    def forward(ctx, full: Tensor, shard: Tensor, weight: Tensor, bias: Tensor | None, source: SequenceShard,
                is_conv1d: bool) -> Tensor:
        ctx.save_for_backward(shard, weight)
        ctx.source, ctx.is_conv1d, ctx.has_bias = source, is_conv1d, bias is not None
        return F.linear(full, weight.t() if is_conv1d else weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shard, weight = ctx.saved_tensors
        w = weight.t() if ctx.is_conv1d else weight  # (out, in)
        grad_full = grad @ w if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        full = ctx.source.gather(shard, needed=ctx.needs_input_grad[2])
        if ctx.needs_input_grad[2]:
            grad_weight, _ = linear_param_grads(full, grad, ctx.is_conv1d, False)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_full, None, grad_weight, grad_bias, None, None


class ColumnParallelLinear(OnAxis, UnshardedStateDict, nn.Module):
    """Linear layer whose output features are split over the TP group; input gradient is all-reduced.

    With `n_fused` > 1 the output is made of equal fused areas (e.g. q, k, v) and each area is split separately.
    `padded_out_features` pads the output dim with zero rows (vocab-parallel LM head with a vocab not divisible by tp).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: Axis,
        *,
        bias: bool = True,
        gather_output: bool = False,
        is_conv1d: bool = False,
        n_fused: int = 1,
        padded_out_features: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = checked_axis(tp, type(self).__name__)
        padded = out_features if padded_out_features is None else padded_out_features
        if padded < out_features or padded % (n_fused * self.tp_size) or out_features % n_fused:
            raise ValueError(f"cannot split {out_features} (padded {padded}) outputs into {n_fused} fused areas "
                             f"over {self.tp_size} ranks")
        if n_fused > 1 and padded != out_features:
            raise ValueError("padding is not supported together with fused outputs")
        self.in_features = in_features
        self.full_out_features = out_features
        self.padded_out_features = padded
        self.out_features = padded // self.tp_size
        self.gather_output = gather_output
        # a vocab-parallel LM head gathers (unpadded) logits in eval mode, for evaluation and generation
        self.gather_output_in_eval = False
        self.is_conv1d = is_conv1d
        self.n_fused = n_fused
        # a region member (layer/region.py): sibling projections (q, k, v; gate, up) that read exactly the
        # enclosing module's input share one entry into the tp region, so their summed input gradient is all-reduced
        # (or, with sequence parallelism, reduce-scattered) once, not once each; any other input enters here
        self.region_slot = RegionSlot()
        # split_gather sequence parallelism: the sequence dimension of the input (None: off)
        self.sequence_dim: int | None = None
        # compute the weight gradient while the input gradient is summed over tp (layer/deferred.py)
        self.defer_weight_grad = True

        shape = (in_features, self.out_features) if is_conv1d else (self.out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype)) if bias else None
        full_size = None if padded_out_features is None else out_features
        pad_to = None if padded_out_features is None else padded
        set_tp_spec(self.weight, TPSpec(1 if is_conv1d else 0, n_fused, full_size, pad_to, group=tp.group))
        if self.bias is not None:
            set_tp_spec(self.bias, TPSpec(0, n_fused, full_size, pad_to, group=tp.group))
        if self.weight.device.type != "meta":  # meta: parameters are replaced right after
            self.reset_parameters()

    @property
    def region_input(self) -> RegionInput | None:
        """The enclosing region's input while the sharder's region hooks run it (its region_slot, layer/region.py)."""
        return self.region_slot.region

    @region_input.setter
    def region_input(self, region: RegionInput | None) -> None:
        self.region_slot.region = region

    @property
    def output_start(self) -> int:
        """Global index of this rank's first output feature (meaningful for n_fused == 1, e.g. vocab_start)."""
        return self.tp_rank * self.out_features

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear-style uniform init of the shard; padded output rows are zero."""
        bound = 1.0 / math.sqrt(self.in_features)
        self.weight.uniform_(-bound, bound)
        if self.bias is not None:
            self.bias.uniform_(-bound, bound)
        for p in (self.weight, self.bias):
            if p is not None:
                zero_padding(p, get_tp_spec(p), self.tp_rank, self.tp_size)

    @classmethod
    def from_native_module(
        cls,
        module: nn.Module,
        tp: Axis,
        gather_output: bool = False,
        n_fused: int = 1,
        padded_out_features: int | None = None,
    ) -> "ColumnParallelLinear":
        """Shard an nn.Linear or transformers Conv1D; the native module is left untouched."""
        in_features, out_features, is_conv1d = _native_shape(module)
        layer = cls(in_features, out_features, tp, bias=module.bias is not None, gather_output=gather_output,
                    is_conv1d=is_conv1d, n_fused=n_fused, padded_out_features=padded_out_features,
                    device="meta", dtype=module.weight.dtype)
        _load_native(layer, module, layer.tp_rank, layer.tp_size)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        region = self.region_input
        region = region if region is not None and region.holds(x) else None
        if self.sequence_dim is not None and self.training:
            out = self._forward_on_sequence_shard(x, region)
        else:
            region = region if region is not None else RegionInput(x, self.tp_group, members=(self,))
            x = region.copied()
            if region.defers(self):
                out = stored_linear(x, self.weight, self.bias, self.is_conv1d, region.deferred.store)
            else:
                out = linear(x, self.weight, self.bias, self.is_conv1d)
        return self.gather(out) if self.gathers_output else out

    def _forward_on_sequence_shard(self, x: Tensor, region) -> Tensor:
        if torch.compiler.is_compiling():  # the graph saves what its backward needs (SequenceShard is Python state)
            gathered = region is not None and region.shard is not None
            full = x if gathered else gather_from_sequence(x, self.sequence_dim, self.tp_group)
            return linear(full, self.weight, self.bias, self.is_conv1d)
        if region is not None and region.shard is not None:  # the region gathered it once for all
            (shard, source), full = region.shard, x
        else:  # `x` is a sequence shard: gather it here
            dim = split_dim(x, self.sequence_dim)
            shard, source = x, SequenceShard(dim, self.tp_group)
            full = gather_from_sequence(x, dim, self.tp_group)
        source.readers += 1
        return _LinearOnGathered.apply(full, shard.detach(), self.weight, self.bias, source, self.is_conv1d)

    @property
    def gathers_output(self) -> bool:
        """Does forward return the full output (else this rank's columns)? A vocab-parallel head gathers it wherever
        no backward follows (eval mode, or a no-grad call in train mode: `generate`, a metric), so a caller never sees
        a vocabulary shard it could mistake for the logits."""
        return self.gather_output or (self.gather_output_in_eval and not (self.training and torch.is_grad_enabled()))

    def gather(self, out: Tensor) -> Tensor:
        """The full, unpadded output (fused areas in their native order) from every rank's columns `out`."""
        out = gather_from_tp(out, -1, self.tp_group)
        if self.n_fused > 1 and self.tp_size > 1:
            # [a0 b0 c0 | a1 b1 c1 | ...] -> [a0 a1 ... | b0 b1 ... | c0 c1 ...]
            step = self.out_features // self.n_fused
            out = out.unflatten(-1, (self.tp_size, self.n_fused, step)).transpose(-3, -2).flatten(-3)
        if self.padded_out_features != self.full_out_features:
            out = out[..., : self.full_out_features]
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(full={self.full_out_features}, padded={self.padded_out_features}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, n_fused={self.n_fused}, is_conv1d={self.is_conv1d}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class RowParallelLinear(OnAxis, UnshardedStateDict, nn.Module):
    """Linear layer whose input features are split over the TP group; partial outputs are all-reduced.

    The bias is replicated and added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: Axis,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        is_conv1d: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = checked_axis(tp, type(self).__name__)
        if in_features % self.tp_size:
            raise ValueError(f"in_features={in_features} is not divisible by the TP size {self.tp_size}")
        self.full_in_features = in_features
        self.in_features = in_features // self.tp_size
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        self.is_conv1d = is_conv1d
        self.sequence_dim: int | None = None  # split_gather sequence parallelism: reduce-scatter along it

        shape = (self.in_features, out_features) if is_conv1d else (out_features, self.in_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        set_tp_spec(self.weight, TPSpec(0 if is_conv1d else 1, group=tp.group))
        if self.weight.device.type != "meta":  # meta: parameters are replaced right after
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear-style uniform init, bounded by the full fan-in."""
        bound = 1.0 / math.sqrt(self.full_in_features)
        self.weight.uniform_(-bound, bound)
        if self.bias is not None:
            self.bias.uniform_(-bound, bound)

    @classmethod
    def from_native_module(
        cls, module: nn.Module, tp: Axis, input_is_parallel: bool = True
    ) -> "RowParallelLinear":
        """Shard an nn.Linear or transformers Conv1D; the native module is left untouched."""
        in_features, out_features, is_conv1d = _native_shape(module)
        layer = cls(in_features, out_features, tp, bias=module.bias is not None,
                    input_is_parallel=input_is_parallel, is_conv1d=is_conv1d, device="meta",
                    dtype=module.weight.dtype)
        _load_native(layer, module, layer.tp_rank, layer.tp_size)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = split_to_tp(x, -1, self.tp_group)
        out = linear(x, self.weight, None, self.is_conv1d)
        if self.sequence_dim is not None and self.training:
            out = reduce_scatter_to_sequence(out, split_dim(out, self.sequence_dim), self.tp_group)
        else:
            out = reduce_from_tp(out, self.tp_group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (full={self.full_in_features}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"is_conv1d={self.is_conv1d}, tp={self.tp_rank}/{self.tp_size}")

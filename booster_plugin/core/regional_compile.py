"""Regional compilation (`HybridParallelPlugin(compile_layers=True)`): every decoder layer this rank holds is compiled
in place with torch's `nn.Module.compile` (torch.compile of the module's call, its hooks included), after sharding
and activation checkpointing, as torchtitan compiles per block. Layers of one class share the compiled code (dynamo
inlines nn.Module instances, whose parameters become graph inputs), so compile time is paid once per distinct layer
class and input shape. The collectives inside a layer (tensor parallel's sums and gathers, sequence parallelism's
exchanges) run in our autograd functions, which dynamo does not trace: they are graph breaks, and the compiled graphs
are the computation between them. Off by default: compilation costs tens of seconds per layer class on a CPU and
changes results only by float reassociation (~1e-8 in fp32)."""
from __future__ import annotations

from typing import Sequence

from torch import nn

__all__ = ["compile_layers"]


def compile_layers(layers: Sequence[nn.Module]) -> None:
    """Compile each layer in place (its forward runs compiled from the next call on)."""
    for layer in layers:
        layer.compile()

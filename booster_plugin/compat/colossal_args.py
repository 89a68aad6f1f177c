"""ColossalAI 0.5 `HybridParallelPlugin` arguments this plugin accepts by name but does not act on.

Each is data: its ColossalAI default, whether asking for something other than that default would change results,
and what ColossalAI would have done. A non-default value of an argument that would change results raises (we do
not silently train differently); one that only tunes speed or memory on hardware we do not target is accepted and
rank 0 warns once. Arguments with nothing to say (our behaviour already equals what they ask for) are accepted
silently. The arguments the plugin implements are in its signature; the README's table is checked against both.
"""
from __future__ import annotations

import warnings
from typing import Dict, Mapping, NamedTuple, Optional

import torch.distributed as dist

__all__ = ["Unacted", "UNACTED_ARGS", "check_unacted_args"]


class Unacted(NamedTuple):
    """An accepted argument we do not act on. `changes_results`: a non-default value is refused. `effect`: what it
    would do (the warning / error text); empty when our behaviour already equals every value."""
    default: object
    changes_results: bool
    effect: str


UNACTED_ARGS: Dict[str, Unacted] = {
    # (ColossalAI's kernel switches act: the plugin's signature, plugins/speed.py)
    "overlap_communication": Unacted(True, False, ""),  # DP gradient all-reduce always overlaps the backward
    "overlap_p2p": Unacted(True, False, ""),  # P2P sends are always asynchronous (pipeline/p2p.py)
    "overlap_allgather": Unacted(False, False, "overlap ZeRO's parameter all-gather with the next forward"),
    "fp8_communication": Unacted(False, False, "compress communication to fp8 (ours stays in the compute dtype)"),
    "use_fp8": Unacted(False, False, "run linear layers in fp8 (ours run in the compute dtype)"),
    "communication_dtype": Unacted(None, False, "reduce gradients in a lower precision (ours reduce in the "
                                                "gradients' dtype)"),
    "cpu_offload": Unacted(False, False, "offload optimizer state to the CPU"),
    "zero_bucket_size_in_m": Unacted(12, False, ""),  # a tuning knob of ZeRO's buckets
    "inner_ring_size": Unacted(None, False, "size the inner ring of ring attention (sequence parallelism)"),
    # torch DDP knobs: our bucketed reduction already handles unused parameters and reuses its buckets
    "broadcast_buffers": Unacted(True, False, ""),
    "find_unused_parameters": Unacted(False, False, ""),
    "check_reduction": Unacted(False, False, ""),
    "gradient_as_bucket_view": Unacted(False, False, ""),
    "static_graph": Unacted(False, False, ""),
}


def check_unacted_args(kwargs: Mapping[str, object], rank: Optional[int] = None) -> None:
    """Refuse unknown names and result-changing requests (on every rank, before any collective); warn once on rank 0
    about ignored speed options."""
    unknown = sorted(k for k in kwargs if k not in UNACTED_ARGS)
    if unknown:
        raise TypeError(f"HybridParallelPlugin got unexpected keyword arguments {unknown}; it takes ColossalAI's "
                        f"arguments (see the README's argument table).")
    notes = []
    for name, value in kwargs.items():
        arg = UNACTED_ARGS[name]
        if _same(value, arg.default) or not arg.effect:
            continue
        if arg.changes_results:
            raise NotImplementedError(f"{name}={value!r}: {arg.effect}.")
        notes.append(f"{name}={value!r} would {arg.effect}")
    if notes and (rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)) == 0:
        warnings.warn("HybridParallelPlugin ignores options that only tune speed on hardware it does not target; "
                      "results are unaffected: " + "; ".join(notes) + ".", stacklevel=3)


def _same(value: object, default: object) -> bool:
    return value is default or (value is not None and default is not None and value == default)

"""Transfers of one pipelined call made outside the schedule (every rank of the pipeline calls the model alike, SPMD:
an evaluation forward or a step of `generate`): a stage's output to the next stage, and what the last stage computes
to every stage.

- `send` / `receive`: the forward direction only, through the pipeline's own P2P (pipeline/p2p.py), one call being
  one of its steps: each call's transfer starts with a header, and carries its metadata only when it changed (the
  steps of `generate` after the prompt's all send one token's hidden states).
- `from_last`: a broadcast over the pp group from the rank holding the last stage; under tp each tp rank has its own
  pp group, so the tp ranks of one pipeline position pair up. The metadata is broadcast likewise only when it differs
  from the last broadcast's (every rank makes the same sequence of broadcasts).
Tensors travel on the rank's device (the pp group carries gloo beside the world's device backend: pipeline/groups.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .p2p import PipelineP2PCommunication, decode_metadata, empty_tensors, encode_metadata, flatten, unflatten
from .stage_manager import PipelineStageManager

__all__ = ["StageLink"]


class StageLink:
    """One pipeline position's transfers for calls outside the schedule (see the module docstring)."""

    def __init__(self, stage_manager: PipelineStageManager, device: torch.device | str) -> None:
        self.stage_manager = stage_manager
        self.device = torch.device(device)
        self._p2p = PipelineP2PCommunication(stage_manager, self.device, transport="p2p", enable_metadata_cache=True)
        self._last: Optional[bytes] = None  # the metadata of the last broadcast (raw bytes, the same on every rank)

    def send(self, obj: Any) -> None:
        """To the next stage (does not wait for the receiver; `finish` does)."""
        self._p2p.send_forward(obj)

    def receive(self) -> Any:
        """From the previous stage."""
        return self._p2p.recv_forward()

    def finish(self) -> None:
        """End of the call: wait for the sends still in flight; the next call's transfer starts with a header."""
        self._p2p.flush()
        self._p2p.new_step()

    def from_last(self, obj: Optional[Any]) -> Any:
        """`obj` (a nested structure of tensors) on the last stage, broadcast to every stage of this pp group (the
        others pass None); collective over the pp group."""
        sm = self.stage_manager
        src, group = sm.last_rank, sm.pp_group
        sending = sm.is_last_stage()
        if sending:
            tree, tensors = flatten(obj)
            meta = encode_metadata(tree, tensors)
            changed = meta != self._last
            header = torch.tensor([len(meta) if changed else 0], dtype=torch.int64, device=self.device)
        else:
            header = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=src, group=group)
        if int(header.item()) > 0:  # new metadata
            raw = (torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device) if sending
                   else torch.empty(int(header.item()), dtype=torch.uint8, device=self.device))
            dist.broadcast(raw, src=src, group=group)
            self._last = bytes(raw.cpu().numpy())
        if sending:
            tensors = [t.detach().contiguous() for t in tensors]
        else:
            decoded = decode_metadata(self._last)
            tree, tensors = decoded["tree"], empty_tensors(decoded, self.device)
        for t in tensors:
            dist.broadcast(t, src=src, group=group)
        return obj if sending else unflatten(tree, tensors)

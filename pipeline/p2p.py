"""Point-to-point transfer of nested tensor structures between adjacent pipeline stages.

A transfer is a fixed-size header, then (only when the structure changed) its metadata as JSON bytes, then the
tensors. Metadata (structure, shapes, dtypes, small non-tensor values) never goes through pickle and is cached per
link and direction: while it stays the same, only the header (one int64) and the tensors travel.

Two transports: "p2p" (batched isend/irecv; the default, see benchmarks/bench_p2p.py) and "broadcast" (the original
design: a broadcast in a two-rank group per adjacent pair). Combined send+recv calls post both directions at once
with "p2p"; with "broadcast" they run forward-direction first on both ends of a link, which keeps the order of
collectives identical on both ranks.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .stage_manager import PipelineStageManager

_FORWARD, _BACKWARD = "fwd", "bwd"


def flatten(obj: Any) -> Tuple[Any, List[torch.Tensor]]:
    """Split a nested dict/list/tuple into a JSON-able tree (tensors replaced by {"__t__": i}) and the tensors."""
    tensors: List[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return {"__t__": len(tensors) - 1}
        if isinstance(x, dict):
            return {"__d__": [[k, walk(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"__l__" if isinstance(x, list) else "__u__": [walk(v) for v in x]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"Pipeline stages can pass tensors, dict/list/tuple and bool/int/float/str/None, "
                        f"not {type(x).__name__}.")

    return walk(obj), tensors


def unflatten(tree: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if "__t__" in tree:
            return tensors[tree["__t__"]]
        if "__d__" in tree:
            return {k: unflatten(v, tensors) for k, v in tree["__d__"]}
        if "__l__" in tree:
            return [unflatten(v, tensors) for v in tree["__l__"]]
        return tuple(unflatten(v, tensors) for v in tree["__u__"])
    return tree


def _metadata(tree: Any, tensors: List[torch.Tensor]) -> bytes:
    specs = [[list(t.shape), str(t.dtype).removeprefix("torch."), t.requires_grad] for t in tensors]
    return json.dumps({"tree": tree, "tensors": specs}, separators=(",", ":")).encode()


class _Link:
    """One direction of one link: what was last sent/received, so unchanged metadata is not sent again."""

    def __init__(self) -> None:
        self.meta: Optional[bytes] = None
        self.decoded: Optional[Dict[str, Any]] = None


class PipelineP2PCommunication:
    """send/recv of activations (forward direction) and their gradients (backward direction)."""

    def __init__(self, stage_manager: PipelineStageManager, device: torch.device | str = "cpu",
                 transport: str = "p2p", enable_metadata_cache: bool = True) -> None:
        if transport not in ("p2p", "broadcast"):
            raise ValueError(f"Unknown P2P transport {transport!r}: use 'p2p' or 'broadcast'.")
        self.stage_manager = stage_manager
        self.device = torch.device(device)
        self.transport = transport
        self.enable_metadata_cache = enable_metadata_cache
        self._links: Dict[Tuple[int, str, str], _Link] = {}
        self._pair_groups: Dict[Tuple[int, int], dist.ProcessGroup] = {}
        if transport == "broadcast":
            mesh, axis, n = stage_manager.pg_mesh, stage_manager.pipeline_axis, stage_manager.num_stages
            pairs = [(s, (s + 1) % n) for s in range(n)] if n > 2 else [(0, 1)] if n == 2 else []
            for a, b in pairs:  # every rank creates every pair group (new_group is collective)
                group = mesh.get_group_along_axis(axis, indices=sorted((a, b)))
                if group is not None:
                    peer = b if stage_manager.stage == a else a
                    self._pair_groups[(min(stage_manager.stage_ranks[a], stage_manager.stage_ranks[b]),
                                       max(stage_manager.stage_ranks[a], stage_manager.stage_ranks[b]))] = group

    # -- public API -------------------------------------------------------------------------------------
    def send_forward(self, obj: Any) -> None:
        self._exchange(sends=[(self.stage_manager.next_rank, _FORWARD, obj)], recvs=[])

    def recv_forward(self) -> Any:
        return self._exchange(sends=[], recvs=[(self.stage_manager.prev_rank, _FORWARD)])[0]

    def send_backward(self, obj: Any) -> None:
        self._exchange(sends=[(self.stage_manager.prev_rank, _BACKWARD, obj)], recvs=[])

    def recv_backward(self) -> Any:
        return self._exchange(sends=[], recvs=[(self.stage_manager.next_rank, _BACKWARD)])[0]

    def send_forward_recv_backward(self, obj: Any) -> Any:
        peer = self.stage_manager.next_rank
        return self._exchange(sends=[(peer, _FORWARD, obj)], recvs=[(peer, _BACKWARD)])[0]

    def send_backward_recv_forward(self, obj: Any) -> Any:
        peer = self.stage_manager.prev_rank
        return self._exchange(sends=[(peer, _BACKWARD, obj)], recvs=[(peer, _FORWARD)])[0]

    # -- machinery ----------------------------------------------------------------------------------------
    def _link(self, peer: int, direction: str, way: str) -> _Link:
        return self._links.setdefault((peer, direction, way), _Link())

    def _exchange(self, sends, recvs) -> List[Any]:
        """Send and receive in three phases (header, metadata if changed, tensors), both directions together."""
        out_meta, out_tensors, out_headers = [], [], []
        for peer, direction, obj in sends:
            tree, tensors = flatten(obj)
            meta = _metadata(tree, tensors)
            link = self._link(peer, direction, "send")
            changed = not (self.enable_metadata_cache and link.meta == meta)
            link.meta = meta
            out_meta.append(meta if changed else None)
            out_headers.append(torch.tensor([len(meta) if changed else 0], dtype=torch.int64, device=self.device))
            out_tensors.append([t.detach().to(self.device).contiguous() for t in tensors])
        in_headers = [torch.empty(1, dtype=torch.int64, device=self.device) for _ in recvs]

        # phase 1: headers
        self._run([(p, d, h) for (p, d, _), h in zip(sends, out_headers)], [(p, d, h) for (p, d), h in zip(recvs, in_headers)])
        # phase 2: metadata, where it changed
        meta_sends = [(p, d, torch.frombuffer(bytearray(m), dtype=torch.uint8).to(self.device))
                      for (p, d, _), m in zip(sends, out_meta) if m is not None]
        meta_recvs = [(p, d, torch.empty(int(h.item()), dtype=torch.uint8, device=self.device))
                      for (p, d), h in zip(recvs, in_headers) if h.item() > 0]
        if meta_sends or meta_recvs:
            self._run(meta_sends, meta_recvs)
        fresh = iter(meta_recvs)
        decoded = []
        for (peer, direction), header in zip(recvs, in_headers):
            link = self._link(peer, direction, "recv")
            if header.item() > 0:
                link.decoded = json.loads(bytes(next(fresh)[2].cpu().numpy()).decode())
            elif link.decoded is None:
                raise RuntimeError(f"Pipeline P2P: rank {peer} sent cached metadata that this rank never received.")
            decoded.append(link.decoded)
        # phase 3: tensors
        in_tensors = [[torch.empty(shape, dtype=getattr(torch, dtype), device=self.device) for shape, dtype, _ in d["tensors"]]
                      for d in decoded]
        self._run([(p, d, t) for (p, d, _), ts in zip(sends, out_tensors) for t in ts],
                  [(p, d, t) for (p, d), ts in zip(recvs, in_tensors) for t in ts])
        results = []
        for d, tensors in zip(decoded, in_tensors):
            for t, (_, _, requires_grad) in zip(tensors, d["tensors"]):
                t.requires_grad_(requires_grad and t.is_floating_point())
            results.append(unflatten(d["tree"], tensors))
        return results

    def _run(self, sends: List[Tuple[int, str, torch.Tensor]], recvs: List[Tuple[int, str, torch.Tensor]]) -> None:
        if self.transport == "p2p":
            ops = [dist.P2POp(dist.isend, t, peer) for peer, _, t in sends]
            ops += [dist.P2POp(dist.irecv, t, peer) for peer, _, t in recvs]
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            return
        # broadcast: forward-direction transfers first, so both ends of a link issue them in the same order
        me = dist.get_rank()
        ordered = [(d, peer, me, t) for peer, d, t in sends] + [(d, peer, peer, t) for peer, d, t in recvs]
        ordered.sort(key=lambda x: x[0] != _FORWARD)
        for _, peer, src, tensor in ordered:
            dist.broadcast(tensor, src=src, group=self._pair_groups[(min(me, peer), max(me, peer))])

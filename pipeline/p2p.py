"""Point-to-point transfer of nested tensor structures between adjacent pipeline stages.

Structure, shapes, dtypes and small non-tensor values travel as JSON bytes (never pickle). With the metadata cache
on, a link's first transfer of each step starts with a one-int64 header (0 = "same metadata as last time", else
the length of the new metadata that follows); the step's other transfers carry only tensors, since the
microbatches of one step share their shapes (the sender checks it). With the cache off every transfer has a header.
A link may carry several channels (the schedule uses one per virtual-stage edge: with interleaved chunks one pair of
ranks passes the outputs of several virtual stages, which may differ in structure); each channel caches its own
metadata.

Two transports: "p2p" (batched isend/irecv; sends never wait, they complete by `flush`, so they overlap the next
compute and a schedule cannot deadlock on a send) and
"broadcast" (the original design: a broadcast in a two-rank group per adjacent pair; combined send+recv calls then
run forward-direction first on both ends of a link, which keeps the order of collectives identical on both ranks).
`benchmarks/bench_p2p.py` measures both; "p2p" is the default.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .groups import world_group
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from .stage_manager import PipelineStageManager

FORWARD, BACKWARD = "fwd", "bwd"


def flatten(obj: object) -> Tuple[Dict[str, Any], List[torch.Tensor]]:
    """Split a nested structure into a JSON-able tree (its pytree spec, and its leaves with each tensor replaced by
    {"__t__": i}) and the tensors."""
    leaves, spec = tree_flatten(obj)
    tensors: List[torch.Tensor] = []
    encoded = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            encoded.append({"__t__": len(tensors)})
            tensors.append(leaf)
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            encoded.append(leaf)
        else:
            raise TypeError(f"Pipeline stages can pass tensors, dict/list/tuple and bool/int/float/str/None, "
                            f"not {type(leaf).__name__}.")
    return {"spec": treespec_dumps(spec), "leaves": encoded}, tensors


def unflatten(tree: Dict[str, Any], tensors: List[torch.Tensor]) -> Any:
    leaves = [tensors[leaf["__t__"]] if isinstance(leaf, dict) else leaf for leaf in tree["leaves"]]
    return tree_unflatten(leaves, treespec_loads(tree["spec"]))


def encode_metadata(tree: Dict[str, Any], tensors: List[torch.Tensor]) -> bytes:
    specs = [[list(t.shape), str(t.dtype).removeprefix("torch."), t.requires_grad] for t in tensors]
    return json.dumps({"tree": tree, "tensors": specs}, separators=(",", ":")).encode()


def decode_metadata(raw: bytes) -> Dict[str, Any]:
    """The tree and tensor specs `encode_metadata` wrote."""
    return json.loads(raw.decode())


def empty_tensors(decoded: Dict[str, Any], device: torch.device) -> List[torch.Tensor]:
    """Tensors to receive the ones `decoded` describes into."""
    return [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype, _ in decoded["tensors"]]


class Send(NamedTuple):
    """One send of `exchange` (a plain (peer, direction, obj) tuple is channel 0)."""
    peer: int
    direction: str  # FORWARD or BACKWARD
    obj: object     # nested structure of tensors
    channel: int = 0


class Recv(NamedTuple):
    """One receive of `exchange` (a plain (peer, direction) tuple is channel 0)."""
    peer: int
    direction: str
    channel: int = 0


class _Link:
    """One direction of one link: what was last sent/received, so unchanged metadata is not sent again."""

    def __init__(self) -> None:
        self.meta: Optional[bytes] = None
        self.decoded: Optional[Dict[str, Any]] = None
        self.header_due = True  # the first transfer of a step carries a header


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
        self._links: Dict[Tuple[int, str, str, int], _Link] = {}
        self._pair_groups: Dict[Tuple[int, int], dist.ProcessGroup] = {}
        self._world = world_group()  # global peer ranks, and a CPU backend whatever the script's world group has
        if transport == "broadcast":
            mesh, axis, n = stage_manager.pg_mesh, stage_manager.pipeline_axis, stage_manager.num_stages
            for a in range(n - 1):  # every rank creates every pair group (new_group is collective)
                group = mesh.get_group_along_axis(axis, indices=(a, a + 1))
                if group is not None:
                    self._pair_groups[(stage_manager.stage_ranks[a], stage_manager.stage_ranks[a + 1])] = group
        self._pending_sends: List[Tuple[dist.Work, torch.Tensor]] = []  # (send, its tensor, kept until then)

    # -- public API -------------------------------------------------------------------------------------
    def send_forward(self, obj: object) -> None:
        self.exchange(sends=[(self.stage_manager.next_rank, FORWARD, obj)], recvs=[])

    def recv_forward(self) -> Any:
        return self.exchange(sends=[], recvs=[(self.stage_manager.prev_rank, FORWARD)])[0]

    def send_backward(self, obj: object) -> None:
        self.exchange(sends=[(self.stage_manager.prev_rank, BACKWARD, obj)], recvs=[])

    def recv_backward(self) -> Any:
        return self.exchange(sends=[], recvs=[(self.stage_manager.next_rank, BACKWARD)])[0]

    def send_forward_recv_backward(self, obj: object) -> Any:
        peer = self.stage_manager.next_rank
        return self.exchange(sends=[(peer, FORWARD, obj)], recvs=[(peer, BACKWARD)])[0]

    def send_backward_recv_forward(self, obj: object) -> Any:
        peer = self.stage_manager.prev_rank
        return self.exchange(sends=[(peer, BACKWARD, obj)], recvs=[(peer, FORWARD)])[0]

    # -- machinery ----------------------------------------------------------------------------------------
    def _link(self, peer: int, direction: str, way: str, channel: int) -> _Link:
        return self._links.setdefault((peer, direction, way, channel), _Link())

    def new_step(self) -> None:
        """Called by the schedule at each step start: the next transfer on every link carries a header again."""
        for link in self._links.values():
            link.header_due = True

    def flush(self) -> None:
        """Wait for the sends still in flight (the schedule calls it at the end of a step)."""
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()

    def exchange(self, sends: Sequence[Union[Send, Tuple[int, str, Any]]],
                 recvs: Sequence[Union[Recv, Tuple[int, str]]]) -> List[Any]:
        """Send and receive together: headers and changed metadata where due, then the tensors.

        Args:
            sends: (peer rank, "fwd" or "bwd", nested structure of tensors[, channel]) to send; with the "p2p"
                transport sends never wait for the receiver (they complete by `flush`).
            recvs: (peer rank, "fwd" or "bwd"[, channel]) to receive, returned in this order. Transfers between two
                ranks are matched first-in first-out: both ends must issue them in the same order (and channels).
        """
        cache = self.enable_metadata_cache
        sends, recvs = [Send(*s) for s in sends], [Recv(*r) for r in recvs]
        header_sends, meta_sends, out_tensors = [], [], []
        for peer, direction, obj, channel in sends:
            tree, tensors = flatten(obj)
            meta = encode_metadata(tree, tensors)
            link = self._link(peer, direction, "send", channel)
            if cache and not link.header_due and meta != link.meta:
                raise RuntimeError("A pipeline stage sent differently shaped data within one step; the metadata "
                                   "cache assumes equal microbatches. Use enable_metadata_cache=False.")
            if not cache or link.header_due:
                changed = not cache or meta != link.meta
                header_sends.append((peer, direction, torch.tensor([len(meta) if changed else 0], device=self.device)))
                if changed:
                    meta_sends.append((peer, direction, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device)))
                link.meta, link.header_due = meta, False
            out_tensors.append([t.detach().to(self.device).contiguous() for t in tensors])
        header_recvs = []
        for peer, direction, channel in recvs:
            link = self._link(peer, direction, "recv", channel)
            if not cache or link.header_due:
                header_recvs.append((peer, direction, torch.empty(1, dtype=torch.int64, device=self.device), link))
                link.header_due = False
        if header_sends or header_recvs:
            self._run(header_sends, [(p, d, h) for p, d, h, _ in header_recvs])
        meta_recvs = [(p, d, torch.empty(int(h.item()), dtype=torch.uint8, device=self.device), link)
                      for p, d, h, link in header_recvs if h.item() > 0]
        if meta_sends or meta_recvs:
            self._run(meta_sends, [(p, d, raw) for p, d, raw, _ in meta_recvs])
        for _, _, raw, link in meta_recvs:
            link.decoded = decode_metadata(bytes(raw.cpu().numpy()))
        decoded = []
        for peer, direction, channel in recvs:
            link = self._link(peer, direction, "recv", channel)
            if link.decoded is None:
                raise RuntimeError(f"Pipeline P2P: rank {peer} sent cached metadata that this rank never received.")
            decoded.append(link.decoded)
        in_tensors = [empty_tensors(d, self.device) for d in decoded]
        self._run([(s.peer, s.direction, t) for s, ts in zip(sends, out_tensors) for t in ts],
                  [(r.peer, r.direction, t) for r, ts in zip(recvs, in_tensors) for t in ts])
        results = []
        for d, tensors in zip(decoded, in_tensors):
            for t, (_, _, requires_grad) in zip(tensors, d["tensors"]):
                t.requires_grad_(requires_grad and t.is_floating_point())
            results.append(unflatten(d["tree"], tensors))
        return results

    def _run(self, sends: List[Tuple[int, str, torch.Tensor]], recvs: List[Tuple[int, str, torch.Tensor]]) -> None:
        if self.transport == "p2p":
            ops = [dist.P2POp(dist.isend, t, peer, self._world) for peer, _, t in sends]
            ops += [dist.P2POp(dist.irecv, t, peer, self._world) for peer, _, t in recvs]
            if not ops:
                return
            works = dist.batch_isend_irecv(ops)
            # sends are waited on in flush (their tensors stay referenced until then); receives now
            self._pending_sends.extend(zip(works[: len(sends)], [t for _, _, t in sends]))
            for work in works[len(sends):]:
                work.wait()
            return
        # broadcast: forward-direction transfers first, so both ends of a link issue them in the same order
        me = dist.get_rank()
        ordered = [(d, peer, me, t) for peer, d, t in sends] + [(d, peer, peer, t) for peer, d, t in recvs]
        ordered.sort(key=lambda x: x[0] != FORWARD)
        for _, peer, src, tensor in ordered:
            dist.broadcast(tensor, src=src, group=self._pair_groups[(min(me, peer), max(me, peer))])

"""Process groups that carry CPU tensors whatever world group the script created.

A script may create its world group with an accelerator backend alone (`init_process_group("nccl")`, ColossalAI's
`launch_from_torch`): it has no backend for CPU tensors, and any collective on one raises "No backend type associated
with device type cpu". The library therefore never issues a collective on the world group itself:
- `group_backend()`: the backend of every group the library creates: the world's own (inherited) where it has a CPU
  backend, else gloo for the CPU beside the world's device backends (`"cpu:gloo,cuda:nccl"` for `"nccl"`).
- `world_group()`: a group over the whole world with that backend (the world group itself where it has a CPU
  backend): host-side agreement, flags, pipeline P2P, checkpoint transfers.
- `barrier_group()`: a gloo-only group over the world (the world group where it is gloo alone), which torch's
  `monitored_barrier` needs (it refuses any other backend, mixed ones included).
Both are created at most once per world group, by `prepare_world_groups()`, which every plugin calls on every rank
when it is built (new_group is collective; created lazily inside a call made on some ranks only, it would hang).
On CPU, `init_process_group("cuda:gloo")` gives a world group without a CPU backend: the tests use it to exercise
exactly what NCCL's world group does.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Dict, Optional, Tuple

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["backend_map", "group_backend", "world_group", "barrier_group", "prepare_world_groups"]

# (world group, its twin with a CPU backend, its gloo-only twin), for the current world group only
_cache: Dict[str, Tuple[ProcessGroup, ProcessGroup, ProcessGroup]] = {}


def backend_map(group: Optional[ProcessGroup] = None) -> Dict[str, str]:
    """{device type: backend} of `group` (default: the world), e.g. {"cuda": "nccl"} for a group made as "nccl"."""
    config = str(dist.get_backend_config(group))
    if ":" not in config:  # one backend named for every device type it supports
        backend = config.lower()
        return {"cpu": backend, "cuda": backend} if backend == "gloo" else {"cuda": backend}
    return dict(part.split(":", 1) for part in config.lower().split(","))


def group_backend() -> Optional[str]:
    """Backend argument for `dist.new_group`: None (inherit the world's) where the world has a CPU backend; else
    gloo for the CPU plus the world's device backends."""
    devices = backend_map()
    if "cpu" in devices:
        return None
    return ",".join(f"{device}:{backend}" for device, backend in {"cpu": "gloo", **devices}.items())


def _alive(group: ProcessGroup) -> bool:
    """False once `group` was destroyed (e.g. by `dist.destroy_process_group(group)`)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def prepare_world_groups(timeout: Optional[timedelta] = None) -> Tuple[ProcessGroup, ProcessGroup]:
    """(world_group, barrier_group), created (with `timeout` per collective; None: torch's default) if the world
    group changed or they were destroyed. Collective on first call for a world group without a CPU backend or not
    gloo alone: call it on every rank."""
    world = dist.distributed_c10d._get_default_group()
    cached = _cache.get("world")
    if cached is not None and cached[0] is world and _alive(cached[1]) and _alive(cached[2]):
        return cached[1], cached[2]
    ranks = list(range(dist.get_world_size()))
    backend = group_backend()
    with_cpu = world if backend is None else dist.new_group(ranks, timeout=timeout, backend=backend)
    gloo_only = world if str(dist.get_backend(world)) == "gloo" else dist.new_group(ranks, timeout=timeout, backend="gloo")
    _cache["world"] = (world, with_cpu, gloo_only)
    return with_cpu, gloo_only


def world_group() -> ProcessGroup:
    """The world's ranks in a group with a CPU backend (see the module docstring)."""
    return prepare_world_groups()[0]


def barrier_group() -> ProcessGroup:
    """The world's ranks in a gloo-only group, for `dist.monitored_barrier`."""
    return prepare_world_groups()[1]

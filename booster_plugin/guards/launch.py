"""Before the plugin's process groups exist: the process group itself (`ensure_distributed`), this rank's device,
and the argument checks that must fail the same way on every rank (`agree_on_layout`: one all-gather)."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Dict, Optional

import torch
import torch.distributed as dist

from pipeline.groups import barrier_group, prepare_world_groups, world_group

__all__ = ["default_device", "ensure_distributed", "alias", "agree_on_layout", "agree_on_values", "arrival_barrier",
           "check_int",
           "DEFAULT_TIMEOUT_S", "ARRIVAL_TIMEOUT_S"]

# how long a collective may wait for a rank before every rank fails (torch's default is 30 minutes for gloo: a
# frozen rank would hold the job that long); torch's NCCL default
DEFAULT_TIMEOUT_S = 600.0
# how long a collective call of ours (checkpoints) waits for every rank to arrive: a call made on some ranks only
# (`if rank == 0: booster.save_model(...)`) fails this fast, whatever the training timeout
ARRIVAL_TIMEOUT_S = 60.0


def default_device() -> torch.device:
    """This rank's accelerator when there is one (by LOCAL_RANK), else the CPU."""
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.accelerator.device_count()
        torch.accelerator.set_device_index(index)
        return torch.device(acc.type, index)
    return torch.device("cpu")


def ensure_distributed(timeout: float = DEFAULT_TIMEOUT_S, explicit: bool = False) -> None:
    """Initialize torch.distributed from torchrun's environment (gloo/NCCL by device) with `timeout` seconds per
    collective. A process group the user initialized keeps its timeout unless `explicit` (the plugin's `timeout`
    argument was given): then the world group takes it too. Either way, the library's world-spanning groups
    (`pipeline.groups`: one with a CPU backend, one gloo-only) exist when it returns (collective: every rank)."""
    if dist.is_initialized():
        if explicit:
            from torch.distributed.distributed_c10d import _set_pg_timeout
            _set_pg_timeout(timedelta(seconds=timeout))
        prepare_world_groups(timedelta(seconds=timeout))
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"torch.distributed is not initialized and {', '.join(missing)} are not set: launch with "
                           f"`torchrun --nproc_per_node=N script.py` or call torch.distributed.init_process_group().")
    backend = "gloo"  # CPU; with an accelerator, its backend (NCCL on CUDA) plus gloo for CPU tensors
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        backend = f"cpu:gloo,{kind}:{dist.Backend.default_device_backend_map.get(kind, 'gloo')}"
    kwargs = {"timeout": timedelta(seconds=timeout)}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts: keys of a previous attempt (the dead ranks' addresses)
        # would be read by the new one, so each attempt gets its own prefix
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              int(os.environ["WORLD_SIZE"]), is_master=False,
                              timeout=timedelta(seconds=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        kwargs.update(store=dist.PrefixStore(f"hybrid_parallel/attempt_{attempt}", store),
                      rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, **kwargs)
    prepare_world_groups(timedelta(seconds=timeout))


def alias(alias: str, alias_value: Optional[int], name: str, value: int) -> int:
    """`tp=2` means `tp_size=2` (the design card's spelling); both, differing, is an error."""
    if alias_value is None:
        return value
    if value != 1 and value != alias_value:
        raise ValueError(f"{alias}={alias_value} and {name}={value} disagree: give one of them.")
    return alias_value


def agree_on_layout(**settings: int) -> None:
    """One all-gather over the world: ranks created with different settings (e.g. tp_size) would create different
    process groups and hang; every rank raises the same error naming the differing setting instead."""
    agree_on_values("HybridParallelPlugin was created with different settings on different ranks",
                    "every rank must pass the same arguments", settings)


def agree_on_values(what: str, fix: str, values: Dict[str, int]) -> None:
    """Collective over the world (one all-gather of the integers): raise the same ValueError on every rank,
    `{what} ({name: rank 0 has a, rank r has b}); {fix}.`, if any value differs between ranks."""
    mine = torch.tensor(list(values.values()), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine, group=world_group())
    for rank, row in enumerate(rows):
        differ = [name for name, a, b in zip(values, row.tolist(), rows[0].tolist()) if a != b]
        if differ:
            shown = ", ".join(f"{n}: rank 0 has {rows[0][list(values).index(n)].item()}, rank {rank} has "
                              f"{row[list(values).index(n)].item()}" for n in differ)
            raise ValueError(f"{what} ({shown}); {fix}.")


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def arrival_barrier(call: str, seconds: float) -> None:
    """A monitored barrier over the world before the collective call `call`: a call made on some ranks only (e.g.
    under `if rank == 0:`) fails within `seconds` on the ranks that arrived, naming the missing ranks, instead of
    hanging in the call's first collective. It runs on the library's gloo-only world group, whatever backend the
    script's world group has."""
    try:
        dist.monitored_barrier(barrier_group(), timeout=timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as error:
        raise RuntimeError(f"{call} is collective: every rank must call it (not only under `if rank == 0:`), but some "
                           f"ranks did not reach it within {seconds:.0f} s of the first ({error}).") from None

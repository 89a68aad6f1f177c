"""`colossalai.launch` (explicit rank, world size, host and port) and `colossalai.launch_from_torch` (torchrun)."""
from __future__ import annotations

import os
from typing import Optional

from booster_plugin.compat import launch_from_torch

__all__ = ["launch", "launch_from_torch"]


def launch(rank: int, world_size: int, host: str, port: int, backend: str = "nccl", local_rank: Optional[int] = None,
           seed: int = 1024, verbose: bool = True) -> None:
    """Initialize torch.distributed for `rank` of `world_size` with the rendezvous at `host:port`, then seed.

    The environment variables torchrun would set are set from the arguments (LOCAL_RANK only when `local_rank` is
    given), so everything after this behaves as under torchrun. `backend` is ignored, as in `launch_from_torch`: the
    device's own backend is used.
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=host, MASTER_PORT=str(port))
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
    launch_from_torch(backend=backend, seed=seed, verbose=verbose)

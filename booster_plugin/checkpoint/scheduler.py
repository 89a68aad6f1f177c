"""lr scheduler checkpoints: the scheduler's state_dict as JSON, written by rank 0 (atomically: temporary file,
fsync, rename) and read by every rank."""
from __future__ import annotations

import functools
from typing import Any, Dict, Protocol

from .atomic import replace_file
from .context import CheckpointContext
from .format import from_json, read_json, to_json, write_json
from .save import LocalPhase, collective_save


class Scheduler(Protocol):
    """What checkpoints use of an lr scheduler (torch's, or any with these two methods)."""

    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None: ...


def save_lr_scheduler(ctx: CheckpointContext, lr_scheduler: Scheduler, checkpoint: str) -> None:
    collective_save(ctx, f"save_lr_scheduler({checkpoint!r})", checkpoint,
                    lambda tmp: LocalPhase(functools.partial(_write, lr_scheduler, tmp, checkpoint)), single_file=True)


def _write(lr_scheduler: Scheduler, tmp: str, checkpoint: str) -> None:
    """Rank 0: the JSON into the temporary file, then onto `checkpoint`."""
    state = to_json(lr_scheduler.state_dict(), f"{type(lr_scheduler).__name__}.state_dict()")
    write_json(tmp, {"scheduler": type(lr_scheduler).__name__, "state_dict": state})
    replace_file(tmp, checkpoint)


def read_lr_scheduler(lr_scheduler: Scheduler, checkpoint: str) -> Dict[str, Any]:
    """The state_dict saved at `checkpoint` for a scheduler of `lr_scheduler`'s type."""
    saved = read_json(checkpoint, "lr scheduler checkpoint")
    if saved.get("scheduler") != type(lr_scheduler).__name__:
        raise ValueError(f"{checkpoint} holds a {saved.get('scheduler')} state, the scheduler is a "
                         f"{type(lr_scheduler).__name__}")
    return from_json(saved["state_dict"])

"""collective_save: the one sequence every save follows (model, optimizer, LoRA adapters, lr scheduler).

1. Rank 0 prepares the temporary sibling of the checkpoint (atomic.py); every rank agrees on its error, so a save
   that cannot start raises on every rank before any collective of its own.
2. The collective phase, on every rank in the caller's thread (`collect`: plans, tp gathers, pp sends, snapshots),
   returns this rank's local phase.
3. The local phase (jobs.SaveJob): each writer writes its files into the temporary path and reports, rank 0 commits
   (index, config, swap); inline, or with `use_async` in a background thread.
"""
from __future__ import annotations

from typing import Callable, FrozenSet, NamedTuple, Optional

from .atomic import prepare_dir, prepare_file, siblings
from .context import CheckpointContext
from .jobs import SaveJob, agree, describe, finish


def _nothing() -> None:
    """The write of a rank without files."""


class LocalPhase(NamedTuple):
    """What a rank does after the collective phase of a save (see jobs.SaveJob)."""

    commit: Callable[[], None]                  # rank 0: what completes the checkpoint (index, config), then the swap
    write: Callable[[], None] = _nothing        # this rank's file writes into the temporary path (no collectives)
    writers: FrozenSet[int] = frozenset()       # global ranks that write files (rank 0 waits for the others' reports)
    error: Optional[str] = None                 # this rank's error in the collective phase


def collective_save(ctx: CheckpointContext, action: str, checkpoint: str, collect: Callable[[str], LocalPhase],
                    single_file: bool = False, use_async: bool = False) -> None:
    """Collective: prepare, agree, `collect(temporary path)`, then the local phase it returns (module docstring).
    Raises CheckpointError on every rank if any rank failed (after the local phase unless `use_async`)."""
    error = None
    if ctx.rank == 0:
        try:
            prepare_file(checkpoint) if single_file else prepare_dir(checkpoint)
        except Exception as exc:
            error = describe(exc)
    agree(error, action, ctx.device)
    tmp = siblings(checkpoint)[1]
    phase = collect(tmp)
    job = SaveJob(action, tmp, writers=phase.writers - {0}, write=phase.write, commit=phase.commit,
                  timeout_s=ctx.timeout_s, error=phase.error)
    finish(job, use_async, ctx.device)

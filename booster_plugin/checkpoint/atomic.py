"""Atomic saves: a checkpoint directory (or single file) is written under a temporary sibling name and swapped in.

Directory: `.<name>.partial` is filled, then rank 0 swaps: `<name>` -> `.<name>.old`, `.<name>.partial` -> `<name>`,
delete `.<name>.old`. Crash windows: before the first rename the old checkpoint is untouched (a left-over
`.partial` is removed by the next save and refused by `load_*`); between the renames only `.<name>.old` exists —
`load_*` falls back to it and the next save puts it back first; after the second rename the new checkpoint is
complete and a left-over `.old` is deleted by the next save.
Single file: `.<name>.partial` is written, fsynced and `os.replace`d onto `<name>` (atomic on POSIX).

Writers other than rank 0 report completion to rank 0 through the rendezvous store (checkpoint/jobs.py), so rank 0
can finish a save (index, swap) without a collective, also in a background thread (`use_async=True`).
"""
from __future__ import annotations

import os
import shutil
import warnings
from typing import Tuple

PARTIAL_SUFFIX, BACKUP_SUFFIX = ".partial", ".old"


def siblings(path: str) -> Tuple[str, str, str]:
    """(absolute path, its temporary sibling, its backup sibling)."""
    path = os.path.abspath(path.rstrip(os.sep) or os.sep)
    parent, name = os.path.split(path)
    return path, os.path.join(parent, f".{name}{PARTIAL_SUFFIX}"), os.path.join(parent, f".{name}{BACKUP_SUFFIX}")


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare_dir(path: str) -> str:
    """Rank 0: recover from an interrupted swap, remove a stale partial save, create the temporary directory."""
    path, tmp, backup = siblings(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path} exists and is not a directory; a sharded checkpoint (shard=True) or one "
                              f"without a file suffix is a directory: remove the file or choose another path.")
    if os.path.isdir(backup):
        if os.path.exists(path):  # crashed after the swap: the backup is stale
            shutil.rmtree(backup)
        else:  # crashed between the two renames: the backup is the last complete checkpoint
            os.rename(backup, path)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def prepare_file(path: str) -> str:
    """Rank 0: the temporary sibling of a single-file checkpoint (stale one removed, parent created)."""
    path, tmp, _ = siblings(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; a single-file checkpoint needs a file path")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(tmp):
        os.remove(tmp)
    return tmp


def swap_into_place(path: str) -> None:
    """Rank 0, after every file is complete in the temporary directory."""
    path, tmp, backup = siblings(path)
    fsync_dir(tmp)
    if os.path.exists(path):
        os.rename(path, backup)
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path))
    if os.path.exists(backup):
        shutil.rmtree(backup, ignore_errors=True)


def replace_file(tmp: str, path: str) -> None:
    """Move a complete, fsynced temporary file onto `path` atomically."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def discard(tmp: str) -> None:
    if os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    elif os.path.exists(tmp):
        os.remove(tmp)


def resolve_dir(path: str) -> str:
    """The directory to read: refuses partial saves; falls back to the backup of an interrupted swap."""
    full, _, backup = siblings(path)
    if os.path.basename(full).startswith(".") and os.path.basename(full).endswith(PARTIAL_SUFFIX):
        raise ValueError(f"{full} is an incomplete checkpoint left by an interrupted save; it cannot be loaded.")
    if os.path.exists(full):
        return full
    if os.path.isdir(backup):
        warnings.warn(f"{full} is missing but {backup} holds the previous complete checkpoint (a save was "
                      f"interrupted while swapping directories); loading that.")
        return backup
    raise FileNotFoundError(f"checkpoint {full} does not exist")



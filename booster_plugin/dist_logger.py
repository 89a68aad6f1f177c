"""Named loggers whose calls take `ranks=[...]`, the ranks that log the message (ColossalAI's `colossalai.logging`,
re-exported by the mirror; the library's own reports use it too)."""
from __future__ import annotations

import logging
from typing import Dict, Iterable, Optional

import torch.distributed as dist

__all__ = ["DistributedLogger", "get_dist_logger", "disable_existing_loggers"]

_FORMAT = "colossalai - %(name)s - %(levelname)s: %(pathname)s:%(lineno)d %(funcName)s: %(message)s"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class DistributedLogger:
    """A `logging.Logger` (level INFO, its own stream handler, not propagating) whose `info`, `warning`, `error`
    and `debug` log only on the ranks in `ranks` (every rank when None). Records name the caller's file and line."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._logger = logging.getLogger(name)
        self._logger.setLevel(logging.INFO)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        self._logger.addHandler(handler)
        self._logger.propagate = False

    def _log(self, level: int, message: object, ranks: Optional[Iterable[int]]) -> None:
        if ranks is None or _rank() in ranks:
            self._logger.log(level, message, stacklevel=3)  # the caller of info/warning/...

    def info(self, message: object, ranks: Optional[Iterable[int]] = None) -> None:
        self._log(logging.INFO, message, ranks)

    def warning(self, message: object, ranks: Optional[Iterable[int]] = None) -> None:
        self._log(logging.WARNING, message, ranks)

    def error(self, message: object, ranks: Optional[Iterable[int]] = None) -> None:
        self._log(logging.ERROR, message, ranks)

    def debug(self, message: object, ranks: Optional[Iterable[int]] = None) -> None:
        self._log(logging.DEBUG, message, ranks)


_LOGGERS: Dict[str, DistributedLogger] = {}


def get_dist_logger(name: str = "colossalai") -> DistributedLogger:
    """The one DistributedLogger of that name (created on first use)."""
    if name not in _LOGGERS:
        _LOGGERS[name] = DistributedLogger(name)
    return _LOGGERS[name]


def disable_existing_loggers(include: Optional[Iterable[str]] = None,
                             exclude: Iterable[str] = ("colossalai",)) -> None:
    """Raise every existing logger's level to WARNING: those named in `include`, or when it is None, all but those
    named in `exclude` (by default all but get_dist_logger's)."""
    names = list(logging.Logger.manager.loggerDict)
    chosen = [n for n in names if n in set(include)] if include is not None else [n for n in names
                                                                                 if n not in set(exclude)]
    for name in chosen:
        logging.getLogger(name).setLevel(logging.WARNING)

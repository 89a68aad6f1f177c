"""TensorReads: the tensor files one load opens and the checksums it owes; `guarded_read` runs a load's reads.

A load opens each file once, notes the CRC32 each tensor it read must have (the index's and the file's must agree),
verifies them at the end (a share of them: the ranks that read the same tensors split the work) and closes every
file whatever happened.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, TypeVar

from .format import TensorFile, open_tensor_file
from .jobs import describe

T = TypeVar("T")


class TensorReads:
    def __init__(self, verify_checksums: bool, num_threads: int) -> None:
        self.verify_checksums = verify_checksums
        self.num_threads = num_threads  # for the checksums (zlib and file reads release the GIL)
        self._files: Dict[str, TensorFile] = {}
        self._checks: Dict[Tuple[str, str], Tuple[TensorFile, str, str]] = {}

    def open(self, path: str) -> TensorFile:
        if path not in self._files:
            self._files[path] = open_tensor_file(path)
        return self._files[path]

    def expect(self, f: TensorFile, key: str, index: Dict[str, str]) -> None:
        """Note the CRC32 tensor `key` of `f` must have (`index`: the checkpoint index's CRC32s of `f`)."""
        if not self.verify_checksums:
            return
        theirs, mine = index.get(key), f.checksums.get(key)
        if theirs is not None and mine is not None and theirs != mine:
            raise ValueError(f"{f.path}: tensor {key!r} has checksum {mine} in the file but {theirs} in the index: "
                             f"the checkpoint is corrupted or mixes files of two saves")
        crc = theirs or mine
        if crc is not None:
            self._checks[(f.path, key)] = (f, key, crc)

    def verify(self, share: int = 1, mine: int = 0) -> None:
        """Check the noted tensors (in (path, key) order, every `share`-th from the `mine`-th); ValueError naming the
        first that fails."""
        items = [self._checks[k] for k in sorted(self._checks)][mine::share]
        if self.num_threads > 1 and len(items) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=self.num_threads) as pool:
                list(pool.map(lambda item: item[0].verify(item[1], item[2]), items))
        else:
            for f, key, expected in items:
                f.verify(key, expected)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def guarded_read(read: Callable[[TensorReads], T], verify_checksums: bool,
                 num_threads: int) -> Tuple[Optional[T], Optional[str]]:
    """(read's result, None), or (None, the error message) for `agree`; the files it opened are closed either way."""
    reads = TensorReads(verify_checksums, num_threads)
    try:
        return read(reads), None
    except Exception as exc:
        return None, describe(exc)
    finally:
        reads.close()

"""A :class:`~anabranch.storage.files.StorageFile` that fails on chosen calls.

``FaultPlan`` counts write and sync calls across every file opened through one
:class:`FaultyOpener` and raises the chosen ``errno`` (ENOSPC, EIO, ...) on the listed
call numbers (1-based). ``partial=True`` makes a failing write put half of its bytes in the
file first, like a real short write before ENOSPC.

Example:
    >>> import errno, tempfile, pathlib
    >>> plan = FaultPlan(fail_sync_calls={1}, errno_code=errno.EIO)
    >>> f = FaultyOpener(plan)(pathlib.Path(tempfile.mkdtemp()) / "x.log")
    >>> f.write(b"abc")
    >>> try:
    ...     f.sync()
    ... except OSError as err:
    ...     err.errno == errno.EIO
    True
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from anabranch.storage.files import OsFile, StorageFile


@dataclass
class FaultPlan:
    """Which calls fail, and how. Thread-safe counters (the writer runs on a thread)."""

    fail_write_calls: set[int] = field(default_factory=set)
    fail_sync_calls: set[int] = field(default_factory=set)
    errno_code: int = errno.EIO
    partial: bool = False
    writes: int = 0
    syncs: int = 0
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _hit(self, kind: str) -> bool:
        with self._lock:
            if kind == "write":
                self.writes += 1
                hit = self.writes in self.fail_write_calls
            else:
                self.syncs += 1
                hit = self.syncs in self.fail_sync_calls
            self.failures += hit
            return hit

    def error(self) -> OSError:
        return OSError(self.errno_code, os.strerror(self.errno_code))


class FaultyFile:
    """An :class:`OsFile` wrapped with a :class:`FaultPlan`."""

    def __init__(self, path: Path, plan: FaultPlan) -> None:
        self._inner = OsFile(path)
        self._plan = plan

    @property
    def path(self) -> Path:
        return self._inner.path

    def write(self, data: bytes) -> None:
        if self._plan._hit("write"):
            if self._plan.partial and len(data) > 1:
                self._inner.write(data[: len(data) // 2])
            raise self._plan.error()
        self._inner.write(data)

    def sync(self) -> None:
        if self._plan._hit("sync"):
            # A failed fsync may have dropped dirty pages: what is in the file now is
            # not known to be on disk (the "fsyncgate" lesson).
            raise self._plan.error()
        self._inner.sync()

    def read(self, offset: int, size: int) -> bytes:
        return self._inner.read(offset, size)

    def size(self) -> int:
        return self._inner.size()

    def truncate(self, size: int) -> None:
        self._inner.truncate(size)

    def close(self) -> None:
        self._inner.close()


class FaultyOpener:
    """A FileOpener whose files share one plan."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan

    def __call__(self, path: Path) -> StorageFile:
        return FaultyFile(path, self.plan)

"""A small file abstraction so tests can inject disk faults (``anabranch.testing.faulty_file``).

Every storage file operation goes through :class:`StorageFile`; the file-backed ledger
gets a :data:`FileOpener` and never calls ``os`` directly for ledger data. All methods
block: callers run them on the writer thread or an executor, never on the event loop.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "x.log"
    >>> f = open_os_file(path)
    >>> f.write(b"abc"); f.sync(); f.read(0, 3)
    b'abc'
    >>> f.close()
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol


class StorageFile(Protocol):
    """An append-only file with positional reads."""

    @property
    def path(self) -> Path: ...

    def write(self, data: bytes) -> None:
        """Append all of ``data`` (loops over short writes) or raise OSError."""
        ...

    def sync(self) -> None:
        """fdatasync: make every write so far durable, or raise OSError."""
        ...

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer only at end of file)."""
        ...

    def size(self) -> int: ...

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes (recovery drops a torn tail)."""
        ...

    def close(self) -> None: ...


FileOpener = Callable[[Path], StorageFile]
"""Opens (creating if needed) a file for appending and reading."""


class OsFile:
    """:class:`StorageFile` over an ``O_APPEND`` file descriptor."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    @property
    def path(self) -> Path:
        return self._path

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def read(self, offset: int, size: int) -> bytes:
        chunks: list[bytes] = []
        while size > 0:
            chunk = os.pread(self._fd, size, offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_os_file(path: Path) -> StorageFile:
    """The default :data:`FileOpener`."""
    return OsFile(path)


def sync_dir(path: Path) -> None:
    """fsync a directory so a created, renamed or deleted entry in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

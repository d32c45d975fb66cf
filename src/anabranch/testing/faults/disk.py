"""Disk faults on one broker, and losing what was never fsynced when it crashes.

:class:`ControlledOpener` is the broker's ledger :data:`~anabranch.storage.files.FileOpener`
(installed by the test-only :mod:`.launcher`). Its files

- fail every ``write`` and ``sync`` with the control file's ``disk_errno`` (EIO, ENOSPC)
  while it is set;
- record, after every successful fdatasync, how many bytes of the file are durable, in a
  sidecar ``<file>.synced.<broker>`` (8 bytes, rewritten in place).

SIGKILL keeps the page cache: a killed process's unsynced writes still reach the disk,
so a crash alone never shows that an ack came before its fsync. After SIGKILLing a broker
the harness calls :func:`lose_unfsynced`, which truncates every file that broker wrote to
its last durable length (what a power cut would leave, LazyFS-style) before anyone
recovers the ledger. A broker that acknowledges only after fsync loses nothing; one that
acknowledges first (the ``ack-before-fsync`` failpoint) loses acknowledged entries.

Example:
    >>> import tempfile, pathlib
    >>> from anabranch.testing.faults.control import ControlReader
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> opener = ControlledOpener(ControlReader(root / "control.json"), broker="b0")
    >>> f = opener(root / "x.log")
    >>> f.write(b"durable"); f.sync(); f.write(b"+cached")
    >>> f.close()
    >>> lose_unfsynced(root, "b0")
    1
    >>> (root / "x.log").read_bytes()
    b'durable'
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from anabranch.storage.files import OsFile, StorageFile
from anabranch.testing.faults.control import ControlReader

_LENGTH = struct.Struct("<q")


def sidecar(path: Path, broker: str) -> Path:
    """Where ``broker`` records the durable length of ``path``."""
    return path.with_name(f"{path.name}.synced.{broker}")


class ControlledFile:
    """A :class:`~anabranch.storage.files.StorageFile` steered by a control file."""

    def __init__(self, path: Path, control: ControlReader, broker: str) -> None:
        self._inner = OsFile(path)
        self._control = control
        self._sidecar_path = sidecar(path, broker)
        self._sidecar = -1
        self._durable = self._inner.size()  # what was there before we opened it counts

    @property
    def path(self) -> Path:
        return self._inner.path

    def _check(self) -> None:
        error = self._control.get().disk_error()
        if error is not None:
            raise error

    def write(self, data: bytes) -> None:
        self._check()
        if self._sidecar < 0:  # only files this broker writes can lose writes
            self._sidecar = os.open(self._sidecar_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
            self._record(self._durable)
        self._inner.write(data)

    def sync(self) -> None:
        self._check()
        self._inner.sync()
        self._durable = self._inner.size()
        self._record(self._durable)

    def _record(self, length: int) -> None:
        if self._sidecar >= 0:
            os.pwrite(self._sidecar, _LENGTH.pack(length), 0)

    def read(self, offset: int, size: int) -> bytes:
        return self._inner.read(offset, size)

    def size(self) -> int:
        return self._inner.size()

    def truncate(self, size: int) -> None:
        self._inner.truncate(size)
        self._durable = min(self._durable, size)
        self._record(self._durable)

    def close(self) -> None:
        self._inner.close()
        if self._sidecar >= 0:
            os.close(self._sidecar)
            self._sidecar = -1


class ControlledOpener:
    """A FileOpener whose files obey one broker's control file."""

    def __init__(self, control: ControlReader, broker: str) -> None:
        self.control = control
        self.broker = broker

    def __call__(self, path: Path) -> StorageFile:
        return ControlledFile(path, self.control, self.broker)


def lose_unfsynced(data_dir: Path, broker: str) -> int:
    """Truncate every file ``broker`` wrote under ``data_dir`` to its last fsynced length
    and forget the records; call it only while that broker is dead. Returns how many
    files lost bytes."""
    cut = 0
    for record in data_dir.rglob(f"*.synced.{broker}"):
        target = record.with_name(record.name[: -len(f".synced.{broker}")])
        raw = record.read_bytes()
        record.unlink()
        if len(raw) != _LENGTH.size or not target.exists():
            continue
        (durable,) = _LENGTH.unpack(raw)
        if target.stat().st_size > durable:
            os.truncate(target, durable)
            cut += 1
    return cut

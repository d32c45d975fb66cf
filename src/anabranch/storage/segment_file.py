"""One ledger's data file: records appended by the writer thread, an offset index, reads.

A ledger file holds the ledger's entries in order as framed records
(:mod:`anabranch.storage.record_format`); entry ``k`` is the ``k``-th record. The index
(``array('q')`` of record start offsets) is built as records are confirmed, or by a strict
scan when a closed ledger is first read after a restart. All methods block: call them on
the writer thread or an executor.

Open files are bounded: a :class:`FileHandles` shared by a factory keeps at most
``limits.STORAGE_OPEN_FILES_MAX`` ledger files open; the least recently used idle one is
closed past that and reopened (``O_APPEND``) by its next read or write, so 10,000 idle
ledgers do not hold 10,000 descriptors. A file is only closed between operations (each
holds the segment's lock), and a synced write stays durable whichever descriptor wrote it.

Fencing: a new owner that recovers a ledger first creates ``<ledger>.fenced`` next to the
file, then scans it. The old owner's writer checks for that marker after each
write+fdatasync and before acknowledging; so an entry it acknowledges was on disk before
the marker existed, hence before the scan, and the new owner sees it.

Example:
    >>> import tempfile, pathlib
    >>> seg = SegmentFile.create(pathlib.Path(tempfile.mkdtemp()), 7)
    >>> seg.append_batch([b"a", b"bc"], sync=True)
    >>> seg.read_entries(0, 2)
    [b'a', b'bc']
"""

from __future__ import annotations

import os
import resource
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate
from pathlib import Path

from anabranch import limits
from anabranch.errors import CorruptRecord, LedgerFenced, StorageError
from anabranch.storage import record_format
from anabranch.storage.files import FileOpener, StorageFile, open_os_file, sync_dir

_length_crcs = record_format._length_crcs
_length_crc = record_format.length_crc
_crc_extend = record_format._crc_extend
_HEADER_PACK = record_format.HEADER.pack


def ledger_file_name(ledger_id: int) -> str:
    return f"{ledger_id:020d}.log"


def fence_marker(directory: Path, ledger_id: int) -> Path:
    return directory / f"{ledger_id:020d}.fenced"


class FileHandles:
    """At most ``max_open`` ledger files open at once across the segments sharing this.

    Thread-safe: segments are used from the writer pool and executor threads. Eviction
    closes the least recently used file whose segment is not in use (a non-blocking
    try of its lock, so it never waits and never deadlocks); when every open file is in
    use, the bound is exceeded for the moment rather than blocking, and the next use that
    ends closes the excess.

    Example:
        >>> import tempfile, pathlib
        >>> handles = FileHandles(max_open=1)
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> a = SegmentFile.create(d, 1, handles=handles)
        >>> b = SegmentFile.create(d, 2, handles=handles)
        >>> handles.open_count, a.is_open, b.is_open
        (1, False, True)
        >>> a.append_batch([b"x"], sync=True); a.read_entries(0, 1), handles.open_count
        ([b'x'], 1)
    """

    def __init__(self, max_open: int = limits.STORAGE_OPEN_FILES_MAX) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        cap = limits.STORAGE_OPEN_FILES_MAX
        if soft != resource.RLIM_INFINITY:
            cap = min(cap, max(16, soft // 2))
        self.max_open = max(1, min(max_open, cap))
        self._lock = threading.Lock()
        self._lru: OrderedDict[SegmentFile, None] = OrderedDict()
        self.reopened = 0
        """Files opened again after an eviction (a metric of how hot the bound runs)."""

    @property
    def open_count(self) -> int:
        return len(self._lru)

    def opened(self, segment: SegmentFile) -> None:
        with self._lock:
            self._lru[segment] = None
            self._lru.move_to_end(segment)
        self._evict(keep=segment)

    def touch(self, segment: SegmentFile) -> None:
        with self._lock:
            if segment in self._lru:
                self._lru.move_to_end(segment)

    def forget(self, segment: SegmentFile) -> None:
        with self._lock:
            self._lru.pop(segment, None)

    def _evict(self, keep: SegmentFile) -> None:
        with self._lock:
            excess = len(self._lru) - self.max_open
            if excess <= 0:
                return
            victims: list[SegmentFile] = []
            for segment in self._lru:
                if len(victims) == excess:
                    break
                if segment is not keep and segment._lock.acquire(blocking=False):
                    victims.append(segment)
            for segment in victims:
                del self._lru[segment]
        for segment in victims:
            try:
                segment._close_file()
            finally:
                segment._lock.release()


class SegmentFile:
    """A ledger file plus the start offset of each confirmed record."""

    def __init__(
        self,
        directory: Path,
        ledger_id: int,
        file: StorageFile,
        *,
        opener: FileOpener = open_os_file,
        handles: FileHandles | None = None,
    ) -> None:
        self.directory = directory
        self.ledger_id = ledger_id
        self._file: StorageFile | None = file
        self._opener = opener
        self._handles = handles
        self._lock = threading.RLock()
        """Held while the file is in use; eviction closes it only when free."""
        self.path = file.path
        self.where = f"ledger {ledger_id}"
        """Names the ledger in errors (never the file path: errors reach clients)."""
        self.offsets = array("q")
        self.end = 0
        """Offset just past the last confirmed record."""
        self._fence = fence_marker(directory, ledger_id)

    @classmethod
    def create(
        cls,
        directory: Path,
        ledger_id: int,
        opener: FileOpener = open_os_file,
        handles: FileHandles | None = None,
    ) -> SegmentFile:
        """A new, empty, durable (file and directory entry synced) ledger file.

        StorageError if the ledger's file already holds data: ids are never reused, so
        the metadata store has gone back in time (restored from an old copy, or its
        journal lost) and that file is the only copy of some topic's entries.
        """
        directory.mkdir(parents=True, exist_ok=True)
        file = opener(directory / ledger_file_name(ledger_id))
        try:
            found = file.size()
        except BaseException:
            file.close()
            raise
        if found:
            file.close()
            raise StorageError(
                f"ledger {ledger_id} is new in the metadata store but its file already "
                f"holds {found} bytes: the metadata is older than the data directory; "
                "refusing to overwrite the file"
            )
        file.truncate(0)
        file.sync()
        sync_dir(directory)
        segment = cls(directory, ledger_id, file, opener=opener, handles=handles)
        if handles is not None:
            handles.opened(segment)
        return segment

    @classmethod
    def open_existing(
        cls,
        directory: Path,
        ledger_id: int,
        opener: FileOpener = open_os_file,
        handles: FileHandles | None = None,
    ) -> SegmentFile:
        path = directory / ledger_file_name(ledger_id)
        if not path.exists():
            raise CorruptRecord(f"ledger {ledger_id}", 0, "ledger file missing")
        segment = cls(directory, ledger_id, opener(path), opener=opener, handles=handles)
        if handles is not None:
            handles.opened(segment)
        return segment

    # --- the (evictable) file handle ------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._file is not None

    @property
    def file(self) -> StorageFile:
        """The open file (reopened if it was evicted); use inside :meth:`_using`."""
        file = self._file
        if file is None:
            file = self._file = self._opener(self.path)
            if self._handles is not None:
                self._handles.reopened += 1
                self._handles.opened(self)
        elif self._handles is not None:
            self._handles.touch(self)
        return file

    @contextmanager
    def _using(self) -> Iterator[StorageFile]:
        with self._lock:
            yield self.file
        handles = self._handles
        if handles is not None and handles.open_count > handles.max_open:
            handles._evict(keep=self)  # files that were busy when the bound was passed

    def _close_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()

    # --- writer side ------------------------------------------------------------------------

    def append_batch(self, payloads: list[bytes], *, sync: bool) -> None:
        """Frame, write, optionally fdatasync, check the fence, then index the records.

        Raises OSError from the disk or LedgerFenced; the index only grows on success.
        """
        parts: list[bytes] = []
        seeds, extend, pack = _length_crcs, _crc_extend, _HEADER_PACK
        for payload in payloads:  # record_format.header, inlined: it runs per entry
            n = len(payload)
            seed = seeds.get(n)
            if seed is None:
                seed = _length_crc(n)
            parts += (pack(n, extend(seed, payload)), payload)
        with self._using() as file:
            file.write(b"".join(parts))
            if sync:
                file.sync()
        if os.path.exists(self._fence):
            raise LedgerFenced(f"ledger {self.ledger_id} was fenced by a new owner")
        starts = list(accumulate(map(len, parts), initial=self.end))[::2]
        self.end = starts.pop()
        self.offsets.extend(starts)

    # --- recovery -----------------------------------------------------------------------------

    def recover(self) -> tuple[int, int]:
        """Scan the whole file, truncate a torn tail durably, index it; (entries, bytes).

        CorruptRecord if damage is found before the tail.
        """
        with self._using() as file:
            size = file.size()
            result = record_format.scan(file.read(0, size), where=self.where, recovery=True)
            if result.valid_end != size:
                file.truncate(result.valid_end)
                file.sync()
        self.offsets = array("q", [offset for offset, _ in result.records])
        self.end = result.valid_end
        return len(result.records), sum(len(p) for _, p in result.records)

    def load_index(self, entries: int) -> None:
        """Index the first ``entries`` records of a closed ledger, checking each.

        Bytes after them are ignored: a fenced writer may have appended records it never
        acknowledged. Fewer records than ``entries`` is corruption (acknowledged data gone).
        """
        with self._using() as file:
            size = file.size()
            data = file.read(0, size)
        result = record_format.scan(data, where=self.where, recovery=True, max_records=entries)
        if len(result.records) < entries:
            raise CorruptRecord(
                self.where,
                result.valid_end,
                f"ledger closed with {entries} entries, found {len(result.records)}",
            )
        self.offsets = array("q", [offset for offset, _ in result.records])
        self.end = result.valid_end

    def fence(self) -> None:
        """Create the fence marker durably (before scanning the file for recovery)."""
        fd = os.open(self._fence, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        sync_dir(self.directory)

    # --- reads ------------------------------------------------------------------------------------

    def read_entries(self, first: int, count: int) -> list[bytes]:
        """Entries ``first..first+count-1``, each checked against its checksum."""
        offsets = self.offsets
        last = first + count - 1
        if count <= 0 or last >= len(offsets):
            raise IndexError(f"entries {first}..{last} not in ledger {self.ledger_id}")
        start = offsets[first]
        stop = offsets[last + 1] if last + 1 < len(offsets) else self.end
        with self._using() as file:
            buf = file.read(start, stop - start)
        result = record_format.scan(buf, where=self.where, base_offset=start)
        if len(result.records) != count:
            raise CorruptRecord(self.where, start, "record count does not match the index")
        return [payload for _, payload in result.records]

    def entry_size(self, k: int) -> int:
        """Payload size of entry ``k`` from the index (for read byte budgets)."""
        stop = self.offsets[k + 1] if k + 1 < len(self.offsets) else self.end
        return stop - self.offsets[k] - record_format.HEADER_BYTES

    def close(self) -> None:
        with self._lock:
            if self._handles is not None:
                self._handles.forget(self)
            self._close_file()

    def delete(self) -> None:
        """Close and remove the file and its fence marker (trim/delete)."""
        self.close()
        delete_ledger_files(self.directory, self.ledger_id)


def delete_ledger_files(directory: Path, ledger_id: int) -> None:
    """Remove a ledger's file and fence marker, whether or not they exist."""
    for path in (directory / ledger_file_name(ledger_id), fence_marker(directory, ledger_id)):
        path.unlink(missing_ok=True)

"""One ledger's data file: records appended by the writer thread, an offset index, reads.

A ledger file holds the ledger's entries in order as framed records
(:mod:`anabranch.storage.record_format`); entry ``k`` is the ``k``-th record. The index
(``array('q')`` of record start offsets) is built as records are confirmed, or by a strict
scan when a closed ledger is first read after a restart. All methods block: call them on
the writer thread or an executor.

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
from array import array
from itertools import accumulate
from pathlib import Path

from anabranch.errors import CorruptRecord, LedgerFenced
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


class SegmentFile:
    """A ledger file plus the start offset of each confirmed record."""

    def __init__(self, directory: Path, ledger_id: int, file: StorageFile) -> None:
        self.directory = directory
        self.ledger_id = ledger_id
        self.file = file
        self.path = file.path
        self.where = f"ledger {ledger_id}"
        """Names the ledger in errors (never the file path: errors reach clients)."""
        self.offsets = array("q")
        self.end = 0
        """Offset just past the last confirmed record."""
        self._fence = fence_marker(directory, ledger_id)

    @classmethod
    def create(
        cls, directory: Path, ledger_id: int, opener: FileOpener = open_os_file
    ) -> SegmentFile:
        """A new, empty, durable (file and directory entry synced) ledger file."""
        directory.mkdir(parents=True, exist_ok=True)
        file = opener(directory / ledger_file_name(ledger_id))
        file.truncate(0)
        file.sync()
        sync_dir(directory)
        return cls(directory, ledger_id, file)

    @classmethod
    def open_existing(
        cls, directory: Path, ledger_id: int, opener: FileOpener = open_os_file
    ) -> SegmentFile:
        path = directory / ledger_file_name(ledger_id)
        if not path.exists():
            raise CorruptRecord(f"ledger {ledger_id}", 0, "ledger file missing")
        return cls(directory, ledger_id, opener(path))

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
        self.file.write(b"".join(parts))
        if sync:
            self.file.sync()
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
        size = self.file.size()
        result = record_format.scan(self.file.read(0, size), where=self.where, recovery=True)
        if result.valid_end != size:
            self.file.truncate(result.valid_end)
            self.file.sync()
        self.offsets = array("q", [offset for offset, _ in result.records])
        self.end = result.valid_end
        return len(result.records), sum(len(p) for _, p in result.records)

    def load_index(self, entries: int) -> None:
        """Index the first ``entries`` records of a closed ledger, checking each.

        Bytes after them are ignored: a fenced writer may have appended records it never
        acknowledged. Fewer records than ``entries`` is corruption (acknowledged data gone).
        """
        size = self.file.size()
        result = record_format.scan(
            self.file.read(0, size), where=self.where, recovery=True, max_records=entries
        )
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
        buf = self.file.read(start, stop - start)
        result = record_format.scan(buf, where=self.where, base_offset=start)
        if len(result.records) != count:
            raise CorruptRecord(self.where, start, "record count does not match the index")
        return [payload for _, payload in result.records]

    def entry_size(self, k: int) -> int:
        """Payload size of entry ``k`` from the index (for read byte budgets)."""
        stop = self.offsets[k + 1] if k + 1 < len(self.offsets) else self.end
        return stop - self.offsets[k] - record_format.HEADER_BYTES

    def close(self) -> None:
        self.file.close()

    def delete(self) -> None:
        """Close and remove the file and its fence marker (trim/delete)."""
        self.file.close()
        delete_ledger_files(self.directory, self.ledger_id)


def delete_ledger_files(directory: Path, ledger_id: int) -> None:
    """Remove a ledger's file and fence marker, whether or not they exist."""
    for path in (directory / ledger_file_name(ledger_id), fence_marker(directory, ledger_id)):
        path.unlink(missing_ok=True)

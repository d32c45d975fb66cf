"""The file-backed managed ledger: one file per ledger, metadata in the metadata store.

Theory of operation.

* **Layout.** ``<data_dir>/<disk name>/<ledger id:020d>.log`` per ledger (see
  :mod:`~anabranch.storage.segment_file`); the disk name (:func:`disk_name`) is the
  percent-quoted name, or, when that is over 255 bytes, a quoted prefix + ``#`` + the
  SHA-256 of the name, so every valid name fits any filesystem. Metadata keys (all JSON
  unless noted; ``<quoted name>`` is the same disk name):

  - ``/ledger-id-counter`` → the next ledger id (decimal), advanced by CAS: ids are unique
    across every broker sharing the store;
  - ``/ledgers/<id:020d>`` → ``{state: OPEN|CLOSED, lastEntryId, size, managedLedger}``;
  - ``/managed-ledgers/<quoted name>`` → ``{ledgers: [{id, entries, size, closedMs}],
    terminatedAt: [l, e] | null, owner}``;
  - ``/managed-ledgers/<quoted name>/cursors/<quoted cursor>`` → AckState bytes.

* **Appends** are numbered on the event loop and collected in a batch (all appends of
  one loop iteration) that goes to the ledger's queue on the factory's shared
  :class:`WriterPool` (``limits.STORAGE_WRITER_THREADS`` threads for every ledger, not
  one per ledger). A pool thread takes everything queued for the ledger (up to
  ``STORAGE_GROUP_COMMIT_BYTES_MAX``), frames it, writes it with one ``write``, one
  ``fdatasync`` (fsync policy ``always``) and hands it back with one
  ``call_soon_threadsafe``; a ledger is on one thread at a time, so its order holds.
  Ledger files are opened through the factory's ``FileHandles``, which closes the least
  recently used idle ones past ``limits.STORAGE_OPEN_FILES_MAX``. Every append of a
  batch awaits the batch's one future, which resolves only after the batch is durable.
  The per-append cost on the loop is what bounds throughput (Python holds one lock for
  every thread), so the append fast path is a few attribute checks, two list/counter
  updates and one await.

* **Failures.** A write or fsync error fails the batch and every later append with
  StorageIOError until the ledger is reopened: after a failed fsync the page cache may
  have dropped the data, so the file is no longer trusted (recovery re-scans it).

* **Open = recovery + fencing.** Opening reads the managed ledger's record; the last
  ledger, if still OPEN, is fenced (marker file, see segment_file), scanned (torn tail
  truncated, corruption raised), and CLOSED by CAS on its key. A new ledger is created and
  the record rewritten by CAS with a fresh ``owner``. The previous owner's next metadata
  change (rollover, trim, terminate, cursor persist) fails its version check and its next
  append fails the fence check: both raise LedgerFenced.

* **Rollover** by entries, bytes and age: new appends wait (FIFO) while the writer drains,
  then one metadata commit closes the old ledger, opens the new one and updates the list.

Example:
    >>> import tempfile
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo(data_dir: Path, store: MetadataStore) -> None:
    ...     factory = FileManagedLedgerFactory(data_dir, store)
    ...     ml = await factory.open("public/default/persistent/t")
    ...     print(await ml.append(b"x"))
    ...     await ml.close()
    ...     await factory.close()
    ...     await store.close()
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     asyncio.run(demo(Path(tmp), MemoryMetadataStore()))
    Position(ledger_id=1, entry_id=0)
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import queue
import shutil
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, unquote

from anabranch import failpoints, limits
from anabranch.clock import Clock, SystemClock
from anabranch.errors import (
    BadVersion,
    Closed,
    CorruptRecord,
    LedgerFenced,
    LedgerSealed,
    NotFound,
    StorageError,
    StorageFull,
    StorageIOError,
    ValueTooLarge,
)
from anabranch.metadata.api import Check, Delete, MetadataStore, Put, Stat
from anabranch.storage.api import ManagedLedgerConfig, Position
from anabranch.storage.base import (
    LedgerInfo,
    ManagedLedgerBase,
    position_from_json,
    position_json,
)
from anabranch.storage.files import FileOpener, open_os_file
from anabranch.storage.segment_file import (
    FileHandles,
    SegmentFile,
    delete_ledger_files,
    ledger_file_name,
)
from anabranch.storage.tail_cache import TailCache, TailCacheBudget

if TYPE_CHECKING:
    from anabranch.storage.tiered import TieredStorage

LEDGER_ID_COUNTER = "/ledger-id-counter"
LEDGERS_PREFIX = "/ledgers/"
MANAGED_LEDGERS_PREFIX = "/managed-ledgers/"


_RECORD_MAX = limits.STORAGE_RECORD_BYTES_MAX
_QUEUE_ENTRIES_MAX = limits.STORAGE_APPEND_QUEUE_ENTRIES_MAX
_QUEUE_BYTES_MAX = limits.STORAGE_APPEND_QUEUE_BYTES_MAX
_T = TypeVar("_T")
_tuple_new = tuple.__new__  # Position(a, b) without NamedTuple's Python-level __new__


def _cancelling() -> int:
    """How many cancellations of the current task are pending."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def _q(name: str) -> str:
    return quote(name, safe="")


log = logging.getLogger(__name__)

DISK_NAME_BYTES_MAX = 255
"""A path component every common filesystem accepts (ext4, xfs, btrfs, APFS, NTFS)."""
_DISK_PREFIX_CHARS = 150


def disk_name(name: str) -> str:
    """The file/directory (and metadata key) name of managed ledger ``name``.

    Today's percent-quoted name when it fits in :data:`DISK_NAME_BYTES_MAX` (so existing
    data directories stay readable); otherwise an escaped prefix, ``#`` (which quoting
    never leaves bare, so no short name maps here) and the SHA-256 of the whole name.
    Quoted names hold only ``[A-Za-z0-9_.~%-]``: no character a filesystem refuses.

    Example:
        >>> disk_name("t/ns/persistent/x")
        't%2Fns%2Fpersistent%2Fx'
        >>> long = disk_name("t/ns/persistent/" + ":" * 250)
        >>> len(long), long[:25], long[-65]
        (213, 't%2Fns%2Fpersistent%2F%3A', '#')
    """
    quoted = _q(name)
    if len(quoted) <= DISK_NAME_BYTES_MAX:
        return quoted
    prefix = quoted[:_DISK_PREFIX_CHARS]
    cut = prefix.find("%", len(prefix) - 2)
    if cut != -1:
        prefix = prefix[:cut]  # never half an escape
    return f"{prefix}#{hashlib.sha256(name.encode()).hexdigest()}"


def io_error(err: BaseException, what: str, path: object = None) -> StorageError:
    """``err`` as a StorageError whose message names no file path (for clients); the
    full error, path included, goes to the log."""
    if isinstance(err, StorageError):
        return err
    log.warning("%s%s: %r", what, f" ({path})" if path is not None else "", err)
    if isinstance(err, OSError):
        reason = err.strerror or type(err).__name__
        cls = StorageFull if err.errno in (errno.ENOSPC, errno.EDQUOT) else StorageIOError
        return cls(f"{what}: {reason} (errno {err.errno})")
    return StorageIOError(f"{what}: {type(err).__name__}")


async def _in_thread(fn: Callable[..., _T], *args: Any, what: str) -> _T:
    """``asyncio.to_thread`` with OSError turned into a path-free StorageIOError."""
    try:
        return await asyncio.to_thread(fn, *args)
    except OSError as err:
        raise io_error(err, what) from err


"""(ledger id, first entry) of a tail-cache batch."""


def ledger_path(ledger_id: int) -> str:
    return f"{LEDGERS_PREFIX}{ledger_id:020d}"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


class _Batch:
    """Appends queued together: one write + one fdatasync on the writer thread, one loop
    callback, and one future that every append of the batch awaits (no future per
    append). The outcome is also kept here, for appenders whose shared future another
    appender's cancellation took away (see :meth:`FileManagedLedger._await_batch`)."""

    __slots__ = (
        "count",
        "done",
        "error",
        "fallback",
        "finished",
        "first_entry",
        "ledger_id",
        "payloads",
        "size",
    )

    def __init__(self, ledger_id: int, first_entry: int, done: asyncio.Future[None]) -> None:
        self.ledger_id = ledger_id
        self.first_entry = first_entry
        self.done = done
        self.payloads: list[bytes] = []
        self.count = 0
        self.size = 0
        """Payload bytes (``count`` and ``size`` are set when the batch is submitted)."""
        self.finished = False
        self.error: StorageError | None = None
        self.fallback: asyncio.Future[None] | None = None


_WriterItem = tuple[SegmentFile, _Batch] | asyncio.Future[None]
"""A batch to write to a segment, or a stop marker (a future the pool resolves)."""


class _Channel:
    """One ledger's queue on the :class:`WriterPool` (group commit, in order).

    Appends queue here; the first one into an empty channel schedules the channel on the
    pool. A pool thread takes every batch queued for the same file (up to
    ``STORAGE_GROUP_COMMIT_BYTES_MAX``), frames them into one ``write`` and one
    ``fdatasync``, and hands them back with one ``call_soon_threadsafe``; then it puts the
    channel back at the end of the pool's queue if more arrived meanwhile (they form the
    next group), so one busy ledger cannot starve the others. A channel is on at most
    one thread at a time: its batches are written in the order they were submitted.
    """

    __slots__ = ("_broken", "_items", "_lock", "_loop", "_ml", "_pool", "_scheduled", "_sync")

    def __init__(self, pool: WriterPool, ml: FileManagedLedger, sync: bool) -> None:
        self._pool = pool
        self._ml = ml
        self._loop = asyncio.get_running_loop()
        # The ack-before-fsync seeded bug (test-only failpoint): acks without fdatasync.
        self._sync = sync and not failpoints.enabled(failpoints.ACK_BEFORE_FSYNC)
        self._items: deque[_WriterItem] = deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self._broken: BaseException | None = None

    def submit(self, segment: SegmentFile, batch: _Batch) -> None:
        self._put((segment, batch))

    def stop(self) -> asyncio.Future[None]:
        """A future resolved once everything queued before it is written."""
        done: asyncio.Future[None] = self._loop.create_future()
        self._put(done)
        return done

    def _put(self, item: _WriterItem) -> None:
        with self._lock:
            self._items.append(item)
            if self._scheduled:
                return
            self._scheduled = True
        self._pool._schedule(self)

    def run_once(self) -> None:
        """On a pool thread: write one group (or resolve one stop marker)."""
        limit = limits.STORAGE_GROUP_COMMIT_BYTES_MAX
        items = self._items
        with self._lock:
            item = items.popleft()
            if isinstance(item, asyncio.Future):
                stop: asyncio.Future[None] | None = item
                batches: list[_Batch] = []
            else:
                stop = None
                segment, first = item
                batches = [first]
                size = first.size
                # Every batch queued behind it for the same file joins this group.
                while items:
                    nxt = items[0]
                    if isinstance(nxt, asyncio.Future) or nxt[0] is not segment:
                        break
                    if size + nxt[1].size > limit:
                        break
                    items.popleft()
                    batches.append(nxt[1])
                    size += nxt[1].size
        try:
            if stop is not None:
                self._loop.call_soon_threadsafe(_resolve, stop)
            else:
                error = self._write(segment, batches)
                self._loop.call_soon_threadsafe(self._ml._batches_done, segment, batches, error)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more
        finally:
            with self._lock:
                again = bool(items)
                self._scheduled = again
            if again:
                self._pool._schedule(self)

    def _write(self, segment: SegmentFile, batches: list[_Batch]) -> BaseException | None:
        error: BaseException | None = self._broken
        if error is not None:
            return error
        try:
            if len(batches) == 1:
                segment.append_batch(batches[0].payloads, sync=self._sync)
            else:
                payloads: list[bytes] = []
                for batch in batches:
                    payloads += batch.payloads
                segment.append_batch(payloads, sync=self._sync)
        except LedgerFenced as err:
            error = self._broken = err
        except OSError as err:
            error = self._broken = io_error(
                err, f"{segment.where} write (the ledger must be reopened)", segment.path
            )
        except BaseException as err:  # never leave futures hanging
            error = self._broken = io_error(err, f"{segment.where} write", segment.path)
        return error


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class WriterPool:
    """At most ``size`` writer threads shared by every ledger of one factory.

    Threads start on demand (when a ledger is scheduled and no thread is free) and exit
    after ``limits.STORAGE_WRITER_IDLE_S`` without work, so an idle broker and a closed
    factory hold none. See :class:`_Channel` for what a thread does with a ledger.

    Example:
        >>> pool = WriterPool(4)
        >>> pool.threads
        0
    """

    def __init__(self, size: int = limits.STORAGE_WRITER_THREADS) -> None:
        self.size = max(1, min(size, limits.STORAGE_WRITER_THREADS))
        self._ready: queue.SimpleQueue[_Channel] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._pending = 0
        self._started = 0

    @property
    def threads(self) -> int:
        """Writer threads alive now."""
        return self._threads

    def channel(self, ml: FileManagedLedger, sync: bool) -> _Channel:
        """A new queue for ``ml`` (call on the ledger's event loop)."""
        return _Channel(self, ml, sync)

    def _schedule(self, channel: _Channel) -> None:
        self._ready.put(channel)
        with self._lock:
            self._pending += 1
            if self._pending <= self._idle or self._threads >= self.size:
                return
            self._threads += 1
            self._started += 1
            name = f"ledger-writer-{self._started}"
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        get = self._ready.get
        idle_s = limits.STORAGE_WRITER_IDLE_S
        while True:
            with self._lock:
                self._idle += 1
            try:
                channel = get(timeout=idle_s)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._pending == 0:
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            channel.run_once()


class FileManagedLedger(ManagedLedgerBase):
    """A managed ledger on local files; see the module docstring."""

    def __init__(
        self,
        factory: FileManagedLedgerFactory,
        name: str,
        config: ManagedLedgerConfig,
    ) -> None:
        super().__init__(name, config, factory.clock)
        self._factory = factory
        self._store = factory.store
        self._dir = factory.data_dir / disk_name(name)
        self._path = MANAGED_LEDGERS_PREFIX + disk_name(name)
        self._owner = uuid.uuid4().hex
        self._ml_version = 0
        self._ledger_version = 0  # version of the current ledger's /ledgers key
        self._segment: SegmentFile | None = None
        self._ledger_created = self.clock.monotonic()
        self._segments: dict[int, SegmentFile] = {}
        self._writer: _Channel | None = None
        self._batch: _Batch | None = None
        self._next_entry = 0
        self._inflight = 0
        self._inflight_bytes = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._append_waiters: deque[tuple[asyncio.Future[None], int]] = deque()
        self._reserved = 0
        self._reserved_bytes = 0
        self._rolling = False
        self._terminating = False
        self._seal_durable = False
        """terminate()'s record landed (before that, a terminating ledger may still fail
        to seal and go on taking appends)."""
        self._tail = TailCache(limits.STORAGE_TAIL_CACHE_BYTES_MAX, factory.tail_budget)
        self._rollover_task: asyncio.Task[None] | None = None

    # --- open / recovery ----------------------------------------------------------------------

    async def _recover(self) -> None:
        record = await self._store.get(self._path)
        info: dict[str, Any] = (
            json.loads(record.value) if record else {"ledgers": [], "terminatedAt": None}
        )
        expected = record.stat.version if record else 0
        ledgers = [LedgerInfo.from_json(obj) for obj in info["ledgers"]]
        ops: list[Put | Delete | Check] = []
        if ledgers and ledgers[-1].closed_ms is None:
            last = ledgers[-1]
            await self._recover_open_ledger(last)
            if last.entries == 0:
                ledgers.pop()
                ops.append(Delete(ledger_path(last.ledger_id)))
        terminated = info.get("terminatedAt")
        self._terminated_at = Position(*terminated) if terminated else None
        self._trimmed_to = position_from_json(info.get("trimmedTo"))
        if self._terminated_at is None:
            ledgers.append(await self._create_ledger(ops))
        info = {
            "ledgers": [i.to_json() for i in ledgers],
            "terminatedAt": terminated,
            "owner": self._owner,
            "trimmedTo": position_json(self._trimmed_to),
        }
        ops.append(Put(self._path, _dumps(info), expected_version=expected))
        results = await self._commit(ops)
        self._ml_version = results[-1]
        if self._terminated_at is None:
            self._ledger_version = 1
        self._set_ledgers(ledgers)
        await self._load_cursors()
        if self._terminated_at is None:
            self._writer = self._factory.writers.channel(self, self.config.fsync == "always")

    async def _recover_open_ledger(self, last: LedgerInfo) -> None:
        """Fence, scan and close the previous owner's last ledger (CAS on its key)."""
        record = await self._store.get(ledger_path(last.ledger_id))
        if record is None:
            raise NotFound(ledger_path(last.ledger_id))
        meta = json.loads(record.value)
        if meta["state"] == "OPEN":
            segment = await _in_thread(
                SegmentFile.open_existing,
                self._dir,
                last.ledger_id,
                self._factory.opener,
                self._factory.handles,
                what=self.name,
            )
            try:
                await _in_thread(segment.fence, what=self.name)
                entries, size = await _in_thread(segment.recover, what=self.name)
            finally:
                await _in_thread(segment.close, what=self.name)
            meta = {
                "state": "CLOSED",
                "lastEntryId": entries - 1,
                "size": size,
                "managedLedger": self.name,
            }
            try:
                await self._store.put(
                    ledger_path(last.ledger_id), _dumps(meta), expected_version=record.stat.version
                )
            except BadVersion as err:
                raise LedgerFenced(
                    f"{self.name}: ledger {last.ledger_id} recovered by another owner"
                ) from err
        last.entries = int(meta["lastEntryId"]) + 1
        last.size = int(meta["size"])
        last.closed_ms = self.clock.wall_ms()
        if last.entries == 0:
            await _in_thread(self._delete_segment_files, last.ledger_id, what=self.name)

    async def _create_ledger(self, ops: list[Put | Delete | Check]) -> LedgerInfo:
        """Allocate an id, create its file durably, add its key to ``ops``."""
        ledger_id = await self._factory.allocate_ledger_id()
        segment = await _in_thread(
            SegmentFile.create,
            self._dir,
            ledger_id,
            self._factory.opener,
            self._factory.handles,
            what=self.name,
        )
        self._segment = segment
        self._segments[ledger_id] = segment
        self._next_entry = 0
        self._ledger_created = self.clock.monotonic()
        meta = {"state": "OPEN", "lastEntryId": -1, "size": 0, "managedLedger": self.name}
        ops.append(Put(ledger_path(ledger_id), _dumps(meta), expected_version=0))
        return LedgerInfo(ledger_id)

    async def _commit(self, ops: Sequence[Put | Delete | Check]) -> list[int]:
        """Commit; a version conflict means another owner took over: LedgerFenced."""
        try:
            result = await self._store.commit(ops)
        except BadVersion as err:
            self._failure = LedgerFenced(f"{self.name}: fenced by another owner ({err})")
            raise self._failure from err
        return [r.version if isinstance(r, Stat) else 0 for r in result.results]

    async def _load_cursors(self) -> None:
        prefix = f"{self._path}/cursors/"
        start_after: str | None = None
        while True:
            page = await self._store.list_prefix(prefix, start_after=start_after)
            for rec in page.records:
                self._restore_cursor(unquote(rec.path[len(prefix) :]), rec.value)
            if not page.more:
                return
            start_after = page.records[-1].path

    def _ml_info(self, ledgers: list[LedgerInfo] | None = None) -> bytes:
        end = self._terminated_at
        ledgers = self._ledgers if ledgers is None else ledgers
        return _dumps(
            {
                "ledgers": [i.to_json() for i in ledgers],
                "terminatedAt": list(end) if end else None,
                "owner": self._owner,
                "trimmedTo": position_json(self._trimmed_to),
            }
        )

    # --- appends ------------------------------------------------------------------------------

    @property
    def is_terminated(self) -> bool:
        # Only once terminate()'s record landed: until then it may still fail.
        return self._terminated_at is not None and (self._seal_durable or not self._terminating)

    def _check_appendable(self) -> None:
        self.check_open()
        if self._terminating and not self._seal_durable:
            # Not sealed yet (the terminate may still fail): a retriable answer, so that a
            # producer resends in order instead of re-routing this one message while the
            # ledger, its terminate failed, stores the later ones.
            raise Closed(f"managed ledger {self.name} is being terminated")
        if self._terminated_at is not None:
            raise LedgerSealed(f"managed ledger {self.name} is terminated")

    def _has_room(self, size: int) -> bool:
        entries = self._inflight + self._reserved
        return entries == 0 or (
            entries < limits.STORAGE_APPEND_QUEUE_ENTRIES_MAX
            and self._inflight_bytes + self._reserved_bytes + size
            <= limits.STORAGE_APPEND_QUEUE_BYTES_MAX
        )

    async def _wait_turn(self, size: int) -> None:
        """Wait in FIFO order for room (or the end of a rollover); returns holding a
        reservation of one entry of ``size`` bytes that the caller must give back.

        While anyone waits, newcomers queue behind them, so entry order follows call
        order for a producer that pipelines appends.
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._append_waiters.append((fut, size))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # released, then cancelled: pass it on
                self._unreserve(size)
                self._release_waiters()
            raise

    def _unreserve(self, size: int) -> None:
        self._reserved -= 1
        self._reserved_bytes -= size

    def _release_waiters(self, everyone: bool = False) -> None:
        waiters = self._append_waiters
        while waiters and (everyone or not self._rolling):
            fut, size = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            if not everyone and not self._has_room(size):
                return
            waiters.popleft()
            self._reserved += 1
            self._reserved_bytes += size
            fut.set_result(None)

    def _new_batch(self) -> _Batch:
        assert self._segment is not None
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        batch = self._batch = _Batch(self._segment.ledger_id, self._next_entry, done)
        self._drained.clear()
        # Submitted at the end of this loop iteration so appends made in the same
        # iteration share one hand-off to the writer. (It cannot grow past the append
        # queue bounds, which every append checks.)
        loop.call_soon(self._submit)
        return batch

    def _enqueue(self, data: bytes) -> tuple[_Batch, int]:
        """Queue ``data`` in the open batch; (its batch, its entry id)."""
        n = len(data)
        if n > _RECORD_MAX:
            raise ValueTooLarge("entry", n, _RECORD_MAX)
        batch = self._batch or self._new_batch()
        batch.payloads.append(data)
        entry_id = self._next_entry
        self._next_entry = entry_id + 1
        self._inflight += 1
        self._inflight_bytes += n
        return batch, entry_id

    def _submit(self) -> None:
        if self._batch is not None:
            assert self._writer is not None
            self._submit_to(self._writer)

    def _submit_to(self, writer: _Channel) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            # Counted here, once per batch, not per append.
            batch.count = len(batch.payloads)
            batch.size = sum(map(len, batch.payloads))
            assert self._segment is not None
            writer.submit(self._segment, batch)

    async def append(self, data: bytes) -> Position:
        n = len(data)
        if (
            self._closed
            or self._failure is not None
            or self._terminating
            or self._terminated_at is not None
            or self._rolling
            or self._append_waiters
            or n > _RECORD_MAX
            or self._inflight + self._reserved >= _QUEUE_ENTRIES_MAX
            or self._inflight_bytes + self._reserved_bytes + n > _QUEUE_BYTES_MAX
        ):
            return await self._append_slow(data)
        # The fast path (a plain ledger taking appends): _enqueue inlined.
        batch = self._batch or self._new_batch()
        batch.payloads.append(data)
        entry_id = self._next_entry
        self._next_entry = entry_id + 1
        self._inflight += 1
        self._inflight_bytes += n
        done = batch.done
        try:
            await done
        except asyncio.CancelledError:
            if not done.cancelled() or _cancelling():
                raise
            await self._await_batch(batch)  # another appender's cancellation took `done`
        return _tuple_new(Position, (batch.ledger_id, entry_id))

    async def _append_slow(self, data: bytes) -> Position:
        self._check_appendable()
        size = len(data)
        if self._rolling or self._append_waiters or not self._has_room(size):
            await self._wait_turn(size)
            self._unreserve(size)
            self._check_appendable()
        batch, entry_id = self._enqueue(data)
        await self._await_batch(batch)
        return Position(batch.ledger_id, entry_id)

    async def append_many(self, entries: Sequence[bytes]) -> list[Position]:
        self._check_appendable()
        for data in entries:
            if len(data) > _RECORD_MAX:
                raise ValueTooLarge("entry", len(data), _RECORD_MAX)
        size = sum(len(d) for d in entries)
        if self._rolling or self._append_waiters or not self._has_room(size):
            await self._wait_turn(size)
            self._unreserve(size)
            self._check_appendable()
        placed = [self._enqueue(d) for d in entries]
        for batch in dict.fromkeys(batch for batch, _ in placed):
            await self._await_batch(batch)
        return [Position(batch.ledger_id, entry_id) for batch, entry_id in placed]

    async def _await_batch(self, batch: _Batch) -> None:
        """Wait for ``batch`` to be durable (or raise its error).

        The batch's future is shared by its appenders, so cancelling one appender's task
        cancels it under the others; they then wait on ``fallback`` (made on demand), which
        :meth:`_batches_done` also resolves. Only the task that was cancelled sees
        CancelledError.
        """
        while not batch.finished:
            fut = batch.done
            if fut.cancelled():
                fallback = batch.fallback
                if fallback is None or fallback.done():
                    fallback = batch.fallback = asyncio.get_running_loop().create_future()
                fut = fallback
            try:
                await fut
            except asyncio.CancelledError:
                if not fut.cancelled() or _cancelling():
                    raise
            except StorageError:
                break
        if batch.error is not None:
            raise batch.error

    def _batches_done(
        self, segment: SegmentFile, batches: list[_Batch], error: BaseException | None
    ) -> None:
        """On the loop: resolve committed (or failed) batches, in commit order."""
        for batch in batches:
            self._inflight -= batch.count
            self._inflight_bytes -= batch.size
            batch.finished = True
            done = batch.done
            if error is not None:
                if self._failure is None:
                    self._failure = io_error(error, f"{self.name} append")
                batch.error = self._failure
                if not done.done():
                    done.set_exception(self._failure)
                    done.exception()  # retrieved here: its appenders may all be gone
            else:
                info = self._ledgers[-1]
                assert info.ledger_id == segment.ledger_id == batch.ledger_id
                assert info.entries == batch.first_entry
                self._entries_confirmed(info, batch.count, batch.size)
                self._tail.add(info.ledger_id, batch.first_entry, batch.payloads, batch.size)
                if not done.done():
                    done.set_result(None)
            if batch.fallback is not None and not batch.fallback.done():
                batch.fallback.set_result(None)
        if error is not None:
            self._wake()
        else:
            self._maybe_rollover(self._ledgers[-1])
        if self._inflight == 0:
            self._drained.set()
        self._release_waiters()

    def _maybe_rollover(self, info: LedgerInfo) -> None:
        if self._rolling or self._terminating or self._failure is not None:
            return
        age_ms = (self.clock.monotonic() - self._ledger_created) * 1000
        if (
            info.entries >= self.config.ledger_entries_max
            or info.size >= self.config.ledger_bytes_max
            or age_ms >= self.config.ledger_age_ms
        ):
            self._rolling = True
            self._rollover_task = asyncio.get_running_loop().create_task(self._rollover())

    async def roll_over_if_due(self) -> bool:
        """Roll an idle, non-empty ledger over once it is older than ``ledger_age_ms``
        (Pulsar's rollover timer), so retention can delete it; True if it rolled."""
        if self._closed or self._terminated_at is not None or not self._ledgers:
            return False
        current = self._ledgers[-1]
        if current.entries == 0 or self._rolling:
            return False
        self._maybe_rollover(current)
        task = self._rollover_task
        if not self._rolling or task is None:
            return False
        await asyncio.gather(task, return_exceptions=True)
        return self._ledgers[-1] is not current

    async def _rollover(self) -> None:
        try:
            await self._drained.wait()
            if self._failure is not None or self._closed:
                return
            async with self._meta_lock:
                old = self._ledgers[-1]
                old_version = self._ledger_version
                ops: list[Put | Delete | Check] = []
                new = await self._create_ledger(ops)
                old.closed_ms = self.clock.wall_ms()
                meta = {
                    "state": "CLOSED",
                    "lastEntryId": old.entries - 1,
                    "size": old.size,
                    "managedLedger": self.name,
                }
                ops.append(Put(ledger_path(old.ledger_id), _dumps(meta), old_version))
                self._ledgers.append(new)
                self._ids.append(new.ledger_id)
                ops.append(Put(self._path, self._ml_info(), self._ml_version))
                versions = await self._commit(ops)
                self._ledger_version = versions[0]
                self._ml_version = versions[-1]
        except Exception as err:
            if self._failure is None:
                self._failure = io_error(err, f"{self.name} rollover")
        finally:
            self._rolling = False
            self._release_waiters()

    # --- reads ----------------------------------------------------------------------------------

    async def _read_ledger(
        self, info: LedgerInfo, first: int, count: int, max_bytes: int, at_least_one: bool
    ) -> list[bytes]:
        cached = self._tail.get(info.ledger_id, first, count)
        if cached is None:
            segment = await self._segment_for(info)
            count = self._fit(segment, first, count, max_bytes, at_least_one)
            return await _in_thread(segment.read_entries, first, count, what=self.name)
        out: list[bytes] = []
        used = 0
        for data in cached:
            if (out or not at_least_one) and used + len(data) > max_bytes:
                break
            out.append(data)
            used += len(data)
        return out

    @staticmethod
    def _fit(segment: SegmentFile, first: int, count: int, max_bytes: int, one: bool) -> int:
        used = 0
        for k in range(count):
            used += segment.entry_size(first + k)
            if used > max_bytes and (k > 0 or not one):
                return k
        return count

    async def _segment_for(self, info: LedgerInfo) -> SegmentFile:
        segment = self._segments.get(info.ledger_id)
        if segment is None:
            segment = await _in_thread(
                SegmentFile.open_existing,
                self._dir,
                info.ledger_id,
                self._factory.opener,
                self._factory.handles,
                what=self.name,
            )
            try:
                await _in_thread(segment.load_index, info.entries, what=self.name)
            except CorruptRecord:
                await _in_thread(segment.close, what=self.name)
                raise
            self._segments[info.ledger_id] = segment
        return segment

    # --- cursors, trim, terminate, delete, close --------------------------------------------------

    def _cursor_path(self, name: str) -> str:
        return f"{self._path}/cursors/{_q(name)}"

    async def persist_cursor(self, name: str, data: bytes) -> None:
        if self._failure is not None and isinstance(self._failure, LedgerFenced):
            raise self._failure
        if name not in self._cursors:
            return
        async with self._meta_lock:
            await self._commit(
                [
                    Check(self._path, expected_version=self._ml_version),
                    Put(self._cursor_path(name), data),
                ]
            )

    async def _remove_cursor(self, name: str) -> None:
        async with self._meta_lock:
            await self._commit(
                [
                    Check(self._path, expected_version=self._ml_version),
                    Delete(self._cursor_path(name)),
                ]
            )

    async def _commit_trim(self, doomed: list[LedgerInfo], remaining: list[LedgerInfo]) -> None:
        ops: list[Put | Delete | Check] = [
            Put(self._path, self._ml_info(remaining), self._ml_version)
        ]
        ops += [Delete(ledger_path(i.ledger_id)) for i in doomed]
        versions = await self._commit(ops)
        self._ml_version = versions[0]
        for i in doomed:
            segment = self._segments.pop(i.ledger_id, None)
            if segment is not None:
                await _in_thread(segment.close, what=self.name)
            await _in_thread(self._delete_segment_files, i.ledger_id, what=self.name)

    def _delete_segment_files(self, ledger_id: int) -> None:
        delete_ledger_files(self._dir, ledger_id)

    async def _persist_ledger_list(self) -> None:
        [self._ml_version] = await self._commit(
            [Put(self._path, self._ml_info(), self._ml_version)]
        )

    async def _delete_hot_ledger(self, ledger_id: int) -> None:
        segment = self._segments.pop(ledger_id, None)
        if segment is not None:
            await _in_thread(segment.close, what=self.name)
        await _in_thread(self._delete_segment_files, ledger_id, what=self.name)

    async def terminate(self) -> Position:
        if self._terminated_at is not None:
            return self._terminated_at
        self.check_open()
        self._terminating = True
        self._submit()
        await self._drained.wait()
        if self._rollover_task is not None:  # a rollover that started before us finishes first
            await asyncio.gather(self._rollover_task, return_exceptions=True)
        self.check_open()
        async with self._meta_lock:
            current = self._ledgers[-1]
            end = self._last_confirmed
            current.closed_ms = self.clock.wall_ms()
            self._terminated_at = end
            meta = {
                "state": "CLOSED",
                "lastEntryId": current.entries - 1,
                "size": current.size,
                "managedLedger": self.name,
            }
            ops: list[Put | Delete | Check] = [
                Put(ledger_path(current.ledger_id), _dumps(meta), self._ledger_version),
                Put(self._path, self._ml_info(), self._ml_version),
            ]
            try:
                versions = await self._commit(ops)
            except BaseException:
                self._terminated_at = None
                current.closed_ms = None
                self._terminating = False  # nothing was sealed: appends may go on
                raise
            self._seal_durable = True
            self._ml_version = versions[-1]
        await self._stop_writer()
        self._wake()
        self._release_waiters(everyone=True)
        return end

    async def _stop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            self._submit_to(writer)
            await writer.stop()

    async def delete(self) -> None:
        self.check_readable()
        await self._drain_quietly()
        async with self._meta_lock:
            ops: list[Put | Delete | Check] = [Delete(self._path, self._ml_version)]
            ops += [Delete(ledger_path(i.ledger_id)) for i in self._ledgers]
            ops += [Delete(self._cursor_path(name)) for name in self._cursors]
            for start in range(0, len(ops), limits.METADATA_TXN_OPS_MAX):
                # The first chunk holds the CAS on the record: a fenced owner deletes nothing.
                await self._commit(ops[start : start + limits.METADATA_TXN_OPS_MAX])
        self._mark_closed()
        await self._release_files()
        await _in_thread(shutil.rmtree, self._dir, True, what=self.name)
        for info in self._ledgers:
            if info.offload is not None:
                await self._delete_offloaded_object(info.offload)

    async def _drain_quietly(self) -> None:
        if not self._drained.is_set():
            self._submit()
            await self._drained.wait()

    async def _release_files(self) -> None:
        await self._stop_writer()
        segments = list(self._segments.values())
        self._segments.clear()
        for segment in segments:
            await _in_thread(segment.close, what=self.name)

    def _mark_closed(self) -> None:
        super()._mark_closed()
        self._tail.clear()  # its share of the broker's cache budget goes back

    async def close(self) -> None:
        if self._closed:
            return
        try:
            await self._drain_quietly()
            if self._rollover_task is not None:
                await asyncio.gather(self._rollover_task, return_exceptions=True)
            if self._failure is None:
                await self._flush_cursors()
        finally:
            self._mark_closed()
            self._release_waiters(everyone=True)
            await self._release_files()


class FileManagedLedgerFactory:
    """Opens :class:`FileManagedLedger` instances under ``data_dir``.

    ``opener`` lets tests inject disk faults (``anabranch.testing.faulty_file``). Every
    ledger of a factory shares its :class:`WriterPool` (``writer_threads`` threads at most)
    and its :class:`~anabranch.storage.segment_file.FileHandles` (``open_files_max`` open
    files at most); both can only be lowered below their ``limits``.
    """

    def __init__(
        self,
        data_dir: Path,
        store: MetadataStore,
        *,
        clock: Clock | None = None,
        opener: FileOpener = open_os_file,
        writer_threads: int = limits.STORAGE_WRITER_THREADS,
        open_files_max: int = limits.STORAGE_OPEN_FILES_MAX,
        tail_cache_bytes: int = limits.STORAGE_TAIL_CACHE_TOTAL_BYTES,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.store = store
        self.clock: Clock = clock or SystemClock()
        self.opener = opener
        self.writers = WriterPool(writer_threads)
        """The writer threads every ledger of this factory shares."""
        self.handles = FileHandles(open_files_max)
        """Bounds the ledger files held open (least recently used ones are closed)."""
        self.tail_budget = TailCacheBudget(tail_cache_bytes)
        """What the tail caches of all its ledgers hold together."""
        self.tiered: TieredStorage | None = None
        """Where offloaded ledgers live (set when an offload driver is configured)."""
        self._open: list[FileManagedLedger] = []
        self._prune_at = 64
        self._id_lock = asyncio.Lock()
        self._closed = False

    async def allocate_ledger_id(self) -> int:
        """The next cluster-wide ledger id (CAS on ``/ledger-id-counter``).

        Allocations of this factory take turns (a lock): a CAS only loses to another
        broker, not to the topics loading here at the same moment (200 concurrent loads
        otherwise spent ~100 read+CAS rounds each, most of a topic load's cost)."""
        async with self._id_lock:
            while True:
                record = await self.store.get(LEDGER_ID_COUNTER)
                current = int(record.value) if record else 1
                try:
                    await self.store.put(
                        LEDGER_ID_COUNTER,
                        str(current + 1).encode(),
                        expected_version=record.stat.version if record else 0,
                    )
                except BadVersion:
                    continue  # another broker won this round
                return current

    async def connect_at_start(self) -> None:
        """Refuse a metadata store older than the ledger files (restored from an old copy,
        or its journal deleted): its id counter would hand out ids whose files hold other
        entries, and the topics it lost would come back empty as if never written."""
        newest = await _in_thread(self._newest_ledger_file, what="data directory scan")
        if newest is None:
            return
        record = await self.store.get(LEDGER_ID_COUNTER)
        next_id = int(record.value) if record else 1
        if newest >= next_id:
            raise StorageError(
                f"the metadata store is older than the data directory {self.data_dir}: "
                f"ledger {newest} has a file but the store's next ledger id is {next_id}"
            )

    def _newest_ledger_file(self) -> int | None:
        if not self.data_dir.is_dir():
            return None
        ids = [
            int(path.stem)
            for path in self.data_dir.glob("*/*.log")
            if path.stem.isdigit() and path.name == ledger_file_name(int(path.stem))
        ]
        return max(ids, default=None)

    async def open(self, name: str, config: ManagedLedgerConfig | None = None) -> FileManagedLedger:
        if self._closed:
            raise Closed("managed ledger factory is closed")
        ml = FileManagedLedger(self, name, config or ManagedLedgerConfig())
        ml.tiered = self.tiered
        try:
            await ml._recover()
        except BaseException:
            await ml._release_files()
            raise
        self._open.append(ml)
        if len(self._open) >= self._prune_at:  # amortised: not a scan per open
            self._open = [m for m in self._open if not m._closed]
            self._prune_at = max(64, 2 * len(self._open))
        return ml

    async def close(self) -> None:
        self._closed = True
        for ml in self._open:
            await ml.close()
        self._open.clear()

"""The replicated managed ledger on NATS JetStream (DESIGN.md §4 and §6).

Theory of operation.

* **Durability** is the servers': ``ManagedLedgerConfig.fsync`` does not apply; run them
  with ``jetstream { sync_interval: always }`` for fsync before every acknowledgement.

* **Layout.** One stream per managed ledger, named by :func:`stream_name` (a prefix, the
  name with every byte outside ``[A-Za-z0-9-]`` escaped as ``_XX``, and, when that is too
  long, an escaped prefix + ``__`` + SHA-256), R3 (configurable), file storage,
  ``allow_direct`` (reads from any current replica) and ``allow_atomic`` (batch publish).
  Entries go to subject ``<stream>.e``; ledger-open markers to ``<stream>.m.<ledger id>``;
  the seal marker to ``<stream>.m.sealed``. A ledger is the run of entries after its
  marker: entry ``k`` of ledger ``L`` is stream sequence ``first_seq[L] + 1 + k``.

* **Metadata** (same store as the file backend; ledger ids from the same
  ``/ledger-id-counter``): ``/js-managed-ledgers/<disk name>`` →
  ``{ledgers: [{id, entries, size, closedMs, firstSeq}], terminatedAt, owner, stream}``;
  cursors under ``<that path>/cursors/<quoted cursor>`` (AckState bytes), written with a
  version check on the record, as in the file backend.

* **Open = claim, fence, resolve.** (1) CAS the record with a fresh owner and a new
  ledger id (a concurrent opener loses with LedgerFenced). (2) Append the new ledger's
  marker with ``Nats-Expected-Last-Sequence`` = the stream's last sequence, re-reading and
  retrying when a stale writer slips an append in, and giving up (LedgerFenced) once the
  record shows a later claim: after the marker lands, every append of the previous owner
  fails its own expected-last-sequence check — that conditional append is the fence.
  (3) Every ledger the record still lists as open ends just before the next marker
  (``next_by_subj``), which gives its entry count; it is closed, empty ones dropped, and
  the record is CASed again with the new ledger's first sequence.

* **A stream deleted behind our back.** The open ledger's next append, read or marker
  finds the stream gone: LedgerFenced. Reopening checks the stream still exists when the
  record names ledger markers (so it was created before) and is LedgerFenced otherwise,
  instead of creating an empty stream under a history that vanished;
  :meth:`JetStreamManagedLedgerFactory.delete_lost` then removes what is left of it.

* **Connecting.** A broker calls :meth:`JetStreamManagedLedgerFactory.connect_at_start`:
  refused credentials stop it; unreachable servers are retried in the background with
  backoff while topic loads fail retriably.

* **Appends** queue on the loop; one writer task takes everything queued (up to
  ``BATCH_MESSAGES_MAX`` entries and ``STORAGE_GROUP_COMMIT_BYTES_MAX`` bytes, never past
  the current ledger's entry bound) and publishes it as one atomic batch whose first
  message expects the sequence the batch before it ends at; up to ``pipeline_depth``
  batches are in flight, acknowledged to appenders strictly in order. A wrong-last-sequence
  reply means another owner appended: LedgerFenced. A timeout or a leaderless stream
  leaves the outcome unknown: the writer lets the pipeline settle, then, batch by batch,
  reads the batch's last sequence back from the stream leader (ours if it carries one of
  our batch ids) and republishes only if the stream still ends where the batch expects —
  never trusting deduplication.

* **Reads** come from a tail cache of recent appends, else a batch direct get from any
  current replica; a lagging replica's short answer is completed from the stream leader.
  **Trim** removes closed ledgers from the record, then purges the stream below the first
  kept marker. **Terminate** appends the seal marker (fence-checked), records
  ``terminatedAt``, then sets the stream's ``sealed`` flag and checks on that fresh stream
  info that the seal marker is the last message. A sealed stream refuses purges, so a
  terminated ledger's trim only updates the record; its bytes go with ``delete``, which
  removes the record, cursors and the stream.

Example (against a NATS server with JetStream)::

    async def demo(store: MetadataStore) -> None:
        factory = JetStreamManagedLedgerFactory(["nats://127.0.0.1:4222"], store)
        ml = await factory.open("public/default/persistent/t")
        await ml.append(b"x")
        await ml.close()
        await factory.close()
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import ssl
import uuid
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from anabranch import limits
from anabranch.clock import Clock, SystemClock
from anabranch.errors import (
    BadVersion,
    Closed,
    CorruptRecord,
    LedgerFenced,
    LedgerSealed,
    StorageError,
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
from anabranch.storage.jetstream_client import (
    BATCH_MESSAGES_MAX,
    ERR_NO_SUITABLE_PEERS,
    ERR_STREAM_SEALED,
    ApiError,
    JetStreamClient,
    NatsAuthError,
    PubAck,
    StreamNotFound,
    WrongLastSequence,
    redact_url,
)
from anabranch.storage.ledger import LEDGER_ID_COUNTER, disk_name
from anabranch.storage.tail_cache import TailCache, TailCacheBudget

if TYPE_CHECKING:
    from anabranch.broker.config import BrokerConfig
    from anabranch.storage.tiered import TieredStorage

log = logging.getLogger(__name__)

JS_MANAGED_LEDGERS_PREFIX = "/js-managed-ledgers/"

STREAM_NAME_CHARS_MAX = 200
_STREAM_PREFIX_CHARS = 100
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
_HEADER_ALLOWANCE = 256
"""Bytes of batch headers per message, kept free under the server's max_payload."""

SEALED_MARKER = "sealed"

START_CONNECT_TIMEOUT_S = 3.0
"""How long a starting broker tries to reach JetStream before it serves anyway and keeps
trying in the background."""
UNAVAILABLE_WAIT_S = 5.0
"""How long a topic load waits for the background connection before it fails (retriable):
below a client's operation timeout, so the client retries instead of giving up."""
CONNECT_ATTEMPT_S = 2.0
"""One background connection attempt (the client library retries within it)."""
CONNECT_BACKOFF_MIN_S = 0.5
CONNECT_BACKOFF_MAX_S = 10.0
"""Pause between background attempts: doubling from the minimum up to the maximum."""


def stream_name(prefix: str, name: str) -> str:
    """The JetStream stream (and subject root) of managed ledger ``name``.

    Every byte outside ``[A-Za-z0-9-]`` becomes ``_XX`` (so ``__`` never occurs in an
    escaped name); a name too long for comfort keeps an escaped prefix, ``__`` and the
    SHA-256 of the whole name, so distinct names never share a stream.

    Example:
        >>> stream_name("ab", "public/default/persistent/t-1")
        'ab-public_2Fdefault_2Fpersistent_2Ft-1'
        >>> long = stream_name("ab", "t/" + "x" * 300)
        >>> len(long), long[-66:-64]
        (169, '__')
    """
    escaped = "".join(chr(b) if b in _SAFE else f"_{b:02X}" for b in name.encode())
    full = f"{prefix}-{escaped}"
    if len(full) <= STREAM_NAME_CHARS_MAX:
        return full
    head = escaped[:_STREAM_PREFIX_CHARS]
    cut = head.find("_", len(head) - 2)
    if cut != -1:
        head = head[:cut]  # never half an escape
    return f"{prefix}-{head}__{hashlib.sha256(name.encode()).hexdigest()}"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _transient(err: ApiError) -> bool:
    """An API error a retry can cure: no leader yet, a timeout, too many requests, peers
    not yet placed, or an atomic batch the server did not commit whole (say its first
    messages went to a server we then lost): the writer reads back before republishing,
    so retrying is safe."""
    return (
        err.code in (408, 429, 500, 503)
        or err.err_code == ERR_NO_SUITABLE_PEERS
        or ("batch" in err.description.lower() and "size" not in err.description.lower())
    )


class _Batch:
    """Appends published together as one atomic batch right after ``expected``."""

    __slots__ = ("batch_id", "expected", "payloads", "pendings", "size", "task", "tried")

    def __init__(self, pendings: list[_Pending], expected: int) -> None:
        self.pendings = pendings
        self.payloads = [p.data for p in pendings]
        self.size = sum(map(len, self.payloads))
        self.expected = expected
        self.batch_id = uuid.uuid4().hex[:22]
        self.tried: set[str] = set()
        self.task: asyncio.Future[PubAck]


class _Pending:
    __slots__ = ("data", "fut")

    def __init__(self, data: bytes, fut: asyncio.Future[Position]) -> None:
        self.data = data
        self.fut = fut


class JetStreamManagedLedger(ManagedLedgerBase):
    """A managed ledger on one JetStream stream; see the module docstring."""

    def __init__(
        self,
        factory: JetStreamManagedLedgerFactory,
        client: JetStreamClient,
        name: str,
        config: ManagedLedgerConfig,
    ) -> None:
        super().__init__(name, config, factory.clock)
        self._factory = factory
        self._client = client
        self._store = factory.store
        self._stream = stream_name(factory.prefix, name)
        self._entries_subject = f"{self._stream}.e"
        self._path = JS_MANAGED_LEDGERS_PREFIX + disk_name(name)
        self._owner = uuid.uuid4().hex
        self._ml_version = 0
        self._first_seq: dict[int, int] = {}
        self._last_seq = 0
        """Stream sequence of the last message we stored (the fence of our next batch)."""
        self._queue: deque[_Pending] = deque()
        self._pipeline: deque[_Batch] = deque()
        self._queued_bytes = 0
        self._room = asyncio.Event()
        self._room_waiters = 0
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._writer: asyncio.Task[None] | None = None
        self._terminating = False
        self._ledger_created = self.clock.monotonic()
        self._tail = TailCache(self._factory.tail_cache_bytes, self._factory.tail_budget)
        self._payload_max = min(
            limits.STORAGE_RECORD_BYTES_MAX, client.max_payload - _HEADER_ALLOWANCE
        )

    @property
    def stream(self) -> str:
        """The JetStream stream holding this managed ledger."""
        return self._stream

    # --- metadata ------------------------------------------------------------------------------

    async def _commit(self, ops: Sequence[Put | Delete | Check]) -> list[int]:
        """Commit; a version conflict means another owner took over: LedgerFenced."""
        try:
            result = await self._store.commit(ops)
        except BadVersion as err:
            self._failure = LedgerFenced(f"{self.name}: fenced by another owner ({err})")
            raise self._failure from err
        return [r.version if isinstance(r, Stat) else 0 for r in result.results]

    def _ml_info(self, ledgers: list[LedgerInfo] | None = None) -> bytes:
        end = self._terminated_at
        ledgers = self._ledgers if ledgers is None else ledgers
        return _dumps(
            {
                "ledgers": [self._ledger_json(i) for i in ledgers],
                "terminatedAt": list(end) if end else None,
                "owner": self._owner,
                "stream": self._stream,
                "trimmedTo": position_json(self._trimmed_to),
            }
        )

    def _ledger_json(self, info: LedgerInfo) -> dict[str, Any]:
        out = info.to_json()
        out["firstSeq"] = self._first_seq.get(info.ledger_id)
        return out

    # --- open: claim, fence, resolve ----------------------------------------------------------

    async def _recover(self) -> None:
        deadline = self._deadline()
        record = await self._store.get(self._path)
        info: dict[str, Any] = (
            json.loads(record.value) if record else {"ledgers": [], "terminatedAt": None}
        )
        # A record naming ledger markers means the stream was created before it: if the
        # stream is missing now, it was deleted behind our back. Creating an empty one
        # would serve a topic whose history silently vanished; fence it instead.
        had_stream = any(obj.get("firstSeq") is not None for obj in info["ledgers"])
        while True:
            try:
                if had_stream:
                    await self._client.stream_info(self._stream)
                await self._client.create_stream(self._factory.stream_config(self._stream))
                break
            except StreamNotFound as err:
                raise LedgerFenced(
                    f"{self.name}: its JetStream stream {self._stream} was deleted behind"
                    " our back (deleting the topic clears it)"
                ) from err
            except StorageIOError as err:  # no leader yet, peers not yet known, a timeout
                await self._backoff(deadline, err)
        expected = record.stat.version if record else 0
        ledgers = [LedgerInfo.from_json(obj) for obj in info["ledgers"]]
        for obj in info["ledgers"]:
            if obj.get("firstSeq") is not None:
                self._first_seq[int(obj["id"])] = int(obj["firstSeq"])
        terminated = info.get("terminatedAt")
        self._terminated_at = Position(*terminated) if terminated else None
        self._trimmed_to = position_from_json(info.get("trimmedTo"))
        if self._terminated_at is not None:
            self._set_ledgers(ledgers)
            versions = await self._commit([Put(self._path, self._ml_info(), expected)])
            self._ml_version = versions[0]
            await self._load_cursors()
            return
        # (1) claim: a fresh owner and the new ledger's id.
        new = LedgerInfo(await self._factory.allocate_ledger_id())
        claimed = [*ledgers, new]
        versions = await self._commit([Put(self._path, self._ml_info(claimed), expected)])
        self._ml_version = versions[0]
        # (2) fence: the new ledger's marker after whatever the previous owner stored.
        marker = await self._append_open_marker(new.ledger_id)
        self._first_seq[new.ledger_id] = marker
        self._last_seq = marker
        # (3) resolve the ledgers left open.
        kept: list[LedgerInfo] = []
        for ledger in ledgers:
            if ledger.closed_ms is None and not await self._resolve(ledger):
                self._first_seq.pop(ledger.ledger_id, None)
                continue
            kept.append(ledger)
        kept.append(new)
        versions = await self._commit([Put(self._path, self._ml_info(kept), self._ml_version)])
        self._ml_version = versions[0]
        self._set_ledgers(kept)
        self._ledger_created = self.clock.monotonic()
        await self._load_cursors()
        self._writer = asyncio.get_running_loop().create_task(
            self._run_writer(), name=f"jetstream-writer:{self.name}"
        )

    async def _append_open_marker(self, ledger_id: int) -> int:
        """Append ``<stream>.m.<ledger_id>`` after the stream's current end (the fence);
        LedgerFenced once another opener has claimed the record after us."""
        client = self._client
        subject = f"{self._stream}.m.{ledger_id}"
        payload = _dumps({"ledger": ledger_id, "owner": self._owner})
        deadline = self._deadline()
        while True:
            try:
                # The stream's end first, then the record: a later claimer's marker that is
                # already in the stream shows up as its claim in the record (claims come
                # before markers); one that lands after we read the end makes our
                # conditional publish fail, and we look again. So a superseded opener never
                # appends its marker after the newer owner's.
                last = await client.last_seq(self._stream)
                record = await self._store.get(self._path)
                if record is None or record.stat.version != self._ml_version:
                    raise LedgerFenced(f"{self.name}: opened again by a newer owner")
                newest = await client.msg_get(self._stream, last_by_subj=f"{self._stream}.m.*")
                if newest is not None and newest.subject == subject:
                    return newest.seq  # an earlier attempt of ours landed
                return await client.publish_one(
                    subject, payload, expected_last_seq=last, timeout_s=self._factory.api_timeout_s
                )
            except WrongLastSequence:
                continue  # the previous owner appended meanwhile: look again
            except StreamNotFound as err:
                raise LedgerFenced(f"{self.name}: its stream was deleted") from err
            except StorageIOError as err:
                await self._backoff(deadline, err)

    async def _resolve(self, ledger: LedgerInfo) -> bool:
        """Close a ledger the record lists as open: its entries run up to the next
        marker. False when it never got a marker (its opener died first)."""
        client = self._client
        deadline = self._deadline()
        while True:
            try:
                first = self._first_seq.get(ledger.ledger_id)
                if first is None:
                    found = await client.msg_get(
                        self._stream, last_by_subj=f"{self._stream}.m.{ledger.ledger_id}"
                    )
                    if found is None:
                        return False
                    first = self._first_seq[ledger.ledger_id] = found.seq
                end = await client.msg_get(
                    self._stream, seq=first + 1, next_by_subj=f"{self._stream}.m.*"
                )
                if end is None:
                    raise StorageIOError(f"{self.name}: no marker after ledger {ledger.ledger_id}")
                ledger.entries = end.seq - first - 1
                ledger.size = await self._sum_sizes(first + 1, ledger.entries)
                ledger.closed_ms = self.clock.wall_ms()
                return ledger.entries > 0
            except StorageIOError as err:
                await self._backoff(deadline, err)

    async def _sum_sizes(self, seq: int, count: int) -> int:
        total = 0
        done = 0
        while done < count:
            step = min(count - done, 1000)
            msgs = await self._read_seqs(seq + done, step, None, True, f"ledger of {seq - 1}")
            total += sum(len(m) for m in msgs)
            done += len(msgs)
        return total

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

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self._factory.append_timeout_s

    async def _backoff(self, deadline: float, err: BaseException, delay: float = 0.2) -> None:
        """Wait before retrying a call whose outcome the cluster did not tell (no leader
        yet, a timeout); past ``deadline`` raise StorageIOError."""
        if isinstance(err, ApiError) and not _transient(err):
            raise err
        loop = asyncio.get_running_loop()
        if loop.time() + delay > deadline:
            if isinstance(err, StorageIOError):
                raise err
            raise StorageIOError(f"{self.name}: {err}") from err
        log.info("%s: JetStream unavailable (%s); retrying", self.name, err)
        await asyncio.sleep(delay)

    # --- appends --------------------------------------------------------------------------------

    def _check_appendable(self) -> None:
        self.check_open()
        if self._terminated_at is not None:
            raise LedgerSealed(f"managed ledger {self.name} is terminated")
        if self._terminating:
            # Not sealed yet (the terminate may still fail): a retriable answer, so that a
            # producer resends in order instead of re-routing this one message while the
            # ledger, its terminate failed, stores the later ones.
            raise Closed(f"managed ledger {self.name} is being terminated")

    def _check_size(self, data: bytes) -> None:
        if len(data) > self._payload_max:
            raise ValueTooLarge("entry", len(data), self._payload_max)

    async def _wait_room(self, size: int) -> None:
        while self._room_waiters or not self._has_room(size):
            self._room_waiters += 1
            try:
                self._room.clear()
                await self._room.wait()
            finally:
                self._room_waiters -= 1
            self._check_appendable()
            if self._has_room(size):
                return

    def _has_room(self, size: int) -> bool:
        return not self._queue or (
            len(self._queue) < limits.STORAGE_APPEND_QUEUE_ENTRIES_MAX
            and self._queued_bytes + size <= limits.STORAGE_APPEND_QUEUE_BYTES_MAX
        )

    def _enqueue(self, data: bytes) -> asyncio.Future[Position]:
        fut: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(data, fut))
        self._queued_bytes += len(data)
        if self._idle.is_set():
            self._idle.clear()
            self._wakeup.set()
        return fut

    async def append(self, data: bytes) -> Position:
        self._check_appendable()
        self._check_size(data)
        if self._room_waiters or not self._has_room(len(data)):
            await self._wait_room(len(data))
        return await self._enqueue(data)

    async def append_many(self, entries: Sequence[bytes]) -> list[Position]:
        self._check_appendable()
        for data in entries:
            self._check_size(data)
        if not entries:
            return []
        size = sum(len(d) for d in entries)
        if self._room_waiters or not self._has_room(size):
            await self._wait_room(size)
        futs = [self._enqueue(d) for d in entries]
        return list(await asyncio.gather(*futs))

    async def _run_writer(self) -> None:
        """The one task that stores batches, in queue order, up to ``pipeline_depth``
        batches in flight (each expects the end of the one before it)."""
        pipeline = self._pipeline
        depth = self._factory.pipeline_depth
        try:
            while True:
                while len(pipeline) < depth and self._queue and self._fill(pipeline):
                    pass
                if not pipeline:
                    if self._queue:  # the current ledger is full: roll over, then go on
                        await self._rollover()
                        continue
                    self._idle.set()
                    if self._stopping:
                        return
                    await self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                batch = pipeline[0]
                try:
                    ack = await batch.task
                    if ack.last_seq != batch.expected + len(batch.payloads):
                        raise StorageIOError(
                            f"{self.name}: batch stored at {ack.last_seq}, expected"
                            f" {batch.expected + len(batch.payloads)}"
                        )
                except StorageIOError as err:
                    # Settle everything in flight first, then recover in order: a later
                    # batch can only have landed if this one did.
                    await asyncio.gather(*(b.task for b in pipeline), return_exceptions=True)
                    await self._recover_batch(batch, err)
                self._confirm(pipeline.popleft())
        except Exception as err:
            failure = err if isinstance(err, StorageError) else StorageIOError(repr(err))
            if self._failure is None:
                self._failure = failure
            for batch in pipeline:
                batch.task.cancel()
            self._fail_queue(self._failure)
        finally:
            self._idle.set()
            self._room.set()

    def _fill(self, pipeline: deque[_Batch]) -> bool:
        """Start publishing the next batch; False when the current ledger has no room
        (a rollover waits for the pipeline to drain) or nothing was taken."""
        current = self._ledgers[-1]
        assigned = current.entries + sum(len(b.payloads) for b in pipeline)
        assigned_bytes = current.size + sum(b.size for b in pipeline)
        room = self.config.ledger_entries_max - assigned
        if room <= 0 or assigned_bytes >= self.config.ledger_bytes_max or self._aged(current):
            return False
        pendings = self._take(room)
        if not pendings:
            return bool(self._queue)
        expected = (
            pipeline[-1].expected + len(pipeline[-1].payloads) if pipeline else (self._last_seq)
        )
        batch = _Batch(pendings, expected)
        batch.tried.add(batch.batch_id)
        batch.task = asyncio.get_running_loop().create_task(
            self._client.publish_batch(
                self._entries_subject,
                batch.payloads,
                expected_last_seq=expected,
                timeout_s=self._factory.api_timeout_s,
                batch_id=batch.batch_id,
            )
        )
        pipeline.append(batch)
        return True

    def _confirm(self, batch: _Batch) -> None:
        current = self._ledgers[-1]
        first = current.entries
        self._last_seq = batch.expected + len(batch.payloads)
        self._entries_confirmed(current, len(batch.payloads), batch.size)
        self._tail.add(current.ledger_id, first, batch.payloads, batch.size)
        lid = current.ledger_id
        for k, pending in enumerate(batch.pendings):
            if not pending.fut.done():
                pending.fut.set_result(Position(lid, first + k))

    def _fail_queue(self, err: Exception) -> None:
        pendings = [p for b in self._pipeline for p in b.pendings]
        for pending in (*pendings, *self._queue):
            if not pending.fut.done():
                pending.fut.set_exception(err)
                pending.fut.exception()  # retrieved: its appender may be gone
        self._pipeline.clear()
        self._queue.clear()
        self._queued_bytes = 0
        self._wake()

    def _take(self, room: int) -> list[_Pending]:
        """The next batch: queued appends not cancelled, within the ledger and batch bounds."""
        out: list[_Pending] = []
        size = 0
        limit = min(room, BATCH_MESSAGES_MAX)
        queue = self._queue
        while queue and len(out) < limit:
            pending = queue[0]
            n = len(pending.data)
            if out and size + n > limits.STORAGE_GROUP_COMMIT_BYTES_MAX:
                break
            queue.popleft()
            self._queued_bytes -= n
            if pending.fut.cancelled():
                continue
            out.append(pending)
            size += n
        if self._room_waiters:
            self._room.set()
        return out

    async def roll_over_if_due(self) -> bool:
        """Never here: this ledger's writer task owns rollovers (a marker in the stream),
        so an idle ledger past ``ledger_age_ms`` rolls over with its next append instead."""
        return False

    def _aged(self, info: LedgerInfo) -> bool:
        age_ms = (self.clock.monotonic() - self._ledger_created) * 1000
        return info.entries > 0 and age_ms >= self.config.ledger_age_ms

    async def _recover_batch(self, batch: _Batch, err: StorageIOError) -> None:
        """After a failed or unanswered publish: make sure ``batch`` is stored right after
        ``batch.expected`` — read back whether an attempt landed (never trusting
        deduplication), publish again while the stream still ends there, LedgerFenced once
        something else is there."""
        count = len(batch.payloads)
        deadline = self._deadline()
        while True:
            if isinstance(err, StreamNotFound):
                raise LedgerFenced(f"{self.name}: its stream was deleted") from err
            transient = not isinstance(err, ApiError) or _transient(err)
            if not transient and not isinstance(err, WrongLastSequence):
                raise err
            cause = None if isinstance(err, WrongLastSequence) else err
            if await self._landed(batch.expected, count, batch.tried, deadline, cause):
                return
            batch.batch_id = uuid.uuid4().hex[:22]
            batch.tried.add(batch.batch_id)
            try:
                ack = await self._client.publish_batch(
                    self._entries_subject,
                    batch.payloads,
                    expected_last_seq=batch.expected,
                    timeout_s=self._factory.api_timeout_s,
                    batch_id=batch.batch_id,
                )
            except StorageIOError as again:
                err = again
                continue
            if ack.last_seq != batch.expected + count:
                raise StorageIOError(
                    f"{self.name}: batch stored at {ack.last_seq}, expected"
                    f" {batch.expected + count}"
                )
            return

    async def _landed(
        self,
        expected: int,
        count: int,
        tried: set[str],
        deadline: float,
        cause: BaseException | None = None,
    ) -> bool:
        """Did one of our batches land after ``expected``? True if so; False if the stream
        still ends at ``expected`` (safe to publish again: an attempt that lands later makes
        that publish fail, and we look again); LedgerFenced if a message of someone else
        follows ``expected``. Retries through leader elections until ``deadline``.

        The end is read before the message after ``expected``: a stored sequence never
        changes, so "someone else's message is there" is final, whereas "nothing is there
        yet" could turn false at any moment (a delayed commit of our own batch)."""
        if cause is not None:
            await self._backoff(deadline, cause)
        client = self._client
        while True:
            try:
                quick = self._factory.readback_timeout_s
                last = await client.last_seq(self._stream, quick)
                if last == expected:
                    return False
                if last > expected:
                    after = await client.msg_get(self._stream, seq=expected + 1, timeout_s=quick)
                    if after is not None:
                        if after.headers.get("Nats-Batch-Id") not in tried:
                            raise LedgerFenced(f"{self.name}: another owner appended")
                        if last >= expected + count:  # batches are atomic: all of it is there
                            return True
                # A stream behind what it acknowledged, or a batch half applied: ask again.
                await self._backoff(deadline, StorageIOError(f"{self.name}: stream at {last}"))
            except StreamNotFound as err:
                raise LedgerFenced(f"{self.name}: its stream was deleted") from err
            except LedgerFenced:
                raise
            except StorageIOError as err:
                await self._backoff(deadline, err)

    async def _publish_marker(self, subject: str) -> int:
        """A marker right after ``_last_seq`` (rollover, seal), read back on timeouts."""
        client = self._client
        expected = self._last_seq
        deadline = self._deadline()
        payload = _dumps({"owner": self._owner})
        while True:
            try:
                seq = await client.publish_one(
                    subject,
                    payload,
                    expected_last_seq=expected,
                    timeout_s=self._factory.api_timeout_s,
                )
                break
            except StreamNotFound as err:
                raise LedgerFenced(f"{self.name}: its stream was deleted") from err
            except StorageIOError as err:
                if not isinstance(err, WrongLastSequence):
                    await self._backoff(deadline, err)
                found = await self._read_back_marker(expected + 1, subject, deadline)
                if found:
                    seq = expected + 1
                    break
                if isinstance(err, WrongLastSequence):
                    raise LedgerFenced(f"{self.name}: another owner appended") from err
        self._last_seq = seq
        return seq

    async def _read_back_marker(self, seq: int, subject: str, deadline: float) -> bool:
        while True:
            try:
                msg = await self._client.msg_get(
                    self._stream, seq=seq, timeout_s=self._factory.readback_timeout_s
                )
                if msg is not None and msg.subject == subject:
                    return True
                if msg is None:
                    return False
                raise LedgerFenced(f"{self.name}: another owner appended")
            except StreamNotFound as err:
                raise LedgerFenced(f"{self.name}: its stream was deleted") from err
            except LedgerFenced:
                raise
            except StorageIOError as err:
                await self._backoff(deadline, err)

    async def _rollover(self) -> None:
        async with self._meta_lock:
            ledger_id = await self._factory.allocate_ledger_id()
            seq = await self._publish_marker(f"{self._stream}.m.{ledger_id}")
            old = self._ledgers[-1]
            old.closed_ms = self.clock.wall_ms()
            self._first_seq[ledger_id] = seq
            new = LedgerInfo(ledger_id)
            versions = await self._commit(
                [Put(self._path, self._ml_info([*self._ledgers, new]), self._ml_version)]
            )
            self._ml_version = versions[0]
            self._ledgers.append(new)
            self._ids.append(ledger_id)
            self._ledger_created = self.clock.monotonic()

    async def _drain(self) -> None:
        """Wait until everything queued is stored (or failed)."""
        while self._queue or not self._idle.is_set():
            if self._writer is None or self._writer.done():
                return
            await self._idle.wait()

    async def _stop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            self._stopping = True
            self._wakeup.set()
            await asyncio.gather(writer, return_exceptions=True)

    # --- reads ----------------------------------------------------------------------------------

    async def _read_ledger(
        self, info: LedgerInfo, first: int, count: int, max_bytes: int, at_least_one: bool
    ) -> list[bytes]:
        datas = self._tail.get(info.ledger_id, first, count)
        if datas is None:
            seq = self._first_seq[info.ledger_id] + 1 + first
            datas = await self._read_seqs(seq, count, max_bytes, at_least_one, info.ledger_id)
        out: list[bytes] = []
        used = 0
        for data in datas:
            if (out or not at_least_one) and used + len(data) > max_bytes:
                break
            out.append(data)
            used += len(data)
        return out

    async def _read_seqs(
        self, seq: int, count: int, max_bytes: int | None, at_least_one: bool, where: object
    ) -> list[bytes]:
        """Payloads of stream sequences ``seq..`` (a prefix of ``count``): a batch direct
        get from any replica; if that answers nothing (a lagging replica), the leader."""
        client = self._client
        deadline = self._deadline()
        while True:
            try:
                msgs = await client.direct_get(
                    self._stream,
                    seq,
                    count,
                    max_bytes=None if max_bytes is None else max_bytes + count * _HEADER_ALLOWANCE,
                    timeout_s=self._factory.api_timeout_s,
                )
                out: list[bytes] = []
                entries_subject = self._entries_subject
                for k, msg in enumerate(msgs):
                    if msg.seq != seq + k or msg.subject != entries_subject:
                        break
                    out.append(msg.data)
                if out or not at_least_one:
                    return out
                msg1 = await client.msg_get(self._stream, seq=seq)
                if msg1 is None or msg1.subject != self._entries_subject:
                    raise CorruptRecord(
                        f"{self.name} ledger {where}", seq, "entry missing from the stream"
                    )
                return [msg1.data]
            except StreamNotFound as err:
                raise LedgerFenced(f"{self.name}: its stream was deleted") from err
            except CorruptRecord:
                raise
            except StorageIOError as err:
                await self._backoff(deadline, err)

    # --- cursors, trim, terminate, delete, close --------------------------------------------------

    def _cursor_path(self, name: str) -> str:
        return f"{self._path}/cursors/{quote(name, safe='')}"

    async def persist_cursor(self, name: str, data: bytes) -> None:
        if isinstance(self._failure, LedgerFenced):
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
        versions = await self._commit([Put(self._path, self._ml_info(remaining), self._ml_version)])
        self._ml_version = versions[0]
        for info in doomed:
            self._first_seq.pop(info.ledger_id, None)
        keep_from = self._first_seq.get(remaining[0].ledger_id) if remaining else None
        if keep_from is not None:
            try:
                await self._client.purge_below(self._stream, keep_from)
            except ApiError as err:
                if err.err_code != ERR_STREAM_SEALED:
                    raise
                # A terminated ledger's stream is sealed: its bytes go when it is deleted.
            except StorageIOError as err:  # the next trim purges up to its own first ledger
                log.warning("%s: purge below %d failed: %s", self.name, keep_from, err)

    async def _persist_ledger_list(self) -> None:
        [self._ml_version] = await self._commit(
            [Put(self._path, self._ml_info(), self._ml_version)]
        )

    async def _delete_hot_ledger(self, ledger_id: int) -> None:
        """A stream only drops a prefix: purge below the oldest ledger still hot (a cold
        ledger behind a hot one keeps its messages until the older ones go cold too;
        its reads go to the object store already)."""
        keep_from = next((self._first_seq.get(i.ledger_id) for i in self._ledgers if i.hot), None)
        if keep_from is None:
            return
        try:
            await self._client.purge_below(self._stream, keep_from)
        except ApiError as err:
            if err.err_code != ERR_STREAM_SEALED:
                raise
        except StorageIOError as err:  # the next hot deletion or trim purges it
            log.warning("%s: purge below %d failed: %s", self.name, keep_from, err)

    async def terminate(self) -> Position:
        if self._terminated_at is not None:
            return self._terminated_at
        self.check_open()
        self._terminating = True
        await self._drain()
        self.check_open()
        async with self._meta_lock:
            await self._publish_marker(f"{self._stream}.m.{SEALED_MARKER}")
            current = self._ledgers[-1]
            end = self._last_confirmed
            current.closed_ms = self.clock.wall_ms()
            self._terminated_at = end
            try:
                versions = await self._commit([Put(self._path, self._ml_info(), self._ml_version)])
            except BaseException:
                self._terminated_at = None
                current.closed_ms = None
                raise
            self._ml_version = versions[0]
        await self._stop_writer()
        await self._seal_stream()
        self._wake()
        self._room.set()
        return end

    async def _seal_stream(self) -> None:
        """Set the stream's ``sealed`` flag (best effort: the seal marker and the record
        already seal the ledger) and check, on the fresh stream info, that nothing landed
        after our seal marker."""
        try:
            info = await self._client.seal_stream(self._factory.stream_config(self._stream))
        except StorageIOError as err:
            log.warning("%s: could not set the stream's sealed flag: %s", self.name, err)
            return
        last = int(info["state"]["last_seq"])
        if last != self._last_seq:
            log.error(
                "%s: sealed stream ends at %d, our seal marker is at %d",
                self.name,
                last,
                self._last_seq,
            )

    async def delete(self) -> None:
        self.check_readable()
        await self._drain()
        async with self._meta_lock:
            ops: list[Put | Delete | Check] = [Delete(self._path, self._ml_version)]
            ops += [Delete(self._cursor_path(name)) for name in self._cursors]
            for start in range(0, len(ops), limits.METADATA_TXN_OPS_MAX):
                # The first chunk holds the CAS on the record: a fenced owner deletes nothing.
                await self._commit(ops[start : start + limits.METADATA_TXN_OPS_MAX])
        self._mark_closed()
        await self._stop_writer()
        for info in self._ledgers:
            if info.offload is not None:
                await self._delete_offloaded_object(info.offload)
        deadline = self._deadline()
        while True:  # the record is gone: the stream must go too (an unanswered delete
            try:  # may have worked: deleting a missing stream succeeds)
                await self._client.delete_stream(self._stream)
                return
            except StorageIOError as err:
                await self._backoff(deadline, err)

    def _mark_closed(self) -> None:
        super()._mark_closed()
        self._tail.clear()  # its share of the broker's cache budget goes back

    async def close(self) -> None:
        if self._closed:
            return
        try:
            await self._drain()
            if self._failure is None:
                await self._flush_cursors()
        finally:
            self._mark_closed()
            await self._stop_writer()
            self._fail_queue(Closed(f"managed ledger {self.name} is closed"))
            self._room.set()


class JetStreamManagedLedgerFactory:
    """Opens :class:`JetStreamManagedLedger` instances on one NATS connection (made on the
    first ``open``), metadata in ``store``.

    ``prefix`` starts every stream name (several brokers' clusters, or tests, can share a
    NATS cluster); ``replicas`` is the streams' replication factor.
    """

    def __init__(
        self,
        urls: Sequence[str],
        store: MetadataStore,
        *,
        replicas: int = 3,
        prefix: str = "ab",
        clock: Clock | None = None,
        user: str | None = None,
        password: str | None = None,
        token: str | None = None,
        credentials_file: str | None = None,
        tls: ssl.SSLContext | None = None,
        connect_timeout_s: float = 30.0,
        api_timeout_s: float = 5.0,
        append_timeout_s: float = 60.0,
        tail_cache_bytes: int = limits.STORAGE_TAIL_CACHE_BYTES_MAX,
        tail_cache_total_bytes: int = limits.STORAGE_TAIL_CACHE_TOTAL_BYTES,
        pipeline_depth: int = 2,
        readback_timeout_s: float = 1.0,
    ) -> None:
        if not urls:
            raise ValueError("JetStream needs at least one server URL")
        if replicas < 1 or replicas > 5:
            raise ValueError("JetStream replicas must be 1..5")
        if not (prefix.isascii() and prefix.isalnum() and len(prefix) <= 32):
            # No '-': the first '-' of a stream name ends the prefix, so two deployments'
            # prefixes never make the same stream name out of different ledger names.
            raise ValueError(f"stream prefix must be 1-32 of [A-Za-z0-9]: {prefix!r}")
        self.urls = list(urls)
        self.store = store
        self.replicas = replicas
        self.prefix = prefix
        self.clock: Clock = clock or SystemClock()
        self.api_timeout_s = api_timeout_s
        self.append_timeout_s = append_timeout_s
        self.tail_cache_bytes = tail_cache_bytes
        self.tail_budget = TailCacheBudget(tail_cache_total_bytes)
        """What the tail caches of all its ledgers hold together."""
        self.pipeline_depth = max(1, pipeline_depth)
        self.readback_timeout_s = min(readback_timeout_s, api_timeout_s)
        """Requests that poll for a new stream leader after an unanswered publish are
        short, so the first one after the election answers soon (a request sent while
        the stream has no leader waits out its whole timeout)."""
        self._user = user
        self._password = password
        self._token = token
        self._credentials_file = credentials_file
        self._tls = tls
        self._connect_timeout_s = connect_timeout_s
        self._client: JetStreamClient | None = None
        self._connecting = asyncio.Lock()
        self.tiered: TieredStorage | None = None
        """Where offloaded ledgers live (set when an offload driver is configured)."""
        self._connector: asyncio.Task[JetStreamClient] | None = None
        self.start_connect_timeout_s = START_CONNECT_TIMEOUT_S
        self.unavailable_wait_s = UNAVAILABLE_WAIT_S
        self._open: list[JetStreamManagedLedger] = []
        self._closed = False

    def stream_config(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "subjects": [f"{name}.>"],
            "storage": "file",
            "num_replicas": self.replicas,
            "retention": "limits",
            "discard": "old",
            "max_msgs": -1,
            "max_bytes": -1,
            "max_age": 0,
            "max_msg_size": -1,
            "allow_direct": True,
            "allow_atomic": True,
        }

    async def _connect(self, timeout_s: float) -> JetStreamClient:
        return await JetStreamClient.connect(
            self.urls,
            user=self._user,
            password=self._password,
            token=self._token,
            credentials_file=self._credentials_file,
            tls=self._tls,
            connect_timeout_s=timeout_s,
        )

    def _where(self) -> str:
        return ", ".join(redact_url(u) for u in self.urls)

    async def connect_at_start(self) -> None:
        """Connect when the broker starts (what a broker does, not what a library does).

        Refused credentials raise NatsAuthError: they never heal, so the broker does not
        start. Servers that do not answer within ``start_connect_timeout_s`` are logged
        and tried again in the background with backoff; the broker serves meanwhile
        (lookups, admin), topic loads fail with a retriable StorageIOError (clients see
        PersistenceError and retry, as with Pulsar while its bookies are down), and
        topics load as soon as JetStream answers.

        Example::

            async def demo(factory: JetStreamManagedLedgerFactory) -> None:
                await factory.connect_at_start()  # NatsAuthError: wrong credentials
        """
        try:
            self._client = await self._connect(self.start_connect_timeout_s)
        except NatsAuthError:
            raise
        except StorageIOError as err:
            log.warning(
                "NATS JetStream at %s unreachable at start (%s): serving anyway, topics"
                " load once it answers; retrying in the background",
                self._where(),
                err,
            )
            self._connector = asyncio.get_running_loop().create_task(
                self._connect_with_backoff(), name="jetstream-connect"
            )

    async def _connect_with_backoff(self) -> JetStreamClient:
        delay = CONNECT_BACKOFF_MIN_S
        while True:
            try:
                client = await self._connect(CONNECT_ATTEMPT_S)
            except NatsAuthError as err:
                log.critical("%s; no topic can load until the credentials are fixed", err)
                raise
            except StorageIOError as err:
                log.warning(
                    "NATS JetStream at %s still unreachable (%s); next try in %.1fs",
                    self._where(),
                    err,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, CONNECT_BACKOFF_MAX_S)
                continue
            log.info("connected to NATS JetStream at %s", self._where())
            self._client = client
            return client

    async def client(self) -> JetStreamClient:
        """The shared connection: made by :meth:`connect_at_start` or its background retries (a
        topic load waits ``unavailable_wait_s`` for them, then StorageIOError), or on
        first use when ``connect_at_start`` was not called (with retries)."""
        if self._client is not None:
            return self._client
        connector = self._connector
        if connector is not None:
            done, _ = await asyncio.wait((connector,), timeout=self.unavailable_wait_s)
            if not done:
                raise StorageIOError(
                    f"NATS JetStream at {self._where()} unreachable; retrying in the background"
                )
            return connector.result()  # NatsAuthError when the credentials were refused
        async with self._connecting:
            if self._client is None:
                self._client = await self._connect(self._connect_timeout_s)
            return self._client

    async def delete_lost(self, name: str) -> bool:
        """Delete the metadata (record and cursors) of managed ledger ``name`` whose stream
        is gone (deleted behind our back: the ledger can never open again); False, and
        nothing deleted, while the stream exists.

        Example::

            async def demo(factory: JetStreamManagedLedgerFactory) -> None:
                assert not await factory.delete_lost("public/default/persistent/ok")
        """
        client = await self.client()
        try:
            await client.stream_info(stream_name(self.prefix, name))
            return False
        except StreamNotFound:
            pass
        path = JS_MANAGED_LEDGERS_PREFIX + disk_name(name)
        while True:
            page = await self.store.list_prefix(f"{path}/cursors/")
            if not page.records:
                break
            ops: list[Put | Delete | Check] = [Delete(r.path) for r in page.records]
            for start in range(0, len(ops), limits.METADATA_TXN_OPS_MAX):
                await self.store.commit(ops[start : start + limits.METADATA_TXN_OPS_MAX])
        record = await self.store.get(path)
        if record is not None:
            await self.store.commit([Delete(path, record.stat.version)])
        return True

    async def allocate_ledger_id(self) -> int:
        """The next cluster-wide ledger id (CAS on ``/ledger-id-counter``)."""
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
                continue
            return current

    async def open(
        self, name: str, config: ManagedLedgerConfig | None = None
    ) -> JetStreamManagedLedger:
        if self._closed:
            raise Closed("managed ledger factory is closed")
        client = await self.client()
        ml = JetStreamManagedLedger(self, client, name, config or ManagedLedgerConfig())
        ml.tiered = self.tiered
        try:
            await ml._recover()
        except BaseException:
            ml._mark_closed()
            await ml._stop_writer()
            raise
        self._open = [m for m in self._open if not m._closed]
        self._open.append(ml)
        return ml

    async def close(self) -> None:
        self._closed = True
        if self._connector is not None:
            self._connector.cancel()
            await asyncio.gather(self._connector, return_exceptions=True)
            self._connector = None
        errors: list[BaseException] = []
        for ml in self._open:
            try:
                await ml.close()
            except Exception as err:
                errors.append(err)
        self._open.clear()
        if self._client is not None:
            await self._client.close()
            self._client = None
        if errors:
            raise errors[0]


def jetstream_factory(
    config: BrokerConfig, store: MetadataStore, clock: Clock | None = None
) -> JetStreamManagedLedgerFactory:
    """The factory a broker configured with ``storage = "jetstream"`` uses.

    Example:
        >>> from pathlib import Path
        >>> from anabranch.broker.config import BrokerConfig
        >>> from anabranch.metadata.memory import MemoryMetadataStore
        >>> cfg = BrokerConfig(data_dir=Path("/tmp/ab"), storage="jetstream",
        ...                    jetstream_urls=["nats://127.0.0.1:4222"], jetstream_replicas=1)
        >>> jetstream_factory(cfg, MemoryMetadataStore()).replicas
        1
    """
    tls: ssl.SSLContext | None = None
    if config.jetstream_tls_trust_certs_file is not None:
        tls = ssl.create_default_context(cafile=str(config.jetstream_tls_trust_certs_file))
        if config.jetstream_tls_cert_file is not None:
            key = config.jetstream_tls_key_file
            tls.load_cert_chain(
                str(config.jetstream_tls_cert_file), None if key is None else str(key)
            )
    password = config.jetstream_password
    token = config.jetstream_token
    creds = config.jetstream_credentials_file
    return JetStreamManagedLedgerFactory(
        config.jetstream_urls,
        store,
        replicas=config.jetstream_replicas,
        prefix=config.jetstream_stream_prefix,
        clock=clock,
        user=config.jetstream_username,
        password=None if password is None else password.get_secret_value(),
        token=None if token is None else token.get_secret_value(),
        credentials_file=None if creds is None else str(creds),
        tls=tls,
        tail_cache_total_bytes=config.storage_cache_bytes,
    )

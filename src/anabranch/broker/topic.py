"""PersistentTopic: one topic's (or partition's, or segment's) ledger, producers, dedup
state and subscriptions.

Theory of operation
-------------------
* **Publishing.** :meth:`PersistentTopic.publish` is called synchronously, in the order
  SENDs arrive, and returns a future at once: the dedup verdict is taken right there (so
  pipelined sends are judged in order) and a NEW send starts its append through the
  ``TransactionBuffer``. The future resolves with the entry's position once the append is
  durable, with ``DUPLICATE_POSITION`` (-1, -1, upstream's answer) for a duplicate, or
  fails. Appends complete in the order they were started (the ledger's group commit is
  FIFO), so the dedup state only ever moves forward.
* **Dedup durability.** Only *persisted* marks count. Every
  ``DEDUP_SNAPSHOT_INTERVAL_ENTRIES`` appends (and on close) the marks are written to
  ``/dedup-snapshots/<ledger>`` with the position they cover; loading a topic restores
  the snapshot and replays the metadata of every entry after it. The entries themselves
  are the log, so a crash between snapshots loses nothing.
* **Producers and access modes** (upstream's ``AbstractTopic``): the rules of
  :mod:`anabranch.broker.producer_access`, shared with non-persistent topics; a
  terminated topic takes no new producer, and backlog quotas may refuse one.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.protocol.frames import encode_entry
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(topic: PersistentTopic) -> None:
    ...     md = pb.MessageMetadata(producer_name="producer-a", sequence_id=0, publish_time=0)
    ...     entry_bytes = encode_entry(md, b"hello")     # a SEND's message section
    ...     pos = await topic.publish("producer-a", 0, None, entry_bytes, 1)
    ...     assert topic.last_message_id() == pos
    ...     print(pos)
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             name = "persistent://public/default/t"
    ...             await demo(await broker.service.get_topic(name, create=True))
    >>> asyncio.run(main())
    Position(ledger_id=1, entry_id=0)
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from anabranch import failpoints, limits
from anabranch.broker.backlog_quota import QuotaGate
from anabranch.broker.producer_access import ProducerAccess
from anabranch.broker.topic_limits import INTERNAL_SUBSCRIPTION_PREFIX, NO_LIMITS, TopicLimits
from anabranch.clock import Clock
from anabranch.core.dedup import DedupState, DedupVerdict
from anabranch.core.dispatch_rate import DispatchRate, DispatchThrottle
from anabranch.core.inactive_topics import TopicUsage
from anabranch.core.publish_rate import PublishThrottle
from anabranch.core.rate_window import RateWindow
from anabranch.core.subscribe_rate import SubscribeLimiter
from anabranch.errors import (
    Closed,
    InvalidArgument,
    MetadataUnavailable,
    NotOwner,
    StorageIOError,
    TopicTerminated,
    TransactionConflict,
)
from anabranch.metadata.api import MetadataStore, Put
from anabranch.metadata.ownership_fence import OwnershipFence, commit_fenced
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import MAGIC_CHECKSUM
from anabranch.storage.api import EARLIEST, Position
from anabranch.transactions.buffer import NoTransactionBuffer, TransactionBuffer
from anabranch.transactions.ids import TxnId

if TYPE_CHECKING:
    from anabranch.broker.producer import Producer
    from anabranch.storage.api import ManagedLedger

log = logging.getLogger(__name__)

DUPLICATE_POSITION = Position(-1, -1)
"""What a duplicate send is acknowledged with (upstream answers (-1, -1))."""

DEDUP_SNAPSHOTS_PREFIX = "/dedup-snapshots/"
NEVER_COMPACTED = {
    "lastCompactionRemovedEventCount": 0,
    "lastCompactionSucceedTimestamp": 0,
    "lastCompactionFailedTimestamp": 0,
    "lastCompactionDurationTimeInMills": 0,
}
"""The ``compaction`` stats of a topic no compaction ran on here (upstream's zeros)."""

_U16 = struct.Struct(">H")
_I32 = struct.Struct(">i")

_Send = tuple["asyncio.Future[Position]", str, int, bytes, int, "TxnId | None", int, "str | None"]
"""A judged send waiting for its append: (future, producer, last sequence id, entry,
message count, transaction, the producer's send generation when it was judged, the role
the transaction must be owned by: ``Authorizer.txn_role``)."""


def entry_metadata(entry: bytes) -> pb.MessageMetadata:
    """The MessageMetadata of a stored entry (see ``Frame.entry``).

    Example:
        >>> from anabranch.protocol.frames import encode_entry
        >>> md = pb.MessageMetadata(producer_name="p", sequence_id=4, publish_time=0)
        >>> entry_metadata(encode_entry(md, b"x")).sequence_id
        4
    """
    offset = 0
    if len(entry) >= 6 and _U16.unpack_from(entry, 0)[0] == MAGIC_CHECKSUM:
        offset = 6
    (size,) = _I32.unpack_from(entry, offset)
    metadata = pb.MessageMetadata()
    metadata.ParseFromString(entry[offset + 4 : offset + 4 + size])
    return metadata


def last_sequence_id(sequence_id: int, num_messages: int, highest: int | None) -> int:
    """The last sequence id a send covers: a batch numbers its messages consecutively
    from ``sequence_id`` (the official clients resume after ``first + count - 1``).

    Example:
        >>> last_sequence_id(10, 5, None), last_sequence_id(10, 1, 12)
        (14, 12)
    """
    last = sequence_id + max(num_messages, 1) - 1
    return max(last, highest) if highest is not None else last


class PersistentTopic(ProducerAccess):
    """One topic's state on this broker (see the module docstring)."""

    def __init__(
        self,
        name: str,
        ledger: ManagedLedger,
        *,
        store: MetadataStore,
        clock: Clock,
        dedup_enabled: bool = False,
        transaction_buffer: TransactionBuffer | None = None,
        quota_hold_max_s: float = 30.0,
    ) -> None:
        self.name = name
        self.ledger = ledger
        self.store = store
        self.clock = clock
        self.transaction_buffer: TransactionBuffer = transaction_buffer or NoTransactionBuffer(
            ledger
        )
        self.subscriptions: dict[str, Any] = {}
        self.pending_ack_factory: Callable[[Any], Any] | None = None
        """Makes a durable subscription's PendingAckStore (set when transactions are on)."""
        self.producers: dict[str, Producer] = {}
        self.on_drained: Callable[[str, str], None] | None = None
        """``(topic, subscription)``: a sealed topic's subscription has acknowledged
        everything (a scalable segment's controller hands out its children on that)."""
        self.on_storage_failure: Callable[[PersistentTopic], None] | None = None
        """An append failed on the disk: the managed ledger refuses every later append
        until it is opened again, so the broker unloads the topic (its clients reconnect,
        the reload recovers the ledger and they resend)."""
        self.dedup: DedupState | None = DedupState() if dedup_enabled else None
        self.topic_epoch = 0
        self.quota = QuotaGate(name, clock, quota_hold_max_s)
        """Refuses or holds producers while the backlog is over quota (the sweep sets it)."""
        self._subscribing: set[str] = set()
        """Subscriptions being created (they count against the topic's cap)."""
        self.last_in_use_s = clock.monotonic()
        """When the topic was last seen in use (:meth:`touch`; the inactive-topic sweep)."""
        self.publish_throttle: PublishThrottle | None = None
        """The buckets of the topic's publish rate; None: no limit (publish_throttling.py)."""
        self.dispatch_throttle: DispatchThrottle | None = None
        """The buckets of the topic's dispatch rate, shared by its subscriptions; None: no
        limit (dispatch_throttling.py)."""
        self.subscription_dispatch_rate = DispatchRate()
        """Each subscription's own dispatch rate (new subscriptions take it up)."""
        self.subscribe_limiter: SubscribeLimiter | None = None
        """How often each consumer may subscribe; None: no limit (subscribe_throttling.py)."""
        self.compaction: Any = None
        """The topic's ``broker.compaction.TopicCompaction`` once compaction was used."""
        self._exclusive: str | None = None
        self._waiting: deque[tuple[Producer, asyncio.Future[None]]] = deque()
        self._inflight: set[asyncio.Task[None]] = set()
        self._group: list[_Send] | None = None
        """Sends judged in this loop iteration, appended together at its end."""
        self._last_append: asyncio.Future[Position] | None = None
        self._issuing: asyncio.Future[None] | None = None
        """Resolved once the last group that had to wait before appending issued its
        appends; a later group waits for it (see ``_start_group``)."""
        self._send_generation: dict[str, int] = {}
        """Bumped when a send of the producer failed: its sends judged before that and not
        yet stored fail too (the client resends them, in order; see ``_note_failed``)."""
        self._refusing: set[str] = set()
        """Attached producers whose send failed: their later sends are refused until the
        producer detaches or attaches again (the client reconnects to resend)."""
        self._since_snapshot = 0
        self._snapshot_task: asyncio.Task[None] | None = None
        self._closing = False
        self.ownership_fence: OwnershipFence | None = None
        """In a cluster, this broker's claim on the topic: the dedup snapshot carries it, so
        a broker that lost the topic while paused cannot overwrite the new owner's."""
        # Plain counters; rates are derived in stats().
        self.msg_in_counter = 0
        self.bytes_in_counter = 0
        self.msg_out_counter = 0
        self.bytes_out_counter = 0
        self.dispatch_read_failures = 0
        """Dispatch passes of any subscription whose read failed (each one is retried)."""
        self._rates = RateWindow(limits.STATS_RATE_WINDOW_MIN_S, clock.monotonic(), (0, 0, 0, 0))

    # --- loading --------------------------------------------------------------------------

    @property
    def _snapshot_path(self) -> str:
        return DEDUP_SNAPSHOTS_PREFIX + quote(self.ledger.name, safe="")

    async def load(self) -> None:
        """Restore the dedup state and the durable subscriptions after opening."""
        if self.dedup is not None:
            await self._restore_dedup()
        await self._load_subscriptions()

    async def _restore_dedup(self) -> None:
        record = await self.store.get(self._snapshot_path)
        start = EARLIEST
        if record is not None:
            data = json.loads(record.value)
            self.dedup = DedupState.restore(data["producers"])
            start = Position(*data["position"]).next()
        assert self.dedup is not None
        replayed = 0
        while True:
            entries = await self.ledger.read(start, max_entries=1000)
            if not entries:
                break
            for entry in entries:
                self._replay(entry.data)
            replayed += len(entries)
            start = entries[-1].position.next()
        if replayed:
            log.info("%s: dedup state rebuilt from %d tail entries", self.name, replayed)

    def seed_dedup(self, parent_marks: Iterable[Mapping[str, int]]) -> None:
        """A scalable topic's child segment: treat every sequence id a parent persisted as
        persisted here too, so a producer's retry of it after a split is a duplicate.
        Nothing when deduplication is off.

        Example:
            >>> # topic.seed_dedup([{"producer-a": 41}]) -> a send of 41 answers (-1, -1)
        """
        if self.dedup is None or failpoints.enabled(failpoints.DROP_DEDUP_CARRY):
            return  # (the failpoint is the drop-dedup-carry seeded bug of the fault harness)
        for marks in parent_marks:
            for producer, sequence_id in marks.items():
                if sequence_id >= 0:
                    self.dedup.on_persisted(producer, sequence_id)

    def _replay(self, data: bytes) -> None:
        assert self.dedup is not None
        try:
            md = entry_metadata(data)
            highest = md.highest_sequence_id if md.HasField("highest_sequence_id") else None
            last = last_sequence_id(md.sequence_id, md.num_messages_in_batch, highest)
            if md.producer_name:
                self.dedup.on_persisted(md.producer_name, last)
        except (InvalidArgument, struct.error, ValueError) as err:
            log.warning("%s: entry without usable metadata skipped in replay: %s", self.name, err)

    async def _load_subscriptions(self) -> None:
        try:
            from anabranch.broker.subscription import Subscription
        except ImportError:
            return  # consumption not built yet: cursors stay on disk untouched
        for cursor in self.ledger.cursors():
            if cursor.name not in self.subscriptions:
                sub = Subscription(
                    self, cursor.name, pb.CommandSubscribe.Exclusive, cursor, clock=self.clock
                )
                await sub.recover()
                self.subscriptions[cursor.name] = sub

    # --- producers ------------------------------------------------------------------------

    def add_producer(
        self, producer: Producer, caps: TopicLimits = NO_LIMITS
    ) -> asyncio.Future[None] | None:
        """Admit ``producer`` under its access mode and ``caps``; a future when it must
        wait (WaitForExclusive), else None. Raises ProducerBusy/ProducerFenced/
        TopicTerminated (sealed) or Closed (closing: retriable)."""
        if not self._may_resend_here(producer.name):
            self._check_writable()
        self.quota.check_producer()
        waiting = self._admit(producer, caps)
        self._refusing.discard(producer.name)
        return waiting

    def remove_producer(self, producer: Producer) -> None:
        """Forget ``producer`` (closed or disconnected); hand exclusivity to a waiter."""
        if self._release(producer):
            self._refusing.discard(producer.name)
        self.touch()

    # --- use (core/inactive_topics.py) ------------------------------------------------------

    def touch(self) -> None:
        """The topic was in use until now (a producer or consumer just left, a
        subscription was removed): an inactivity period starts here, not earlier."""
        self.last_in_use_s = self.clock.monotonic()

    def usage(self) -> TopicUsage:
        """What the topic has now, internal subscriptions left out."""
        subs = [
            s
            for n, s in self.subscriptions.items()
            if not n.startswith(INTERNAL_SUBSCRIPTION_PREFIX)
        ]
        backlog = sum(
            c.backlog()
            for c in self.ledger.cursors()
            if not c.name.startswith(INTERNAL_SUBSCRIPTION_PREFIX)
        )
        return TopicUsage(
            producers=len(self.producers) + len(self._waiting),
            consumers=sum(len(s.consumers) for s in subs),
            subscriptions=len(subs),
            backlog=backlog,
            open_transactions=self.transaction_buffer.open_count(),
        )

    # --- publishing -----------------------------------------------------------------------

    def _may_resend_here(self, producer_name: str) -> bool:
        """A producer this sealed topic holds messages of may attach: its resends after a
        lost receipt are then answered as duplicates instead of being re-routed by a
        scalable producer to a child segment (and stored twice); its new sends still get
        TopicTerminated."""
        return (
            self.ledger.is_terminated
            and not self._closing
            and self.dedup is not None
            and self.dedup.last_persisted(producer_name) >= 0
        )

    def _check_writable(self) -> None:
        if self.ledger.is_terminated:
            raise TopicTerminated(f"{self.name} is terminated")
        if self._closing:
            # Closing is not sealed (an unload, a lost ownership): a retriable answer
            # makes the client reconnect and resend everything pending in order. Told
            # "terminated", a scalable producer would hold this message for a child
            # while the segment, reloaded, stores the later ones: the key's order breaks.
            raise Closed(f"{self.name} is closing")

    def last_sequence_id(self, producer_name: str) -> int:
        """The producer's last persisted sequence id, -1 if none or dedup is off."""
        return -1 if self.dedup is None else self.dedup.last_persisted(producer_name)

    def publish(
        self,
        producer_name: str,
        sequence_id: int,
        highest_sequence_id: int | None,
        entry: bytes,
        num_messages: int,
        *,
        txn: TxnId | None = None,
        role: str | None = None,
    ) -> asyncio.Future[Position]:
        """Judge and start storing one SEND (see the module docstring); call in the order
        the SENDs arrived. Raises TopicTerminated/InvalidArgument synchronously. A send in
        transaction ``txn`` goes through the transaction buffer (op record first), refused
        unless ``role`` may write in it (``Authorizer.txn_role``; None: any).

        Sends published in one loop iteration (e.g. every SEND of one socket read) are
        stored with one ``append_many`` by one task: no task per send.

        While the backlog is over a producer-blocking quota (:attr:`quota`) the send is
        refused (ProducerBlockedQuotaExceeded) or held and judged when released, in order."""
        if self.quota.blocked is not None or self.quota.held:
            held = self.quota.admit(
                lambda: self._publish(
                    producer_name,
                    sequence_id,
                    highest_sequence_id,
                    entry,
                    num_messages,
                    txn=txn,
                    role=role,
                )
            )
            if held is not None:
                return held
        return self._publish(
            producer_name, sequence_id, highest_sequence_id, entry, num_messages, txn=txn, role=role
        )

    def _publish(
        self,
        producer_name: str,
        sequence_id: int,
        highest_sequence_id: int | None,
        entry: bytes,
        num_messages: int,
        *,
        txn: TxnId | None = None,
        role: str | None = None,
    ) -> asyncio.Future[Position]:
        last = last_sequence_id(sequence_id, num_messages, highest_sequence_id)
        # A resend of what the sealed ledger already holds (its receipt was lost with a
        # connection) is answered as a duplicate: told "terminated", a scalable producer
        # would re-route it to a child under a fresh sequence id, and it would be stored
        # twice.
        terminated = self.ledger.is_terminated
        if (
            terminated
            and self.dedup is not None
            and last <= self.dedup.last_persisted(producer_name)
        ):
            return _resolved(DUPLICATE_POSITION)
        self._check_writable()
        if producer_name in self._refusing:
            # An earlier send of this producer failed: the client resends once it
            # reconnects; storing this one first would leave a gap that dedup would then
            # answer as a duplicate (a silent loss). See ``_note_failed``.
            raise _earlier_send_failed(producer_name)
        if self.dedup is not None:
            verdict = self.dedup.admit(producer_name, sequence_id, last)
            if verdict is DedupVerdict.DUPLICATE:
                return _resolved(DUPLICATE_POSITION)
            if verdict is DedupVerdict.IN_FLIGHT:
                return asyncio.ensure_future(self._after_inflight(producer_name, sequence_id))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Position] = loop.create_future()
        group = self._group
        if group is None:
            group = self._group = []
            loop.call_soon(self._start_group)
        generation = self._send_generation.get(producer_name, 0)
        group.append((fut, producer_name, last, entry, num_messages, txn, generation, role))
        self._last_append = fut
        return fut

    def _start_group(self) -> None:
        group, self._group = self._group, None
        if not group:
            return
        # Entries reach the ledger in send order across groups too: a group that may
        # wait before it appends (a transaction's op record goes to the metadata store
        # first) holds every later group until its own appends are issued, or a later
        # send of the same producer would be stored first (and the earlier one, failing
        # after that, would be judged a duplicate on retry: lost).
        after = self._issuing if self._issuing is not None and not self._issuing.done() else None
        issued = None
        if after is not None or any(send[5] is not None for send in group):
            issued = self._issuing = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._append_group(group, after, issued))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _after_inflight(self, producer_name: str, sequence_id: int) -> Position:
        # A retry of a send still being written: answer once that write has ended.
        if self._last_append is not None:
            await asyncio.wait([self._last_append])
        if self.last_sequence_id(producer_name) >= sequence_id:
            return DUPLICATE_POSITION
        raise Closed(f"the earlier write of sequence id {sequence_id} failed; retry")

    async def _append_entries(
        self,
        group: list[_Send],
        after: asyncio.Future[None] | None,
        issued: asyncio.Future[None] | None,
    ) -> list[Position | Exception]:
        """Each send's position or error. ``after``: the previous group's appends must be
        issued first; ``issued``: resolved once this group's are (later groups wait)."""
        if after is not None:
            await asyncio.wait([after])
        if issued is None:
            # Plain sends with nothing ahead: the ledger call is issued right here.
            if len(group) == 1:
                return [await self.ledger.append(group[0][3])]
            return list(await self.ledger.append_many([send[3] for send in group]))
        # Runs of consecutive sends of one transaction (or of plain sends) share a group
        # commit. Every transaction joins first (its op record); a refused join fails its
        # run. Then all runs are issued in order without a wait between them (the buffer's
        # append of a joined transaction reaches the ledger before suspending).
        runs: list[tuple[TxnId | None, list[int]]] = []
        for index, send in enumerate(group):
            if runs and runs[-1][0] == send[5]:
                runs[-1][1].append(index)
            else:
                runs.append((send[5], [index]))
        results: list[Position | Exception | None] = [None] * len(group)
        for txn, indices in runs:
            if txn is None:
                continue
            by_role: dict[str | None, list[int]] = {}
            for index in indices:
                by_role.setdefault(group[index][7], []).append(index)
            for role, sends in by_role.items():
                try:
                    await self.transaction_buffer.prepare(txn, role)
                except Exception as err:
                    self._fail_sends(group, sends, err, results)
        async with asyncio.TaskGroup() as runs_group:
            for txn, indices in runs:
                runs_group.create_task(self._append_run(group, txn, indices, results))
            # The tasks take their first step (the ledger call) before a group waiting on
            # ``issued`` resumes: the loop runs ready callbacks in FIFO order.
            issued.set_result(None)
        done = [result for result in results if result is not None]
        assert len(done) == len(group)
        return done

    async def _append_run(
        self,
        group: list[_Send],
        txn: TxnId | None,
        indices: list[int],
        results: list[Position | Exception | None],
    ) -> None:
        """Append one run of ``group`` (its sends at ``indices``), filling ``results``.
        Sends of a producer whose earlier send failed since they were judged fail with a
        retriable Closed, unstored (see ``_note_failed``)."""
        live = []
        for index in indices:
            if results[index] is not None:
                continue
            send = group[index]
            if self._send_generation.get(send[1], 0) != send[6]:
                results[index] = _earlier_send_failed(send[1])
            else:
                live.append(index)
        if not live:
            return
        entries = [group[index][3] for index in live]
        try:
            if txn is None:
                positions = await self.ledger.append_many(entries)
            else:
                positions = await self.transaction_buffer.append_many(txn, entries)
        except Exception as err:
            self._fail_sends(group, live, err, results)
            return
        for index, position in zip(live, positions, strict=True):
            results[index] = position

    def _fail_sends(
        self,
        group: list[_Send],
        indices: list[int],
        err: Exception,
        results: list[Position | Exception | None],
    ) -> None:
        """Fail the sends at ``indices`` with ``err`` (see :meth:`_note_failed`)."""
        for index in indices:
            results[index] = err
            self._note_failed(group[index][1], err)

    def _note_failed(self, producer_name: str, err: BaseException) -> None:
        """A send of ``producer_name`` failed with ``err``: every later send of the
        producer fails too (those judged already and those still to come, until it
        attaches again), with a retriable Closed. A client resends after a retriable
        error, and the official clients after any error but a checksum or terminated one,
        reconnecting and resending from that send on, in order: had a later send been
        stored first, dedup would answer the resent earlier one as a duplicate
        (acknowledged, never stored). Our client, told a final error, fails that send
        alone and resends the later ones once it reconnects.

        Not after TransactionConflict: that transaction is over, the message can never be
        part of it, so the connection goes on (a late send of an aborted transaction is
        common; upstream answers the same)."""
        if isinstance(err, TransactionConflict):
            return
        if producer_name not in self.producers or producer_name in self._refusing:
            return  # detached (nothing more comes from it), or noted already
        if len(self._send_generation) >= limits.DEDUP_PRODUCERS_MAX:
            self._send_generation.clear()  # bounded; a reset only fails more sends
        self._send_generation[producer_name] = self._send_generation.get(producer_name, 0) + 1
        self._refusing.add(producer_name)

    async def _append_group(
        self,
        group: list[_Send],
        after: asyncio.Future[None] | None = None,
        issued: asyncio.Future[None] | None = None,
    ) -> None:
        """Store a group of judged sends in order; resolve their futures in order."""
        try:
            results = await self._append_entries(group, after, issued)
        except BaseException as err:
            if isinstance(err, StorageIOError) and self.on_storage_failure is not None:
                self.on_storage_failure(self)
            for fut, producer_name, *_ in group:
                self._note_failed(producer_name, err)
                if self.dedup is not None:
                    self.dedup.on_failed(producer_name)
                if fut.done():
                    continue
                if isinstance(err, asyncio.CancelledError):
                    fut.cancel()
                else:
                    fut.set_exception(err)
            if not isinstance(err, Exception):
                raise
            return
        finally:
            if issued is not None and not issued.done():
                issued.set_result(None)
        dedup = self.dedup
        storage_failed = False
        for send, result in zip(group, results, strict=True):
            fut, producer_name, last, entry, count, *_ = send
            if isinstance(result, Exception):
                storage_failed = storage_failed or isinstance(result, StorageIOError)
                self._note_failed(producer_name, result)
                if dedup is not None:
                    dedup.on_failed(producer_name)
                if not fut.done():
                    fut.set_exception(result)
                continue
            self.msg_in_counter += count if count > 1 else 1
            self.bytes_in_counter += len(entry)
            if dedup is not None:
                dedup.on_persisted(producer_name, last)
                self._since_snapshot += 1
                if self._since_snapshot >= limits.DEDUP_SNAPSHOT_INTERVAL_ENTRIES:
                    self._schedule_snapshot(result)
            if not fut.done():
                fut.set_result(result)
        if storage_failed and self.on_storage_failure is not None:
            self.on_storage_failure(self)
        self._notify_subscriptions()

    def transaction_state_changed(self) -> None:
        """The transaction buffer moved max_read_position or aborted entries: readers
        may deliver (or skip) more now."""
        self._notify_subscriptions()

    def _notify_subscriptions(self) -> None:
        for sub in list(self.subscriptions.values()):
            notify: Callable[[], object] | None = getattr(sub, "notify_new_entries", None)
            if notify is not None:
                try:
                    notify()
                except Exception:
                    log.exception("%s: subscription notify failed", self.name)

    def _schedule_snapshot(self, position: Position) -> None:
        if self._snapshot_task is not None and not self._snapshot_task.done():
            return  # one at a time; the next append past the interval tries again
        self._since_snapshot = 0
        assert self.dedup is not None
        data = json.dumps({"position": list(position), "producers": self.dedup.snapshot()})
        self._snapshot_task = asyncio.ensure_future(self._write_snapshot(data.encode()))

    async def _write_snapshot(self, data: bytes) -> None:
        try:
            await commit_fenced(self.store, [Put(self._snapshot_path, data)], self.ownership_fence)
        except NotOwner:
            log.warning("%s: dedup snapshot not written: another broker owns the topic", self.name)
        except MetadataUnavailable as err:
            # The store out of reach for a moment: expected under faults, no traceback.
            log.warning("%s: dedup snapshot deferred (tail replay covers it): %s", self.name, err)
        except Exception:
            log.exception("%s: dedup snapshot not written (the tail replay covers it)", self.name)

    async def wait_inflight(self) -> None:
        """Wait until every append started so far has ended (successfully or not)."""
        self._start_group()  # sends judged in this iteration start now
        if self._inflight:
            await asyncio.wait(list(self._inflight))

    # --- subscriptions --------------------------------------------------------------------

    async def get_or_create_subscription(
        self,
        name: str,
        sub_type: int,
        initial_position: Position,
        *,
        replicated: bool = False,
        caps: TopicLimits = NO_LIMITS,
    ) -> Any:
        """The named subscription, created over a (new or restored) cursor; a new one only
        within ``caps`` (NotAllowed past it)."""
        sub = self.subscriptions.get(name)
        if sub is not None:
            return sub
        # Names being created count too: concurrent subscribes cannot all take the last place.
        caps.check_new_subscription(
            self.name, name, existing=self.subscriptions.keys() | self._subscribing
        )
        claimed = name not in self._subscribing
        self._subscribing.add(name)
        try:
            return await self._create_subscription(name, sub_type, initial_position)
        finally:
            if claimed:
                self._subscribing.discard(name)

    async def _create_subscription(
        self, name: str, sub_type: int, initial_position: Position
    ) -> Any:
        from anabranch.broker.subscription import Subscription

        cursor = await self.ledger.open_cursor(name, initial_position)
        sub = self.subscriptions.get(name)  # another subscribe may have won meanwhile
        if sub is None:
            sub = Subscription(self, name, sub_type, cursor, clock=self.clock)
            await sub.recover()
            existing = self.subscriptions.get(name)
            if existing is not None or self._closing:  # won meanwhile, or unloaded
                await sub.pending_acks.close()
                if existing is None:
                    # close() has closed the subscriptions it saw: one added now would
                    # dispatch from a closed ledger forever. The client retries.
                    raise Closed(f"{self.name} is closing")
                return existing
            self.subscriptions[name] = sub
        return sub

    async def remove_subscription(self, name: str) -> None:
        """Drop a subscription and its cursor."""
        sub = self.subscriptions.pop(name, None)
        if sub is not None:
            await sub.close()
        await self.ledger.delete_cursor(name)
        self.touch()

    # --- state ----------------------------------------------------------------------------

    def last_message_id(self) -> Position:
        """The last durable entry's position (EARLIEST when empty)."""
        return self.ledger.last_confirmed

    async def terminate(self) -> Position:
        """Seal the topic: later sends fail with TopicTerminatedError."""
        position = await self.ledger.terminate()
        self._notify_subscriptions()
        return position

    def stats(self) -> dict[str, Any]:
        """Pulsar-admin-like topic stats."""
        now = self.clock.monotonic()
        counters = (
            self.msg_in_counter, self.bytes_in_counter, self.msg_out_counter,
            self.bytes_out_counter,
        )  # fmt: skip
        rate_in, throughput_in, rate_out, throughput_out = self._rates.rates(now, counters)
        subs: dict[str, Any] = {}
        for name, sub in self.subscriptions.items():
            stats = getattr(sub, "stats", None)
            subs[name] = stats() if stats is not None else {}
        last = self.ledger.last_confirmed
        storage = sum(getattr(i, "size", 0) for i in getattr(self.ledger, "ledgers", []))
        entries = self.ledger.entry_count
        backlog = max((c.backlog() for c in self.ledger.cursors()), default=0)
        return {
            "msgRateIn": rate_in,
            "msgThroughputIn": throughput_in,
            "msgRateOut": rate_out,
            "msgThroughputOut": throughput_out,
            "msgInCounter": self.msg_in_counter,
            "bytesInCounter": self.bytes_in_counter,
            "msgOutCounter": self.msg_out_counter,
            "bytesOutCounter": self.bytes_out_counter,
            "storageSize": storage,
            "entryCount": entries,
            # Pulsar's backlogSize is bytes: the slowest cursor's entries at the average
            # stored entry size (the ledgers record sizes, not each entry's).
            "backlogSize": storage * backlog // entries if entries else 0,
            "backlogEntries": backlog,
            "lastMessageId": f"{last.ledger_id}:{last.entry_id}",
            "publishers": [p.stats() for p in self.producers.values()],
            "subscriptions": subs,
            "deduplicationEnabled": self.dedup is not None,
            "topicEpoch": self.topic_epoch,
            "terminated": self.ledger.is_terminated,
            "compaction": (
                self.compaction.stats() if self.compaction is not None else dict(NEVER_COMPACTED)
            ),
        }

    async def close(self) -> None:
        """Stop accepting sends, wait for in-flight appends, persist the dedup snapshot,
        close subscriptions and the ledger."""
        if self._closing:
            return
        self._closing = True
        for _, fut in self._waiting:
            if not fut.done():
                fut.set_exception(Closed(f"{self.name} is closing"))
        self._waiting.clear()
        await self.quota.close()
        if self.compaction is not None:
            await self.compaction.close()
        await self.wait_inflight()
        if self._snapshot_task is not None:
            await asyncio.wait([self._snapshot_task])
        if self.dedup is not None and self.ledger.last_confirmed != EARLIEST:
            data = {
                "position": list(self.ledger.last_confirmed),
                "producers": self.dedup.snapshot(),
            }
            await self._write_snapshot(json.dumps(data).encode())
        for sub in list(self.subscriptions.values()):
            try:
                await sub.close()
            except Exception:
                log.exception("%s: closing a subscription failed", self.name)
        for producer in list(self.producers.values()):
            producer.detach()
        await self.transaction_buffer.close()
        await self.ledger.close()


def _earlier_send_failed(producer_name: str) -> Closed:
    return Closed(f"an earlier send of producer {producer_name} failed; resend")


def _resolved(position: Position) -> asyncio.Future[Position]:
    fut: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
    fut.set_result(position)
    return fut

"""Dispatchers: which consumer of a subscription gets which entry, and when.

Theory of operation. Each subscription has one dispatcher and one read loop (an asyncio
task started with the first consumer). A pass of the loop (1) hands out entries waiting
for redelivery (the *replay* set), then (2) reads new entries from ``read_position`` —
never past ``transaction_buffer.max_read_position()``, at most the permits available and
``DISPATCH_READ_ENTRIES_MAX`` — skipping entries that are acknowledged, aborted, or held
by a transactional ack, and hands them out. With nothing to do it sleeps until *kicked*
(FLOW, ack, new consumer, ``notify_new_entries()``), until the ledger grows, or until the
next delayed message is due. Every await is followed by a check of ``generation``: a
rewind or seek bumps it, and a pass that read before the bump drops what it read.

Types (upstream ``PersistentDispatcherSingleActiveConsumer`` /
``PersistentDispatcherMultipleConsumers`` / ``PersistentStickyKeyDispatcherMultipleConsumers``):

- Exclusive / Failover (:class:`SingleActiveDispatcher`): one active consumer gets every
  entry in order. Redelivery and an active-consumer change *rewind* to the cursor's first
  unacknowledged entry (upstream's ``cursor.rewind()``), which keeps order.
- Shared (:class:`SharedDispatcher`): round-robin over the highest-priority consumers with
  permits; a closed consumer's or a nacked entry goes to the replay set; entries with
  ``deliver_at_time`` in the future are held until due (delayed delivery).
- Key_Shared (``dispatcher_key_shared.KeySharedDispatcher``): the entry's key hash picks
  the consumer (a mixed-key batch is split by message); see that module for the per-key
  ordering rule. Delayed entries are held as in Shared.

Example (two Shared consumers take turns):
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.broker.consumer import Consumer, FakeWriter
    >>> from anabranch.broker.subscription import Subscription
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.protocol.frames import encode_entry
    >>> from anabranch.storage.api import EARLIEST
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(sub: Subscription) -> None:
    ...     dispatcher = SharedDispatcher(sub)
    ...     a, b = (Consumer(FakeWriter(), i, name, SubType.Shared) for i, name in enumerate("ab"))
    ...     for consumer in (a, b):
    ...         dispatcher.add_consumer(consumer)
    ...         consumer.add_permits(10); dispatcher.kick()     # FLOW
    ...     dispatcher.start()
    ...     while len(a.session.written) + len(b.session.written) < 4:
    ...         await asyncio.sleep(0.01)
    ...     for consumer in (a, b):
    ...         ids = [w.message.message_id.entryId for w in consumer.session.written]
    ...         print(consumer.name, ids)
    ...     await dispatcher.close()
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             topic = await broker.service.get_topic("persistent://public/default/t",
    ...                                                    create=True)
    ...             md = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=0)
    ...             for payload in (b"1", b"2", b"3", b"4"):
    ...                 await topic.ledger.append(encode_entry(md, payload))
    ...             cursor = await topic.ledger.open_cursor("billing", EARLIEST)
    ...             await demo(Subscription(topic, "billing", SubType.Shared, cursor,
    ...                                     clock=SystemClock()))
    >>> asyncio.run(main())
    a [0, 2]
    b [1, 3]
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import mmh3

from anabranch import failpoints, limits
from anabranch.broker.consumer import Consumer, PendingEntry
from anabranch.broker.dispatcher_entries import EntryInfo, acked_to_wire, entry_info, merge_acked
from anabranch.client.backoff import Backoff
from anabranch.core.unacked_gate import UnackedGate
from anabranch.errors import Closed, ConsumerBusy, StorageIOError
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import Entry, Position

if TYPE_CHECKING:
    from anabranch.broker.subscription import Subscription
    from anabranch.broker.topic_limits import TopicLimits

log = logging.getLogger(__name__)

SubType = pb.CommandSubscribe
READ_RETRY_DELAYS_KEPT = 16
"""Waits of a failure streak remembered (the schedule is capped well before that)."""
FAILOVER_HASH_REPLICAS = 100
"""Points per consumer on the Failover hash ring of a non-partitioned topic (upstream's
CONSUMER_CONSISTENT_HASH_REPLICAS)."""


def check_read_fault() -> None:
    """Raise the ``dispatch-read-fails`` failpoint's storage error when it is on."""
    if failpoints.enabled(failpoints.DISPATCH_READ_FAILS):
        raise StorageIOError("failpoint: the dispatcher's ledger read fails")


def murmur_positive(data: bytes) -> int:
    """Upstream ``Murmur3_32Hash.makeHash``: the unsigned hash masked to 31 bits."""
    return mmh3.hash(data, 0, signed=False) & 0x7FFFFFFF


def choose_active(consumers: Sequence[Consumer], partition: int, topic_name: str) -> Consumer:
    """The active consumer of an Exclusive/Failover subscription, as upstream picks it: of
    the best (lowest) priority level sorted by name, index ``partition % n`` on a
    partition, else the one a consistent-hash ring of their names gives for the topic
    name's hash. ``consumers`` must not be empty.

    Example:
        >>> from anabranch.broker.consumer import FakeWriter
        >>> a, b = (Consumer(FakeWriter(), i, n, 1) for i, n in ((1, "a"), (2, "b")))
        >>> choose_active([b, a], 1, "persistent://t/ns/x-partition-1").name
        'b'
    """
    ranked = sorted(consumers, key=lambda c: (c.priority, c.name))
    top = sum(1 for c in ranked if c.priority == ranked[0].priority)
    if partition >= 0:
        return ranked[partition % top]
    ring: dict[int, int] = {}
    for i in range(top):
        for j in range(FAILOVER_HASH_REPLICAS):
            ring[murmur_positive(f"{ranked[i].name}{j}".encode())] = i
    point = murmur_positive(topic_name.encode())
    keys = sorted(ring)
    for key in keys:
        if key >= point:
            return ranked[ring[key]]
    return ranked[ring[keys[0]]]


def round_robin(
    consumers: Sequence[Consumer], start: int, available: Callable[[Consumer], bool]
) -> tuple[Consumer | None, int]:
    """Shared dispatch's choice: from index ``start`` on, the first available consumer of
    the best (lowest) priority level among the available ones; returns it (None when no
    one is available) and where the next search starts.

    Example:
        >>> from anabranch.broker.consumer import FakeWriter
        >>> a, b = (Consumer(FakeWriter(), i, n, 1) for i, n in ((1, "a"), (2, "b")))
        >>> chosen, start = round_robin([a, b], 0, lambda c: True)
        >>> chosen.name, round_robin([a, b], start, lambda c: True)[0].name
        ('a', 'b')
    """
    ready = [c for c in consumers if available(c)]
    if not ready:
        return None, start
    best = min(c.priority for c in ready)
    n = len(consumers)
    for step in range(n):
        candidate = consumers[(start + step) % n]
        if candidate.priority == best and available(candidate):
            return candidate, (start + step + 1) % n
    return None, start


class Dispatcher:
    """The read loop and the bookkeeping every type shares."""

    def __init__(self, subscription: Subscription) -> None:
        self.sub = subscription
        self.consumers: list[Consumer] = []
        self.read_position: Position = subscription.cursor.read_position
        self.redelivery_counts: dict[Position, int] = {}
        self.generation = 0
        self._kicked = False
        self._waiter: asyncio.Future[None] | None = None
        """What an idle read loop sleeps on; ``kick`` resolves it."""
        self._ledger_wait: asyncio.Task[None] | None = None
        """Waits for the ledger to grow past what the loop read; kicks when it does. Kept
        across idle periods while it still waits (no task per pass)."""
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.compacted_acks: dict[Position, bytes] = {}
        """Batch indexes compaction removed from the entries of the last read (set =
        acknowledged): sent as acked so that readers skip them. Bounded by one read."""
        self._read_backoff = Backoff(
            limits.DISPATCH_READ_RETRY_MIN_S, limits.DISPATCH_READ_RETRY_MAX_S
        )
        self._retry_in_s: float | None = None
        """Set after a failed pass: the idle loop wakes itself after this long."""
        self._throttled_s: float | None = None
        """Set by a pass the dispatch rates stopped: the idle loop wakes after this long."""
        self._bytes_allowed: int | None = None
        """Bytes the dispatch rates let go at the last check (None: any)."""
        self.read_failure_streak = 0
        """Passes in a row whose read failed (0 after a successful pass)."""
        self.read_retry_delays: list[float] = []
        """The waits of the current failure streak, first ones only (for stats and tests)."""

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the read loop (idempotent); called when a consumer is added."""
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def kick(self) -> None:
        """Something changed (permits, acks, consumers, entries): run a pass soon."""
        self._kicked = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _kick_cb(self, done: asyncio.Future[Any]) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: a failed wait only means "look again"
        self.kick()

    async def close(self) -> None:
        """Stop the read loop; consumers are left to the subscription."""
        self._closed = True
        task, self._task = self._task, None
        waits = [t for t in (task, self._ledger_wait) if t is not None]
        self._ledger_wait = None
        for t in waits:
            t.cancel()
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)

    async def _run(self) -> None:
        while not self._closed:
            self._kicked = False
            try:
                progressed = await self._pass()
            except asyncio.CancelledError:
                raise
            except Closed:
                return
            except Exception:
                # A failed read must not kill the subscription, nor wait for an unrelated
                # kick (a publish, permits) that may never come: retry after a backoff.
                self._read_failed()
                progressed = False
            else:
                self._read_succeeded()
            if not progressed and not self._kicked:
                await self._idle()

    def _read_failed(self) -> None:
        topic: Any = self.sub.topic
        topic.dispatch_read_failures = getattr(topic, "dispatch_read_failures", 0) + 1
        delay = self._read_backoff.next()
        self._retry_in_s = delay
        if len(self.read_retry_delays) < READ_RETRY_DELAYS_KEPT:
            self.read_retry_delays.append(delay)
        self.read_failure_streak += 1
        if self.read_failure_streak == 1:
            # Once per streak: a storage that stays broken would otherwise log every retry.
            log.warning(
                "%s/%s: dispatch read failed; retrying with backoff until it succeeds",
                self.sub.topic_name,
                self.sub.name,
                exc_info=True,
            )

    def _read_succeeded(self) -> None:
        if self.read_failure_streak:
            log.info(
                "%s/%s: dispatch read succeeded after %d failures",
                self.sub.topic_name,
                self.sub.name,
                self.read_failure_streak,
            )
            self.read_failure_streak = 0
            self.read_retry_delays.clear()
            self._read_backoff.reset()
        self._retry_in_s = None

    async def _idle(self) -> None:
        """Sleep until kicked, the ledger grows past ``read_position`` or a delayed entry
        is due. One future per idle period; the ledger wait is reused while pending."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        ledger = self.sub.ledger
        last = ledger.last_confirmed
        if self.consumers and not ledger.is_terminated and self.read_position > last:
            wait = self._ledger_wait
            if wait is None or wait.done():
                wait = self._ledger_wait = asyncio.ensure_future(ledger.wait_for_entries(last))
                wait.add_done_callback(self._kick_cb)
        sleeper: asyncio.Future[Any] | None = None
        due = self._next_due_ms()
        delay: float | None = None
        if due is not None:
            delay = max(due - self.sub.clock.wall_ms(), 0) / 1000
        for wake_in in (self._retry_in_s, self._throttled_s):
            if wake_in is not None:
                delay = wake_in if delay is None else min(delay, wake_in)
        if delay is not None:
            sleeper = asyncio.ensure_future(self.sub.clock.sleep(delay))
            sleeper.add_done_callback(self._kick_cb)
        try:
            await waiter
        finally:
            self._waiter = None
            if sleeper is not None and not sleeper.done():
                sleeper.remove_done_callback(self._kick_cb)
                sleeper.cancel()
                await asyncio.gather(sleeper, return_exceptions=True)

    # --- one pass -------------------------------------------------------------------------

    async def _pass(self) -> bool:
        if not self.consumers:
            return False
        self._before_pass()
        self._throttled_s = None
        generation = self.generation
        progressed = await self._dispatch_replay()
        if generation != self.generation or self._closed:
            return True
        budget = min(self._read_budget(), limits.DISPATCH_READ_ENTRIES_MAX)
        if budget <= 0:
            return progressed
        budget = self._within_dispatch_rate(budget)
        if budget <= 0:
            return progressed
        max_read = await self._max_read()
        if generation != self.generation or self._closed:
            return True
        if self.read_position > max_read:
            self._check_end()
            return progressed
        entries = await self._read(self.read_position, budget)
        if generation != self.generation or self._closed:
            return True
        usable = self._within_bytes([e for e in entries if e.position <= max_read])
        if not usable:
            self._check_end()
            return progressed
        self.read_position = usable[-1].position.next()
        fresh, aborted = self._filter(usable)
        if aborted:
            # Aborted transactional entries are never delivered: ack them so that the
            # backlog and mark-delete move past them (upstream does the same).
            await self.sub.cursor.acknowledge(aborted)
        self._dispatch_new(fresh)
        return True

    def _within_dispatch_rate(self, budget: int) -> int:
        """``budget``, but no more messages than the dispatch rates in force let go now
        (``broker/dispatch_throttling.py``); 0 when they let none, and the idle loop then
        wakes when they will. Notes the bytes they let go for :meth:`_within_bytes`."""
        allowed = self.sub.dispatch_allowance()
        self._bytes_allowed = allowed.bytes
        if allowed.messages is None:
            return budget
        if allowed.messages <= 0:
            self._throttled_s = allowed.wait_s
            return 0
        return min(budget, allowed.messages)

    def _within_bytes(self, entries: list[Entry]) -> list[Entry]:
        """The first of ``entries`` that fit the bytes the dispatch rates let go (at least
        one: a rate below an entry's size must not stall the subscription)."""
        room = self._bytes_allowed
        if room is None:
            return entries
        for n, entry in enumerate(entries):
            room -= len(entry.data)
            if room < 0:
                return entries[: max(n, 1)]
        return entries

    async def _read(self, position: Position, budget: int) -> list[Entry]:
        """New entries from ``position``: the topic's compacted view (then its tail) for a
        ``read_compacted`` consumer at or before the compaction horizon, else the ledger."""
        check_read_fault()
        self.compacted_acks.clear()
        compaction: Any = getattr(self.sub.topic, "compaction", None)
        if compaction is not None and self._reads_compacted():
            got: list[tuple[Entry, bytes]] | None = await compaction.read(position, budget)
            if got is not None:
                for entry, removed in got:
                    if removed:
                        self.compacted_acks[entry.position] = removed
                return [entry for entry, _ in got]
        return await self.sub.ledger.read(position, budget)

    def _reads_compacted(self) -> bool:
        return False

    async def _max_read(self) -> Position:
        """The last position dispatch may read: the transaction buffer's bound, or for a
        compacted read the compaction horizon if that is further (the view is committed
        up to it, also once retention has deleted every ledger under it)."""
        max_read = self.sub.transaction_buffer.max_read_position()
        compaction: Any = getattr(self.sub.topic, "compaction", None)
        if compaction is not None and self._reads_compacted():
            horizon: Position | None = await compaction.horizon()
            if horizon is not None and horizon > max_read:
                return horizon
        return max_read

    def _resume_position(self) -> Position:
        """Where reading starts again from the cursor (after a seek, rewind or new active
        consumer). A compacted read resumes just after the mark-delete position: the view
        keeps the ids of ledgers retention has deleted since, which the ledger's successor
        of the mark-delete would jump over."""
        if self._reads_compacted():
            mark_delete = self.sub.cursor.mark_delete_position
            return Position(mark_delete[0], mark_delete[1] + 1)
        return self.sub.cursor.read_position

    def _filter(self, entries: Iterable[Entry]) -> tuple[list[Entry], list[Position]]:
        fresh: list[Entry] = []
        aborted: list[Position] = []
        sub = self.sub
        for entry in entries:
            pos = entry.position
            if sub.transaction_buffer.is_aborted(pos):
                aborted.append(pos)
            elif not (sub.cursor.is_acknowledged(pos) or sub.pending_acks.is_pending(pos)):
                fresh.append(entry)
        return fresh, aborted

    def _check_end(self) -> None:
        """REACHED_END_OF_TOPIC once everything of a terminated ledger was handed out."""
        ledger = self.sub.ledger
        end = ledger.terminated_at
        if end is None or self._has_held_entries():
            return
        if self.read_position > end or end[1] < 0:
            for consumer in self.consumers:
                consumer.notify_reached_end()

    def send(
        self, consumer: Consumer, entry: Entry, info: EntryInfo, slot: int | None = None
    ) -> None:
        """Write ``entry`` to ``consumer`` with its redelivery count and batch ack set."""
        ack_set: list[int] = []
        unacked: int | None = None
        acked = self.sub.cursor.batch_ack_state(entry.position) if info.batch_size > 1 else None
        removed = self.compacted_acks.get(entry.position) if info.batch_size > 1 else None
        if removed:
            acked = merge_acked(acked, removed)
        if acked:
            ack_set, unacked = acked_to_wire(acked, info.batch_size)
        consumer.send_entry(
            entry.position,
            entry.data,
            batch_size=info.batch_size,
            redelivery_count=self.redelivery_counts.get(entry.position, 0),
            ack_set=ack_set,
            unacked_in_batch=unacked,
            slot=slot,
        )
        self.sub.count_out(unacked if unacked is not None else info.batch_size, len(entry.data))

    # --- hooks for the types ----------------------------------------------------------------

    def _before_pass(self) -> None:
        """Work due at the start of a pass (notifications, due delayed entries)."""

    async def _dispatch_replay(self) -> bool:
        return False

    def _read_budget(self) -> int:
        raise NotImplementedError

    def _dispatch_new(self, entries: Sequence[Entry]) -> None:
        raise NotImplementedError

    def _has_held_entries(self) -> bool:
        return False

    def _next_due_ms(self) -> int | None:
        return None

    def add_consumer(self, consumer: Consumer) -> None:
        raise NotImplementedError

    def remove_consumer(self, consumer: Consumer) -> None:
        raise NotImplementedError

    def redeliver(self, consumer: Consumer, positions: Sequence[Position] | None) -> None:
        raise NotImplementedError

    def set_unacked_caps(self, caps: TopicLimits) -> None:
        """Put the subscription's cap on unacknowledged messages in force: only Shared
        and Key_Shared dispatchers have one (the others deliver in order to one
        consumer)."""

    def forgotten(self, consumer: Consumer, position: Position, entry: PendingEntry) -> None:
        """``position`` left ``consumer``'s pending set (ack); Key_Shared tracks slots."""

    def part_of(self, consumer: Consumer, position: Position) -> int | None:
        """The batch indexes (bit mask) of ``position`` that ``consumer`` was sent, when it
        got only a part of that entry (Key_Shared's mixed-key batches); else None."""
        return None

    def is_split(self, position: Position) -> bool:
        """Whether the entry at ``position`` is out in parts to several consumers (or waits
        to be): a whole-entry ack from a consumer holding no part of it is stale."""
        return False

    def acked(self, consumer: Consumer, positions: Iterable[Position]) -> None:
        """Individual acks: drop the positions from whichever consumer holds them."""
        for pos in positions:
            holder = consumer if pos in consumer.pending else self._holder(pos)
            if holder is not None:
                entry = holder.forget(pos)
                if entry is not None:
                    self.forgotten(holder, pos, entry)
            self.redelivery_counts.pop(pos, None)
        self.kick()

    def acked_cumulative(self, consumer: Consumer, position: Position) -> None:
        for pos, entry in consumer.forget_upto(position):
            self.redelivery_counts.pop(pos, None)
            self.forgotten(consumer, pos, entry)
        self.kick()

    def settled(self, positions: Iterable[Position], upto: Position | None) -> None:
        """Acks a transaction committed (no consumer named): whoever holds those entries
        (individual ``positions``, or everything up to ``upto``) stops holding them."""
        for pos in positions:
            holder = self._holder(pos)
            if holder is not None:
                entry = holder.forget(pos)
                if entry is not None:
                    self.forgotten(holder, pos, entry)
            self.redelivery_counts.pop(pos, None)
        if upto is not None:
            for consumer in self.consumers:
                for pos, entry in consumer.forget_upto(upto):
                    self.redelivery_counts.pop(pos, None)
                    self.forgotten(consumer, pos, entry)
        self.kick()

    def unsettled(self, positions: Iterable[Position], upto: Position | None) -> None:
        """Acks a transaction aborted: those entries are delivered again. A consumer
        still holding them gets them redelivered; entries nobody holds (their consumer left
        while the ack was pending, so dispatch skipped them) need a re-read from the
        cursor."""
        by_holder: dict[int, tuple[Consumer, list[Position]]] = {}
        orphaned = False
        for pos in positions:
            holder = self._holder(pos)
            if holder is None:
                orphaned = True
            else:
                by_holder.setdefault(id(holder), (holder, []))[1].append(pos)
        if upto is not None:
            for consumer in self.consumers:
                held = [pos for pos in consumer.pending if pos <= upto]
                if held:
                    by_holder.setdefault(id(consumer), (consumer, []))[1].extend(held)
            orphaned = True  # a cumulative ack covers entries no consumer holds any more
        if orphaned:
            self.reset()
            return
        for consumer, held in by_holder.values():
            self.redeliver(consumer, held)
        self.kick()

    def _holder(self, position: Position) -> Consumer | None:
        for consumer in self.consumers:
            if position in consumer.pending:
                return consumer
        return None

    def reset(self) -> None:
        """After a seek: forget everything in flight and read from the cursor again."""
        self.generation += 1
        for consumer in self.consumers:
            consumer.take_pending()
        self.redelivery_counts.clear()
        self.read_position = self._resume_position()
        self.kick()

    def _bump_counts(self, positions: Iterable[Position]) -> None:
        for pos in positions:
            self.redelivery_counts[pos] = self.redelivery_counts.get(pos, 0) + 1

    def stats(self) -> dict[str, Any]:
        return {}


class SingleActiveDispatcher(Dispatcher):
    """Exclusive and Failover: one active consumer, order kept by rewinding."""

    def __init__(self, subscription: Subscription, sub_type: int) -> None:
        super().__init__(subscription)
        self.sub_type = sub_type
        self.active: Consumer | None = None
        self._notify: list[Consumer] = []

    def add_consumer(self, consumer: Consumer) -> None:
        if self.sub_type == SubType.Exclusive and self.consumers:
            raise ConsumerBusy("Exclusive consumer is already connected")
        self.consumers.append(consumer)
        if not self._pick():
            self._notify.append(consumer)  # tell only the newcomer that it is not active
        self.kick()

    def remove_consumer(self, consumer: Consumer) -> None:
        if consumer not in self.consumers:
            return
        self.consumers.remove(consumer)
        consumer.take_pending()
        if consumer is self.active:
            self.active = None
            if self.consumers:
                self._pick()
            else:
                self._rewind()
        self.kick()

    def _pick(self) -> bool:
        """Choose the active consumer as upstream does; True when it changed."""
        chosen = choose_active(self.consumers, self.sub.partition, self.sub.topic_name)
        if chosen is self.active:
            return False
        previous, self.active = self.active, chosen
        if previous is not None:
            previous.take_pending()
        self._rewind()
        if self.sub_type == SubType.Failover:
            self._notify = list(self.consumers)
        return True

    def _before_pass(self) -> None:
        if self.sub_type == SubType.Failover:
            notify, self._notify = self._notify, []
            for consumer in notify:
                if consumer in self.consumers:
                    consumer.notify_active(consumer is self.active)
        else:
            self._notify = []

    def _rewind(self) -> None:
        self.generation += 1
        self.read_position = self._resume_position()
        self.kick()

    def _reads_compacted(self) -> bool:
        return self.active is not None and self.active.read_compacted

    def _read_budget(self) -> int:
        active = self.active
        return active.permits if active is not None and active.ready else 0

    def _dispatch_new(self, entries: Sequence[Entry]) -> None:
        active = self.active
        assert active is not None
        for entry in entries:
            self.send(active, entry, entry_info(entry.data))

    def redeliver(self, consumer: Consumer, positions: Sequence[Position] | None) -> None:
        # Single messages cannot be redelivered to a single consumer without breaking
        # order: upstream rewinds to the first unacknowledged entry instead.
        pending = consumer.take_pending()
        if consumer is not self.active:
            return
        self._bump_counts(pending)
        self._rewind()

    def stats(self) -> dict[str, Any]:
        return {"activeConsumerName": self.active.name if self.active else None}


class SharedDispatcher(Dispatcher):
    """Shared: round-robin with permits, replay of redelivered entries, delayed delivery."""

    delayed_delivery = True

    def __init__(self, subscription: Subscription) -> None:
        super().__init__(subscription)
        self.replay: dict[Position, int | None] = {}
        """Positions to (re)deliver before new reads, with their Key_Shared slot."""
        self._delayed: list[tuple[int, Position]] = []
        self._next = 0
        self._chunk_owner: dict[str, Consumer] = {}
        """Chunked messages part-delivered: the consumer holding their first chunks gets
        the rest (the client reassembles; chunks split over consumers never complete)."""
        self.unacked_gate = UnackedGate(reopen_at_half=False)
        """Closed while the consumers together hold too many unacknowledged messages: no
        read then (a read under way still goes out, as upstream's)."""

    # --- consumers ------------------------------------------------------------------------

    def add_consumer(self, consumer: Consumer) -> None:
        self.consumers.append(consumer)
        self.kick()

    def remove_consumer(self, consumer: Consumer) -> None:
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        # Its chunks come back through replay, first chunk first: a new owner is chosen.
        self._chunk_owner = {m: c for m, c in self._chunk_owner.items() if c is not consumer}
        # Upstream adds a closed consumer's unacked entries to the replay set as they are
        # (no redelivery count bump: the consumer did not ask for them again).
        for pos, entry in consumer.take_pending().items():
            self.forgotten(consumer, pos, entry)
            self._add_replay(pos, entry.slot)
        self.kick()

    def available(self, consumer: Consumer) -> bool:
        return consumer.ready and not consumer.unacked_gate.closed(consumer.unacked_messages)

    def set_unacked_caps(self, caps: TopicLimits) -> None:
        """Put the unacknowledged-message caps in force on the subscription (the
        consumers take theirs when they subscribe, as upstream's), and dispatch again."""
        cap = caps.max_unacked_per_subscription
        if cap != self.unacked_gate.cap:
            # Judged afresh against the new cap at the next dispatch.
            self.unacked_gate = UnackedGate(cap, reopen_at_half=False)
            self.kick()

    def _unacked_room(self) -> int | None:
        """Messages the subscription may still be sent under its cap on unacknowledged
        messages: 0 while the gate is closed, None without a cap."""
        gate = self.unacked_gate
        if not gate.cap:
            return None
        total = sum(c.unacked_messages for c in self.consumers)
        return 0 if gate.closed(total) else max(gate.cap - total, 0)

    def _blocked_on_unacked(self) -> bool:
        return self._unacked_room() == 0

    def _next_consumer(self) -> Consumer | None:
        """Round-robin over the available consumers of the best (lowest) priority level."""
        consumer, self._next = round_robin(self.consumers, self._next, self.available)
        return consumer

    def _consumer_for(self, info: EntryInfo) -> Consumer | None:
        """The consumer for an entry: a chunk's message owner (None while it has no room:
        the chunk waits), else the next in round-robin."""
        chunk = info.chunk
        if chunk is not None and chunk.chunk_id > 0:
            owner = self._chunk_owner.get(chunk.message)
            if owner is not None:
                if not self.available(owner):
                    return None
                if chunk.last:
                    del self._chunk_owner[chunk.message]
                return owner
        consumer = self._next_consumer()
        if consumer is not None and chunk is not None and not chunk.last:
            if len(self._chunk_owner) >= limits.DISPATCH_CHUNKED_MESSAGES_MAX:
                del self._chunk_owner[next(iter(self._chunk_owner))]
            self._chunk_owner[chunk.message] = consumer
        return consumer

    # --- replay and delayed ---------------------------------------------------------------

    def _add_replay(self, position: Position, slot: int | None) -> None:
        self.replay[position] = slot

    def _take_replay(self, position: Position) -> None:
        self.replay.pop(position, None)

    def _has_held_entries(self) -> bool:
        return bool(self.replay or self._delayed)

    def _next_due_ms(self) -> int | None:
        return self._delayed[0][0] if self._delayed else None

    def _before_pass(self) -> None:
        now = self.sub.clock.wall_ms()
        while self._delayed and self._delayed[0][0] <= now:
            _, pos = heapq.heappop(self._delayed)
            self._add_replay(pos, None)

    def _read_budget(self) -> int:
        if len(self.replay) >= limits.DISPATCH_REPLAY_ENTRIES_MAX:
            return 0
        if len(self._delayed) >= limits.DISPATCH_DELAYED_ENTRIES_MAX:
            return 0
        return self._within_unacked_room(
            sum(max(c.permits, 0) for c in self.consumers if self.available(c))
        )

    def _within_unacked_room(self, budget: int) -> int:
        """``budget``, but no more than the subscription may still be sent before its cap
        on unacknowledged messages (a batch entry may still take it past, as upstream's)."""
        room = self._unacked_room()
        return budget if room is None else min(budget, room)

    async def _read_replay(self, positions: list[Position]) -> list[Entry]:
        out: list[Entry] = []
        for pos in positions:
            check_read_fault()
            entries = await self.sub.ledger.read(pos, 1)
            if entries and entries[0].position == pos:
                out.append(entries[0])
            else:
                self._take_replay(pos)  # trimmed or gone: nothing to deliver
        return out

    async def _dispatch_replay(self) -> bool:
        if not self.replay or self._blocked_on_unacked():
            return False
        if not any(self.available(c) for c in self.consumers):
            return False
        generation = self.generation
        budget = min(self._read_budget_replay(), limits.DISPATCH_READ_ENTRIES_MAX)
        if budget <= 0:
            return False
        positions = sorted(self.replay)[:budget]
        entries = await self._read_replay(positions)
        if generation != self.generation:
            return True
        fresh, aborted = self._filter(entries)
        done = {e.position for e in fresh}
        for pos in positions:
            if pos not in done:
                self._take_replay(pos)  # acked or aborted meanwhile
        if aborted:
            await self.sub.cursor.acknowledge(aborted)
        sent = False
        for entry in fresh:
            if not any(self.available(c) for c in self.consumers):
                break
            info = entry_info(entry.data)
            consumer = self._consumer_for(info)
            if consumer is None:
                continue  # a chunk whose owner has no room: it stays in replay
            self._take_replay(entry.position)
            self.send(consumer, entry, info)
            sent = True
        return sent

    def _read_budget_replay(self) -> int:
        return self._within_dispatch_rate(
            self._within_unacked_room(
                sum(max(c.permits, 0) for c in self.consumers if self.available(c))
            )
        )

    def _dispatch_new(self, entries: Sequence[Entry]) -> None:
        now = self.sub.clock.wall_ms()
        for entry in entries:
            info = entry_info(entry.data)
            due = info.deliver_at_ms
            if self.delayed_delivery and due is not None and due > now:
                heapq.heappush(self._delayed, (due, entry.position))
                continue
            consumer = self._consumer_for(info)
            if consumer is None:
                self._add_replay(entry.position, None)
                continue
            self.send(consumer, entry, info)

    def redeliver(self, consumer: Consumer, positions: Sequence[Position] | None) -> None:
        if positions is None:
            taken = list(consumer.take_pending().items())
        else:
            taken = []
            for pos in positions:
                entry = consumer.forget(pos)
                if entry is not None:
                    taken.append((pos, entry))
        for pos, entry in taken:
            self.forgotten(consumer, pos, entry)
            self._add_replay(pos, entry.slot)
        self._bump_counts(pos for pos, _ in taken)
        self.kick()

    def reset(self) -> None:
        self.replay.clear()
        self._delayed.clear()
        super().reset()

    def stats(self) -> dict[str, Any]:
        return {
            "msgInReplay": len(self.replay),
            "msgDelayed": len(self._delayed),
            "blockedSubscriptionOnUnackedMsgs": self.unacked_gate.is_closed,
        }


def make_dispatcher(subscription: Subscription, sub_type: int) -> Dispatcher:
    """The dispatcher for ``sub_type`` (a ``CommandSubscribe.SubType`` value)."""
    if sub_type in (SubType.Exclusive, SubType.Failover):
        return SingleActiveDispatcher(subscription, sub_type)
    if sub_type == SubType.Shared:
        return SharedDispatcher(subscription)
    if sub_type == SubType.Key_Shared:
        from anabranch.broker.dispatcher_key_shared import KeySharedDispatcher

        return KeySharedDispatcher(subscription)
    raise ValueError(f"unknown subscription type {sub_type}")

"""The producer of a scalable topic: routes by key over the active segments of the DAG and
re-routes transparently when a segment is sealed.

Theory of operation
-------------------
The producer holds a :class:`~anabranch.client.dag_session.DagSession` (the topic's current
DAG) and one internal :class:`~anabranch.client.producer.Producer` per active segment it
has sent to, created on first use (so batching, compression and reconnects are the
persistent producer's). A keyed message goes to the active segment whose hash range holds
``segment_hash(key)``; keyless messages go round-robin over the active segments.

Every message waits in one queue, in the order of the calls, until it is handed to a
segment producer ("dispatched"). Sequence ids come from one counter for the whole
producer and are given at dispatch, so each segment producer sees increasing ids and a
re-routed message gets a fresh one (a child segment seeded with its parents' dedup marks
never mistakes it for a duplicate, also after a merge of two parents).

When a split or merge seals a segment, its producer's sends fail with ``TopicTerminated``.
Those messages are not failed: :class:`RerouteState` holds the queue (nothing more is
dispatched anywhere) until

1. every message in flight on a sealed or no-longer-active segment has its answer
   (stored, or refused too), and
2. the DAG shows every segment that refused a send as sealed (bounded by
   ``limits.SCALABLE_PRODUCER_REROUTE_WAIT_S``; past it the held messages fail with the
   ``TopicTerminated`` they got),

then puts the refused messages back at the head of the queue in their original order and
resumes. Because a key's later message is behind its earlier ones in the queue, and
nothing is dispatched while an earlier message may still be refused, a key's messages
reach the children in order and after everything the parent stored.

Duplicates: a message the parent stored is never re-sent unless its receipt was lost with
a connection at the moment of the seal (the segment producer's resend then meets the
sealed topic). With deduplication on, the sealed parent answers that resend as a
duplicate (it holds the sequence id), so it is not re-routed; with it off, the message is
re-sent to a child under a fresh sequence id and can arrive twice — the at-least-once
window of every Pulsar producer across a failure.

Example (with a client)::

    producer = await client.create_producer("topic://public/default/orders")
    message_id = await producer.send(b"paid", key="order-42")   # message_id.segment_id set
    future = await producer.send_async(b"shipped", key="order-42")
    await producer.flush()
    await producer.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import logging
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from anabranch.client.connection import ConnectionPool
from anabranch.client.dag_session import DagSession
from anabranch.client.message_id import MessageId
from anabranch.client.pending_bound import PendingBound
from anabranch.client.producer import Producer, ProducerOptions, deliver_time_ms
from anabranch.core.hash_range import segment_hash
from anabranch.core.segment_layout import Segment, SegmentLayout, segment_name
from anabranch.core.txn_id import TxnId
from anabranch.errors import AnabranchError, Closed, InvalidArgument, NotFound, TopicTerminated
from anabranch.limits import SCALABLE_PRODUCER_REROUTE_WAIT_S, SCALABLE_ROUTE_CACHE_MAX

if TYPE_CHECKING:
    from anabranch.client.transaction import Transaction

log = logging.getLogger(__name__)

E = TypeVar("E")

REROUTE_ERRORS: tuple[type[AnabranchError], ...] = (TopicTerminated, NotFound)
"""Send or create errors that mean "this segment takes no more writes": re-route."""


class SegmentRouter:
    """Picks the active segment of a message: by key hash, or round-robin without a key.

    Example:
        >>> layout = SegmentLayout.initial(2, now_ms=0)
        >>> router = SegmentRouter()
        >>> router.route(layout, "a").segment_id            # segment_hash("a") == 0x3c25
        0
        >>> [router.route(layout, None).segment_id for _ in range(3)]
        [0, 1, 0]
    """

    def __init__(self) -> None:
        self._next = 0
        self._layout: SegmentLayout | None = None
        self._by_key: dict[str, Segment] = {}
        """Keys routed under ``_layout`` (keys repeat: hashing and the range search once)."""

    def route(self, layout: SegmentLayout, key: str | None) -> Segment:
        """The active segment that takes a message with ``key``."""
        if key is not None:
            if layout is not self._layout or len(self._by_key) >= SCALABLE_ROUTE_CACHE_MAX:
                self._layout, self._by_key = layout, {}
            segment = self._by_key.get(key)
            if segment is None:
                segment = self._by_key[key] = layout.find_active(segment_hash(key))
            return segment
        active = layout.active_segments()
        segment = active[self._next % len(active)]
        self._next += 1
        return segment


class Hold(enum.Enum):
    """Why dispatching must wait (see :meth:`RerouteState.hold`)."""

    NONE = "none"
    SETTLING = "settling"
    """Sends on a sealed or inactive segment have no answer yet."""
    AWAIT_DAG = "await_dag"
    """A segment refused a send but the DAG still shows it active."""
    RESEND = "resend"
    """Refused messages are ready to go back to the head of the queue."""


@dataclass
class RerouteState(Generic[E]):
    """What is in flight on which segment, and what must be re-sent after a seal (pure).

    Items are identified by a serial that grows with the order of the application's calls.

    Example:
        >>> state: RerouteState[str] = RerouteState()
        >>> state.sent(0, 1, "m1"); state.sent(0, 2, "m2"); state.sent(1, 3, "m3")
        >>> state.refused(0, 1)                  # segment 0 was sealed
        >>> state.hold(frozenset({0, 1})).value  # m2 still has no answer
        'settling'
        >>> state.refused(0, 2)
        >>> state.hold(frozenset({0, 1})).value  # the DAG does not show the seal yet
        'await_dag'
        >>> state.hold(frozenset({1, 2, 3})).value
        'resend'
        >>> state.release(frozenset({1, 2, 3}))
        ['m1', 'm2']
        >>> state.hold(frozenset({1, 2, 3})).value
        'none'
    """

    inflight: dict[int, dict[int, E]] = field(default_factory=dict)
    retry: dict[int, E] = field(default_factory=dict)
    sealed: set[int] = field(default_factory=set)

    def sent(self, segment_id: int, serial: int, item: E) -> None:
        """``item`` was handed to ``segment_id``'s producer."""
        self.inflight.setdefault(segment_id, {})[serial] = item

    def answered(self, segment_id: int, serial: int) -> None:
        """The send has its final answer (stored, or failed for good)."""
        sends = self.inflight.get(segment_id)
        if sends is not None:
            sends.pop(serial, None)
            if not sends:
                del self.inflight[segment_id]

    def refused(self, segment_id: int, serial: int) -> None:
        """The segment is sealed: the send must go elsewhere."""
        item = self.inflight.get(segment_id, {}).get(serial)
        self.answered(segment_id, serial)
        self.sealed.add(segment_id)
        if item is not None:
            self.retry[serial] = item

    def segment_refused(self, segment_id: int) -> None:
        """Creating a producer on the segment said it is sealed (or gone)."""
        self.sealed.add(segment_id)

    def in_flight(self, segment_id: int) -> int:
        """Sends on the segment without an answer."""
        return len(self.inflight.get(segment_id, ()))

    def hold(self, active: AbstractSet[int]) -> Hold:
        """Whether new messages may be dispatched under a DAG whose active segments are
        ``active`` (NONE), or what must happen first."""
        if not self.sealed and not self.retry and self.inflight.keys() <= active:
            return Hold.NONE  # the common case, checked once per message
        stale = self.sealed | {s for s in self.inflight if s not in active}
        if any(self.in_flight(s) for s in stale):
            return Hold.SETTLING
        if any(s in active for s in self.sealed):
            return Hold.AWAIT_DAG
        return Hold.RESEND if self.retry else Hold.NONE

    def release(self, active: AbstractSet[int]) -> list[E]:
        """The refused items in call order (to put at the head of the queue); forgets the
        seals the DAG now shows."""
        items = [self.retry[serial] for serial in sorted(self.retry)]
        self.retry.clear()
        self.sealed = {s for s in self.sealed if s in active}
        return items

    def give_up(self) -> list[E]:
        """Stop waiting: the refused items (to fail) in call order; every seal forgotten."""
        items = [self.retry[serial] for serial in sorted(self.retry)]
        self.retry.clear()
        self.sealed.clear()
        return items


@dataclass(eq=False, slots=True)
class _Entry:
    """One message until it has its answer. It is also the segment producer's completion
    of the message (see ``producer.Completion``): the receipt resolves it directly, so a
    message costs one future (the caller's) and no scheduled callback in between."""

    owner: ScalableProducer
    serial: int
    value: bytes
    key: str | None
    properties: Mapping[str, str] | None
    event_time: int | None
    future: asyncio.Future[MessageId]
    segment_id: int = -1
    txn: TxnId | None = None
    """The transaction the message belongs to: kept when it is re-routed."""
    deliver_at: int | None = None
    """Delayed delivery time (ms since the epoch): kept when it is re-routed."""
    released: bool = False
    """Whether its slot of the producer's bound was given back (once, at its end)."""

    def done(self) -> bool:
        # Every hand-off to a segment gets its answer, even after the caller's future
        # ended (cancelled): the re-route state must hear it.
        return False

    def set_result(self, result: MessageId, /) -> None:
        owner = self.owner
        future = self.future
        state = owner._state
        sends = state.inflight.get(self.segment_id)
        if (
            future.done()
            or sends is None
            or owner._closing
            or state.sealed
            or state.retry
            or owner._recovery is not None
        ):
            owner._on_answer(self.segment_id, self, result, None)
            return
        # The common case of ``_on_answer``, inline (it runs once per message).
        sends.pop(self.serial, None)
        if not sends:
            del state.inflight[self.segment_id]
        if not self.released:
            self.released = True
            owner._bound.leave(1)
        future.set_result(result)
        if self.segment_id not in owner._active[1]:
            owner._after_answer(self.segment_id)

    def set_exception(self, exception: BaseException, /) -> None:
        self.owner._on_answer(self.segment_id, self, None, exception)


def _active_ids(layout: SegmentLayout) -> frozenset[int]:
    return frozenset(s.segment_id for s in layout.active_segments())


class ScalableProducer:
    """A producer on a ``topic://`` scalable topic (see the module docstring)."""

    def __init__(self, pool: ConnectionPool, session: DagSession, options: ProducerOptions) -> None:
        self._pool = pool
        self._session = session
        self.options = options
        self.topic = str(session.topic)
        self.producer_name = options.producer_name or (
            f"{session.topic.local_name}-{uuid.uuid4().hex[:12]}"
        )
        # One name on every segment: the broker's dedup marks follow it across seals.
        self._segment_options = dataclasses.replace(
            options, producer_name=self.producer_name, initial_sequence_id=None
        )
        self._next_sequence_id = options.initial_sequence_id or 0
        self.last_sequence_id = self._next_sequence_id - 1
        self._producers: dict[int, Producer] = {}
        self._creating: dict[int, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._queue: deque[_Entry] = deque()
        self._state: RerouteState[_Entry] = RerouteState()
        self._router = SegmentRouter()
        self._bound = PendingBound(options.pending_messages_max)
        self._serials = itertools.count()
        self._loop = asyncio.get_running_loop()
        self._dispatching = False
        self._awaited = 0
        """Callers of ``send`` waiting on an answer: while any do, what is handed to the
        segments goes out at the end of the loop turn, not after the batch delay."""
        self._flush_queued = False
        """What is queued here when ``_flush_soon`` was called goes out as soon as it is
        handed to its segment (an ending transaction waits for it)."""
        self._recovery: asyncio.Task[None] | None = None
        self._settled = asyncio.Event()
        self._closing = False
        self._active: tuple[SegmentLayout | None, frozenset[int]] = (None, frozenset())
        self._retired_for: SegmentLayout | None = None
        self._clear_under: frozenset[int] | None = None
        """The active set under which the reroute state last had nothing to hold."""

    def __repr__(self) -> str:
        return f"ScalableProducer({self.topic!r}, name={self.producer_name!r})"

    @property
    def segment_ids(self) -> list[int]:
        """Segments with an internal producer now."""
        return sorted(self._producers)

    def _current(self) -> tuple[SegmentLayout, frozenset[int]]:
        """The session's layout and its active segment ids (computed once per layout)."""
        layout = self._session.layout
        if self._active[0] is not layout:
            self._active = (layout, _active_ids(layout))
        return layout, self._active[1]

    # --- sending ---------------------------------------------------------------------------

    async def send(
        self,
        value: bytes,
        *,
        key: str | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int | None = None,
        sequence_id: int | None = None,
        txn: Transaction | None = None,
        deliver_at: int | None = None,
        deliver_after: float | None = None,
    ) -> MessageId:
        """Send one message and wait until a segment stored it; the id names the segment.

        With ``txn`` the message joins that transaction (on whichever segment it lands,
        also after a re-route); readers see it once the transaction commits.
        ``deliver_at`` (ms since the epoch) or ``deliver_after`` (seconds) delay it: the
        segment that stores it holds it back from queue consumers and Key_Shared stream
        consumers until then (also once that segment is sealed by a split: its children
        wait for it to drain, so a key's delayed messages still come first).

        Example::

            mid = await producer.send(b"x", key="k", properties={"a": "1"})
            assert mid.segment_id is not None
        """
        fut = await self.send_async(
            value,
            key=key,
            properties=properties,
            event_time=event_time,
            sequence_id=sequence_id,
            txn=txn,
            deliver_at=deliver_at,
            deliver_after=deliver_after,
        )
        if fut.done():
            return fut.result()
        # The caller waits: no batch delay (see ``Producer._flush_soon``), also for a
        # message still queued here (the segment's producer being made, or a re-route).
        self._awaited += 1
        try:
            self._flush_soon()
            return await fut
        finally:
            self._awaited -= 1

    async def send_async(
        self,
        value: bytes,
        *,
        key: str | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int | None = None,
        sequence_id: int | None = None,
        txn: Transaction | None = None,
        deliver_at: int | None = None,
        deliver_after: float | None = None,
    ) -> asyncio.Future[MessageId]:
        """Queue one message; returns a future of its id once there is room.

        ``sequence_id`` must be None: the producer numbers messages itself (one sequence
        across every segment). Waits while ``pending_messages_max`` messages are
        unanswered, or raises ``ProducerQueueFull`` with ``block_if_queue_full=False``.
        """
        if sequence_id is not None:
            raise InvalidArgument("a scalable-topic producer assigns sequence ids itself")
        due = deliver_time_ms(deliver_at, deliver_after)
        if txn is None and due is None:
            fut = self._send_fast(value, key, properties, event_time)
            if fut is not None:
                return fut
        (fut,) = await self.send_many(
            [(value, key, properties, event_time)], txn=txn, _deliver_at=due
        )
        return fut

    def _send_fast(
        self,
        value: bytes,
        key: str | None,
        properties: Mapping[str, str] | None,
        event_time: int | None,
    ) -> asyncio.Future[MessageId] | None:
        """The common case in one step, what ``_enqueue`` + ``_dispatch`` do otherwise:
        nothing queued or held, the DAG as last seen, the key's segment has a producer with
        room. None (nothing taken) sends the message the general way."""
        if self._queue or self._dispatching or self._closing or type(value) is not bytes:
            return None
        state = self._state
        layout = self._session.layout
        seen, active = self._active
        if (
            state.sealed
            or state.retry
            or seen is not layout
            or active is not self._clear_under
            or self._retired_for is not layout
        ):
            return None
        segment_id = self._router.route(layout, key).segment_id
        producer = self._producers.get(segment_id)
        if producer is None or producer._closing or not self._bound.try_enter():
            return None
        if not producer._bound.try_enter():
            self._bound.leave(1)
            return None
        fut: asyncio.Future[MessageId] = self._loop.create_future()
        props = dict(properties) if properties else None
        entry = _Entry(self, next(self._serials), value, key, props, event_time, fut, segment_id)
        sequence_id = self._next_sequence_id
        self._next_sequence_id = sequence_id + 1
        sends = state.inflight.get(segment_id)
        if sends is None:
            sends = state.inflight[segment_id] = {}
        sends[entry.serial] = entry
        producer._submit(entry, value, key, props, event_time, sequence_id, None)
        self.last_sequence_id = sequence_id
        if self._bound.count >= self._bound.limit:
            self._flush_if_full()
        return fut

    def _flush_if_full(self) -> None:
        """With the bound full, room comes only from receipts, and the held messages sit
        spread over the segments' open batches, none of them full: send those now rather
        than after their batch delay."""
        if self._bound.count >= self._bound.limit:
            for producer in self._producers.values():
                if producer._batch:
                    producer._flush_batch()

    def _flush_soon(self) -> None:
        """Send the segments' open batches at the end of this loop turn, and what is still
        queued here once it is handed over: someone waits for it (an awaited send, an
        ending transaction)."""
        for producer in self._producers.values():
            producer._flush_soon()
        self._flush_queued = bool(self._queue)

    async def send_many(
        self,
        messages: Iterable[tuple[bytes, str | None, Mapping[str, str] | None, int | None]],
        *,
        txn: Transaction | None = None,
        _deliver_at: int | None = None,
    ) -> list[asyncio.Future[MessageId]]:
        """Queue ``(value, key, properties, event time)`` messages in order; returns their
        futures. Like ``send_async`` per message, without a coroutine per message (what a
        sink writing rows in bulk wants).

        Example::

            futures = await producer.send_many([(b"a", "k1", None, None), (b"b", "k2", None, None)])
            ids = await asyncio.gather(*futures)
        """
        items = list(messages)
        for value, *_rest in items:  # a bad value refuses the whole call, nothing queued
            self._check_sendable(value)
        if txn is None:
            return await self._send_many(items, None, _deliver_at)
        txn._check_usable()  # nothing queued for a transaction that cannot take it
        txn._senders.add(self)
        for _ in items:
            txn._begin_op()
        try:
            out = await self._send_many(items, txn.id, _deliver_at)
        except BaseException as err:
            for _ in items:
                txn._end_op(err)
            raise
        for fut in out:
            txn._track(fut)
        return out

    async def _send_many(
        self,
        items: list[tuple[bytes, str | None, Mapping[str, str] | None, int | None]],
        txn_id: TxnId | None,
        deliver_at: int | None = None,
    ) -> list[asyncio.Future[MessageId]]:
        out: list[asyncio.Future[MessageId]] = []
        for value, key, properties, event_time in items:
            if not self._bound.try_enter():
                await self._dispatch()  # hand over what is queued, then wait for room
                await self._bound.enter(block=self.options.block_if_queue_full, owner=self)
            out.append(
                self._enqueue(value, key, properties, event_time, txn_id, deliver_at=deliver_at)
            )
        await self._dispatch()
        return out

    def _check_sendable(self, value: bytes, *, entered: bool = False) -> None:
        """Raise for a closed producer or a value that is not bytes (``entered``: the
        caller holds a slot of the bound, given back when it raises)."""
        err: AnabranchError | None = None
        if self._closing:
            err = Closed(f"{self} is closed")
        elif not isinstance(value, bytes | bytearray | memoryview):
            err = InvalidArgument(f"message value must be bytes, not {type(value).__name__}")
        if err is not None:
            if entered:
                self._bound.leave(1)
            raise err

    def _enqueue(
        self,
        value: bytes,
        key: str | None,
        properties: Mapping[str, str] | None,
        event_time: int | None,
        txn_id: TxnId | None = None,
        *,
        deliver_at: int | None = None,
    ) -> asyncio.Future[MessageId]:
        """Queue a message that holds a slot of the bound."""
        fut: asyncio.Future[MessageId] = self._loop.create_future()
        entry = _Entry(
            self,
            next(self._serials),
            value if type(value) is bytes else bytes(value),
            key,
            dict(properties) if properties else None,
            event_time,
            fut,
            txn=txn_id,
            deliver_at=deliver_at,
        )
        if self._closing:
            self._fail(entry, Closed(f"{self} is closed"))
        else:
            self._queue.append(entry)
        return fut

    def _release(self, entry: _Entry) -> None:
        """Give back ``entry``'s slot of the bound (once)."""
        if not entry.released:
            entry.released = True
            self._bound.leave(1)

    def _fail(self, entry: _Entry, err: BaseException) -> None:
        """End ``entry`` with ``err`` (unless its future already ended)."""
        self._release(entry)
        if not entry.future.done():
            entry.future.set_exception(err)

    async def _dispatch(self) -> None:
        """Hand queued messages to segment producers, in order, while nothing holds."""
        if self._dispatching:
            return  # the running loop will take what was just queued
        self._dispatching = True
        try:
            while True:
                blocked = self._pump()
                if blocked is None:
                    self._flush_if_full()
                    if self._awaited or self._flush_queued:
                        self._flush_soon()
                    return
                await self._send_waiting(*blocked)  # the segment's queue is full: wait there
        finally:
            self._dispatching = False

    def _pump(self) -> tuple[Producer, int, _Entry, int] | None:
        """Hand queued messages over without waiting, until the queue is empty or something
        holds; returns the send that must wait for room in a segment producer, if any."""
        state = self._state
        while self._queue and not self._closing:
            layout, active = self._current()
            # In-flight sends only go to active segments: while the active set and the
            # seal state are unchanged, a NONE answer stays NONE (no check per message).
            if state.sealed or state.retry or active is not self._clear_under:
                if state.hold(active) is not Hold.NONE:
                    self._ensure_recovery()
                    return None
                self._clear_under = active
            if self._retired_for is not layout:
                self._retire_stale(active)
                self._retired_for = layout
            entry = self._queue[0]
            segment = self._router.route(layout, entry.key)
            producer = self._producers.get(segment.segment_id)
            if producer is None:
                self._ensure_creating(segment)
                return None
            self._queue.popleft()
            waiting = self._send_now(producer, segment.segment_id, entry)
            if waiting is not None:
                return producer, segment.segment_id, entry, waiting
        return None

    def _send_now(self, producer: Producer, segment_id: int, entry: _Entry) -> int | None:
        """Hand ``entry`` to a segment producer without waiting. Returns the sequence id to
        send it with once that producer has room, or None when it was handed (or failed)."""
        if entry.future.done():  # cancelled by the caller (or failed) while queued
            self._release(entry)
            return None
        sequence_id = self._next_sequence_id
        self._next_sequence_id += 1
        self._state.sent(segment_id, entry.serial, entry)
        entry.segment_id = segment_id  # before the hand-off: it may answer at once
        try:
            handed = producer._offer(
                entry, entry.value, entry.key, entry.properties, entry.event_time,
                sequence_id, entry.txn, entry.deliver_at,
            )  # fmt: skip
        except AnabranchError as err:
            self._send_failed(producer, segment_id, entry, err)
            return None
        if not handed:
            return sequence_id
        self.last_sequence_id = sequence_id
        return None

    async def _send_waiting(
        self, producer: Producer, segment_id: int, entry: _Entry, sequence_id: int
    ) -> None:
        try:
            await producer._offer_waiting(
                entry, entry.value, entry.key, entry.properties, entry.event_time,
                sequence_id, entry.txn, entry.deliver_at,
            )  # fmt: skip
        except AnabranchError as err:
            self._send_failed(producer, segment_id, entry, err)
            return
        self.last_sequence_id = sequence_id

    def _send_failed(
        self, producer: Producer, segment_id: int, entry: _Entry, err: AnabranchError
    ) -> None:
        if isinstance(err, REROUTE_ERRORS):
            self._state.refused(segment_id, entry.serial)
            self._drop_producer(segment_id)
            return
        self._state.answered(segment_id, entry.serial)
        self._fail(entry, err)
        if producer._closing:
            self._drop_producer(segment_id)  # failed for good: the next send makes a new one

    def _on_answer(
        self, segment_id: int, entry: _Entry, mid: MessageId | None, err: BaseException | None
    ) -> None:
        """A segment producer's answer to ``entry`` (its id, or ``err``)."""
        if entry.future.done():
            self._state.answered(segment_id, entry.serial)  # already failed (given up)
            self._release(entry)
            return
        if err is None:
            assert mid is not None
            self._state.answered(segment_id, entry.serial)
            self._release(entry)
            entry.future.set_result(mid)
        elif isinstance(err, REROUTE_ERRORS) and not self._closing:
            log.debug("%s: segment %d refused a send (%s); re-routing", self, segment_id, err)
            self._state.refused(segment_id, entry.serial)
        else:
            self._state.answered(segment_id, entry.serial)
            self._fail(entry, err)
        self._after_answer(segment_id)

    def _after_answer(self, segment_id: int) -> None:
        """Wake what waits for answers (a seal settling), if anything holds."""
        state = self._state
        if self._closing or not (
            state.sealed or state.retry or self._recovery or segment_id not in self._active[1]
        ):
            return  # the common case: nothing held, nothing to wake
        settled, self._settled = self._settled, asyncio.Event()
        settled.set()
        if state.hold(self._current()[1]) is not Hold.NONE:
            self._ensure_recovery()

    # --- re-routing ------------------------------------------------------------------------

    def _ensure_recovery(self) -> None:
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        """Wait out a seal (module docstring), then resend and resume dispatching."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SCALABLE_PRODUCER_REROUTE_WAIT_S
        while not self._closing:
            layout, active = self._current()
            hold = self._state.hold(active)
            if hold is Hold.NONE:
                break
            if hold is Hold.RESEND:
                self._queue.extendleft(reversed(self._state.release(active)))
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                sealed = sorted(self._state.sealed)
                self._give_up(
                    TopicTerminated(
                        f"{self.topic}: segments {sealed} refused writes and no DAG showing "
                        f"them sealed arrived within {SCALABLE_PRODUCER_REROUTE_WAIT_S} s"
                    )
                )
                continue
            waiter = (
                self._settled.wait()
                if hold is Hold.SETTLING
                else self._session.wait_for_change(layout.epoch)
            )
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                continue
            except AnabranchError as err:  # the DAG session ended (closed, topic deleted)
                self._give_up(err)
                return
        self._recovery = None
        await self._dispatch()

    def _give_up(self, err: AnabranchError) -> None:
        """Fail every held message (refused, or in flight on a stale segment) with ``err``."""
        log.warning("%s: failing held sends: %s", self, err)
        _, active = self._current()
        stale = self._state.sealed | {s for s in self._state.inflight if s not in active}
        held = [e for s in stale for e in self._state.inflight.get(s, {}).values()]
        for segment_id in stale:
            for serial in list(self._state.inflight.get(segment_id, {})):
                self._state.answered(segment_id, serial)
            self._drop_producer(segment_id)
        for entry in [*held, *self._state.give_up()]:
            self._fail(entry, err)

    # --- segment producers -----------------------------------------------------------------

    def _ensure_creating(self, segment: Segment) -> None:
        if segment.segment_id not in self._creating:
            task = asyncio.get_running_loop().create_task(self._create(segment))
            self._creating[segment.segment_id] = task

    async def _create(self, segment: Segment) -> None:
        name = str(segment_name(self._session.topic, segment))
        producer = Producer(self._pool, name, self._segment_options)
        producer.segment_id = segment.segment_id
        try:
            await producer._start()
        except REROUTE_ERRORS as err:
            log.debug("%s: segment %d takes no producers: %s", self, segment.segment_id, err)
            self._state.segment_refused(segment.segment_id)
            await producer.close()
        except AnabranchError as err:
            # Not a seal: the broker is unreachable or refuses us. Fail what waits.
            await producer.close()
            queued, self._queue = list(self._queue), deque()
            for entry in queued:
                self._fail(entry, err)
        else:
            if self._closing:
                await producer.close()
                return
            self._producers[segment.segment_id] = producer
            # Continue above whatever this name stored on the segment before (a restart).
            self._next_sequence_id = max(self._next_sequence_id, producer.last_sequence_id + 1)
        finally:
            self._creating.pop(segment.segment_id, None)
        await self._dispatch()

    def _drop_producer(self, segment_id: int) -> None:
        producer = self._producers.pop(segment_id, None)
        if producer is not None:
            self._close_later(producer)

    def _retire_stale(self, active: frozenset[int]) -> None:
        for segment_id in [s for s in self._producers if s not in active]:
            if not self._state.in_flight(segment_id):
                self._drop_producer(segment_id)

    def _close_later(self, producer: Producer) -> None:
        task = asyncio.get_running_loop().create_task(producer.close())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- flush and close -------------------------------------------------------------------

    def _unanswered(self) -> Iterator[_Entry]:
        """Every message without its answer: queued, in flight, or held for a resend."""
        yield from self._queue
        for sends in self._state.inflight.values():
            yield from sends.values()
        yield from self._state.retry.values()

    async def flush(self) -> None:
        """Wait until every message sent so far has its answer (stored or failed).

        Failed sends are not raised here: their own futures carry the errors.
        """
        futures = [e.future for e in self._unanswered() if not e.future.done()]
        for producer in list(self._producers.values()):
            producer._flush_batch()
        if futures:
            await asyncio.wait(futures)

    async def close(self) -> None:
        """Flush (bounded by the operation timeout), close every segment producer and the
        DAG session; later sends raise ``Closed``. Idempotent."""
        if self._closing:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), self._pool.operation_timeout_s)
        self._closing = True
        tasks = [t for t in (self._recovery, *self._creating.values()) if t is not None]
        for task in tasks:
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        producers = list(self._producers.values())
        self._producers.clear()
        await asyncio.gather(
            *(p.close() for p in producers), *self._background, return_exceptions=True
        )
        err = Closed(f"{self} was closed")
        for entry in list(self._unanswered()):
            self._fail(entry, err)
        self._queue.clear()
        await self._session.close()


__all__ = ["Hold", "RerouteState", "ScalableProducer", "SegmentRouter"]

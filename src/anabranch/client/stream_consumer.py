"""The stream consumer of a scalable topic: controller-assigned segments, one ordered
receive queue, cumulative acks that advance every segment.

Theory of operation
-------------------
A stream consumer registers with the topic's controller (``SCALABLE_TOPIC_SUBSCRIBE`` with
``consumer_type=STREAM``) through a
:class:`~anabranch.client.controller_registration.ControllerRegistration`: at the DAG's
``controller_broker_url``, following a ``ServiceNotReady`` redirect, on a connection of its
own. When that connection drops, the controller keeps this consumer's segments for its
grace period and the registration re-registers with the same ``consumer_name``, which gets
the same segments back without a rebalance; it also registers again when leadership
moves while that connection stays open (a paused old leader), which it tells from the DAG
watch and a short keepalive. :meth:`StreamConsumer.close` leaves the
subscription (``SCALABLE_TOPIC_UNSUBSCRIBE``: the others get the segments at once), or with
``leave=False`` only disconnects (the segments wait for a restart for the grace period).

The answer and every later ``SCALABLE_TOPIC_ASSIGNMENT_UPDATE`` carry this consumer's
whole share: :func:`diff_assignment` turns it into segments to leave (their consumer is
closed and their queued messages dropped: the broker redelivers them to the next owner)
and segments to join. Each joined segment gets an internal **Exclusive** consumer on its
``segment://`` topic (upstream's coordinator comment; an Exclusive subscription also
guarantees that a segment moving between two consumers is never read by both: the new
owner retries ``ConsumerBusy`` until the old one has let go). All of them feed one queue.

Order: a key lives in one active segment at a time, and the controller assigns a child
only once every ancestor is *drained* for the subscription (all acknowledged), or, when
one consumer holds all of the child's undrained ancestors, to that consumer together with
them (*carried*, :mod:`anabranch.core.assignment`). This consumer subscribes to a segment
only once every ancestor it holds has handed out its last message (the broker's
REACHED_END_OF_TOPIC comes after it on the same connection), so a key's messages from a
child come after all of its messages from the parents either way. Carrying is what keeps
a consumer that acknowledges every N messages, or in batches, from stalling after a
split: the sealed parent's last messages need not be acknowledged before the children's
arrive. The consumer makes draining observable by acknowledging:
:meth:`StreamConsumer.acknowledge_cumulative` of a message acknowledges, on *every*
segment, everything delivered up to that message (upstream's position vector, kept here
by :class:`DeliveryLog`). A sealed segment is thus drained once the application has
acknowledged a message received after its last one.

Key_Shared dispatch mode (PIP-460 "Scaling Reads beyond the Segment Count"): with
``dispatch_mode="key_shared"`` the subscription's consumers may outnumber its segments.
The controller then gives every consumer one segment and several consumers the same one
(:mod:`anabranch.core.assignment`); each joined segment gets an internal **Key_Shared**
consumer instead, so the segment's broker splits the segment's keys among its consumers
(``dispatcher_key_shared``: a key goes to one consumer at a time, in order, and a departed
consumer's keys move to the others with its unacknowledged messages). Acknowledgements are
individual (:meth:`StreamConsumer.acknowledge`); a cumulative ack has no meaning when a
segment's messages are spread over several consumers. Every consumer of a subscription
uses the same mode (a stream subscription nobody consumes takes the mode of its next
consumer).

Example (with a client)::

    stream = await client.subscribe_stream("topic://public/default/orders",
                                           subscription="billing", consumer_name="worker-1")
    msg = await stream.receive(timeout=1.0)
    if msg is not None:
        await stream.acknowledge_cumulative(msg)
    await stream.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anabranch.client.backoff import Backoff
from anabranch.client.connection import ConnectionPool
from anabranch.client.consumer import Consumer, ConsumerOptions, InitialPosition, SubscriptionType
from anabranch.client.controller_registration import ControllerRegistration, leader_url
from anabranch.client.dag_session import DagSession
from anabranch.client.errors import ConsumerBusy, ServiceNotReady
from anabranch.client.message import Message
from anabranch.client.message_id import MessageId
from anabranch.client.queue_consumer import SegmentConsumer
from anabranch.client.segment_consumers import OwnedInbox, close_all
from anabranch.errors import AnabranchError, Closed, InvalidArgument, NotFound
from anabranch.limits import (
    CLIENT_RECONNECT_BACKOFF_MIN_S,
    CONSUMER_RECEIVER_QUEUE_MESSAGES,
    STREAM_CONSUMER_RESUBSCRIBE_MAX_S,
)
from anabranch.protocol._generated import pulsar_api_pb2 as pb

if TYPE_CHECKING:
    from anabranch.client.transaction import Transaction

log = logging.getLogger(__name__)
T = pb.BaseCommand


class StreamDispatchMode(enum.StrEnum):
    """How a stream subscription's segments reach its consumers."""

    EXCLUSIVE = "exclusive"
    """One consumer per segment (the default): consumers beyond the segment count idle."""
    KEY_SHARED = "key_shared"
    """Consumers beyond the segment count share segments by key hash (see module doc)."""


@dataclass(frozen=True, slots=True)
class StreamConsumerOptions:
    """Stream consumer settings (the keyword arguments of ``subscribe_stream``).

    ``consumer_name`` is the session identity the controller keeps for the grace period
    (a random one if not given). ``dispatch_mode`` is ``"exclusive"`` (default) or
    ``"key_shared"`` (fan-out within a segment; individual acks).

    Example:
        >>> StreamConsumerOptions(consumer_name="worker-1").receiver_queue_size
        1000
        >>> StreamConsumerOptions(dispatch_mode="key_shared").key_shared
        True
    """

    consumer_name: str | None = None
    receiver_queue_size: int = CONSUMER_RECEIVER_QUEUE_MESSAGES
    properties: Mapping[str, str] = field(default_factory=dict)
    dispatch_mode: StreamDispatchMode | str = StreamDispatchMode.EXCLUSIVE

    def __post_init__(self) -> None:
        if self.receiver_queue_size < 1:
            raise InvalidArgument("receiver_queue_size must be >= 1")
        try:
            mode = StreamDispatchMode(str(self.dispatch_mode).lower())
        except ValueError:
            raise InvalidArgument(
                f"dispatch_mode {self.dispatch_mode!r} is not one of "
                f"{[m.value for m in StreamDispatchMode]}"
            ) from None
        object.__setattr__(self, "dispatch_mode", mode)

    @property
    def key_shared(self) -> bool:
        """Whether segments are shared by key hash (Key_Shared dispatch mode)."""
        return self.dispatch_mode == StreamDispatchMode.KEY_SHARED

    def segment_options(self, consumer_name: str) -> ConsumerOptions:
        """The options of one segment's consumer: Exclusive, or Key_Shared in fan-out mode."""
        return ConsumerOptions(
            subscription_type=(
                SubscriptionType.KEY_SHARED if self.key_shared else SubscriptionType.EXCLUSIVE
            ),
            consumer_name=consumer_name,
            initial_position=InitialPosition.EARLIEST,
            receiver_queue_size=self.receiver_queue_size,
            properties=self.properties,
        )

    @staticmethod
    def from_kwargs(kwargs: Mapping[str, Any]) -> StreamConsumerOptions:
        """Build from keyword arguments (unknown names raise ``InvalidArgument``)."""
        try:
            return StreamConsumerOptions(**kwargs)
        except TypeError as err:
            raise InvalidArgument(f"bad stream consumer option: {err}") from err


def diff_assignment(
    current: Mapping[int, str], new: Mapping[int, str]
) -> tuple[dict[int, str], list[int]]:
    """(segments to join with their topics, segment ids to leave), both by segment id.

    A segment whose topic name changed is left and joined again.

    Example:
        >>> diff_assignment({0: "s0", 1: "s1"}, {1: "s1", 2: "s2"})
        ({2: 's2'}, [0])
    """
    joined = {i: t for i, t in sorted(new.items()) if current.get(i) != t}
    left = sorted(i for i, t in current.items() if new.get(i) != t)
    return joined, left


def _id_of(message: Message | MessageId) -> MessageId:
    return message.message_id if isinstance(message, Message) else message


class StreamSegmentConsumer(SegmentConsumer):
    """The internal consumer of one segment of a stream consumer.

    A reconnect makes the broker send again everything unacknowledged, also what the
    application already took, and drops what was queued. Once this segment's children
    deliver (carried, see the module docstring), either would put this segment's messages
    after theirs. So after a reconnect it skips what the application already took
    (those deliveries stay in the :class:`DeliveryLog`: a later cumulative ack covers
    them), acknowledges again what its last cumulative ack covered (an ack lost with the
    connection would otherwise keep the segment from draining), and tells its owner
    whether it dropped queued messages (``on_reconnect(consumer, dropped)``).
    """

    def __init__(
        self,
        segment_id: int,
        on_end: Callable[[SegmentConsumer], None],
        on_reconnect: Callable[[StreamSegmentConsumer, int], None],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(segment_id, on_end, *args, **kwargs)
        self._on_reconnect = on_reconnect
        self._acked: MessageId | None = None
        self._connected = False

    async def _connect_once(self) -> None:
        queued = sum(1 for m in self._inbox._items if m._consumer_id == self._id)
        await super()._connect_once()
        if not self._connected:
            self._connected = True
            return
        if self._last_dequeued is not None:
            self._filter_up_to = self._last_dequeued
        if self._acked is not None:
            await super().acknowledge_cumulative(self._acked)
        self._on_reconnect(self, queued)

    async def acknowledge_cumulative(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        await super().acknowledge_cumulative(message, txn)
        if txn is None:  # a transaction's ack counts only once it commits
            self._acked = _id_of(message)


class DeliveryLog:
    """Messages delivered to the application and not yet acknowledged, with their segments, in
    delivery order: the position vector of a cumulative ack (pure).

    Example:
        >>> log = DeliveryLog()
        >>> for seg, entry in [(0, 1), (1, 1), (0, 2), (1, 2)]:
        ...     log.record((seg, MessageId(7, entry)))
        >>> sorted((s, m.entry_id) for s, m in log.ack_upto(0, MessageId(7, 2)).items())
        [(0, 2), (1, 1)]
        >>> log.pending()
        1
    """

    def __init__(self) -> None:
        self._deliveries: deque[tuple[int, Message | MessageId]] = deque()
        self.record: Callable[[tuple[int, Message | MessageId]], None] = self._deliveries.append
        """Record a delivery ``(segment_id, message)`` (the message itself: its id is made
        only if an ack needs it). The deque's own append: this runs once per message."""

    def ack_upto(self, segment_id: int, message: Message | MessageId) -> dict[int, MessageId]:
        """The cumulative ack per segment that covers everything delivered up to this
        message (which must have been delivered; otherwise just this message's segment)."""
        deliveries = self._deliveries
        # From the newest: an ack names a recent message, and a redelivery of it that
        # came later is the delivery meant. Whatever is scanned is then acknowledged.
        back = next(
            (
                i
                for i, (s, m) in enumerate(reversed(deliveries))
                if m is message and s == segment_id
            ),
            None,
        )
        target = _id_of(message)
        if back is None:  # not this very object: an id, or an equal message
            back = next(
                (
                    i
                    for i, (s, m) in enumerate(reversed(deliveries))
                    if s == segment_id and _id_of(m) == target
                ),
                None,
            )
        if back is None:
            return {segment_id: target}
        last: dict[int, Message | MessageId] = {}
        popleft = deliveries.popleft
        for _ in range(len(deliveries) - back):
            seg, m = popleft()
            last[seg] = m
        return {seg: _id_of(m) for seg, m in last.items()}

    def forget(self, segment_id: int) -> None:
        """The segment left this consumer: its deliveries no longer count."""
        kept = [d for d in self._deliveries if d[0] != segment_id]
        self._deliveries.clear()  # in place: ``record`` appends to this deque
        self._deliveries.extend(kept)

    def pending(self) -> int:
        """Deliveries not covered by an ack yet."""
        return len(self._deliveries)


class StreamConsumer:
    """A controller-assigned, ordered consumer of a scalable topic (module docstring)."""

    _key_shared = False
    """Key_Shared dispatch mode (``options.key_shared``)."""

    def __init__(
        self,
        pool: ConnectionPool,
        session: DagSession,
        subscription: str,
        options: StreamConsumerOptions,
    ) -> None:
        self._pool = pool
        self._session = session
        self.topic = str(session.topic)
        self.subscription = subscription
        self.options = options
        self.consumer_name = options.consumer_name or uuid.uuid4().hex[:16]
        self._key_shared = options.key_shared
        self._inbox = OwnedInbox()
        self._log = DeliveryLog()
        self._topics: dict[int, str] = {}
        self._segments: dict[int, Consumer] = {}
        self._by_consumer_id: dict[int, tuple[Consumer, int]] = {}
        """A segment consumer's id -> it and its segment id."""
        self._opening: dict[int, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._wanted: dict[int, str] = {}
        self._changed = asyncio.Event()
        """Set (and replaced) when a held segment may be free to join: an ancestor ended
        or left the share (see :meth:`_ancestors_ended`)."""
        self.layout_epoch = -1
        self.assignment_updates = 0
        self._registration = ControllerRegistration(
            pool,
            session,
            subscription,
            self.consumer_name,
            pb.STREAM,
            self._assign,
            key_shared=options.key_shared,
        )
        self._closing = False

    def __repr__(self) -> str:
        return f"StreamConsumer({self.topic!r}, {self.subscription!r}, {self.consumer_name!r})"

    @property
    def segment_ids(self) -> list[int]:
        """The segments assigned to this consumer now."""
        return sorted(self._wanted)

    @property
    def connected_segment_ids(self) -> list[int]:
        """The assigned segments whose internal consumer is subscribed."""
        return sorted(self._segments)

    # --- controller ------------------------------------------------------------------------

    async def _start(self) -> None:
        try:
            await self._registration.start()
        except BaseException:
            await self.close()
            raise

    # --- assignment ------------------------------------------------------------------------

    def _assign(self, assignment: pb.ScalableConsumerAssignment) -> None:
        if self._closing:
            return
        self.layout_epoch = int(assignment.layout_epoch)
        self.assignment_updates += 1
        wanted = {int(s.segment_id): s.segment_topic for s in assignment.segments}
        joined, left = diff_assignment(self._wanted, wanted)
        self._wanted = wanted
        log.debug("%s: assignment %s (+%s -%s)", self, sorted(wanted), sorted(joined), left)
        for segment_id in left:
            self._leave(segment_id)
        for segment_id, topic in joined.items():
            self._start_join(segment_id, topic)
        self._notify()

    def _start_join(self, segment_id: int, topic: str) -> None:
        task = asyncio.get_running_loop().create_task(self._join(segment_id, topic))
        self._opening[segment_id] = task

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _on_segment_end(self, consumer: SegmentConsumer) -> None:
        self._notify()

    def _on_segment_reconnect(self, consumer: StreamSegmentConsumer, dropped: int) -> None:
        """A reconnect dropped ``dropped`` queued messages of the segment, which come again:
        its joined descendants, whose messages queued behind them, join again through the
        gate (what the application took of theirs comes again after the ancestor's)."""
        if not dropped:
            return
        layout = self._session.layout
        for segment_id, topic in sorted(self._wanted.items()):
            joined = segment_id in self._segments and segment_id in layout.segments
            if joined and consumer.segment_id in layout.ancestors(segment_id):
                self._leave(segment_id)
                self._start_join(segment_id, topic)
        self._notify()

    async def _ancestors_ended(self, segment_id: int, topic: str) -> bool:
        """Wait until every ancestor of the segment that this consumer holds has handed out
        its last message; False if the segment left the share meanwhile.

        The controller carries a child to the consumer of its undrained parents before they
        drain (module docstring): joining it only now puts all of their messages in the
        inbox before any of the child's."""
        while not self._closing and self._wanted.get(segment_id) == topic:
            changed, layout = self._changed, self._session.layout
            if segment_id not in layout.segments:  # the assignment ran ahead of the DAG watch
                await self._session.wait_for_change(layout.epoch)
                continue
            held = [a for a in layout.ancestors(segment_id) if a in self._wanted]
            if all(
                (c := self._segments.get(a)) is not None and c.reached_end_of_topic for a in held
            ):
                return True
            await changed.wait()
        return False

    def _leave(self, segment_id: int) -> None:
        task = self._opening.pop(segment_id, None)
        if task is not None:
            task.cancel()
        consumer = self._segments.pop(segment_id, None)
        self._topics.pop(segment_id, None)
        self._log.forget(segment_id)
        if consumer is None:
            return
        self._by_consumer_id.pop(consumer._id, None)
        # Its queued messages go to the segment's next owner (the broker redelivers them).
        self._inbox.remove_where(lambda m: m._consumer_id == consumer._id)
        task = asyncio.get_running_loop().create_task(self._close_segment(consumer))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _close_segment(consumer: Consumer) -> None:
        with contextlib.suppress(AnabranchError):
            await consumer.close()

    async def _join(self, segment_id: int, topic: str) -> None:
        """Subscribe Exclusive to the segment, retrying while its last owner holds it."""
        backoff = Backoff(
            CLIENT_RECONNECT_BACKOFF_MIN_S, STREAM_CONSUMER_RESUBSCRIBE_MAX_S, self._pool.random
        )
        try:
            if not await self._ancestors_ended(segment_id, topic):
                return
            while not self._closing and self._wanted.get(segment_id) == topic:
                consumer = StreamSegmentConsumer(
                    segment_id,
                    self._on_segment_end,
                    self._on_segment_reconnect,
                    self._pool,
                    topic,
                    self.subscription,
                    self.options.segment_options(self.consumer_name),
                    inbox=self._inbox,
                )
                consumer._segment_stamp = segment_id
                consumer._display_topic = self.topic
                try:
                    await consumer._start()
                except (ConsumerBusy, ServiceNotReady) as err:
                    log.debug("%s: segment %d not free yet: %s", self, segment_id, err)
                    await asyncio.sleep(backoff.next())
                    continue
                except NotFound as err:
                    log.warning("%s: segment %d is gone: %s", self, segment_id, err)
                    return
                except AnabranchError as err:
                    log.warning("%s: segment %d: %s; retrying", self, segment_id, err)
                    await asyncio.sleep(backoff.next())
                    continue
                if self._closing or self._wanted.get(segment_id) != topic:
                    await self._close_segment(consumer)
                    return
                self._segments[segment_id] = consumer
                self._topics[segment_id] = topic
                self._by_consumer_id[consumer._id] = (consumer, segment_id)
                self._notify()  # it may have ended before it was stored here
                return
        finally:
            if self._opening.get(segment_id) is asyncio.current_task():
                del self._opening[segment_id]

    # --- receiving and acknowledging ------------------------------------------------------

    async def receive(self, timeout: float | None = None) -> Message | None:  # noqa: ASYNC109 (fixed API)
        """The next message from any assigned segment, or None after ``timeout`` seconds.

        ``message_id.segment_id`` names the segment; ``topic`` is the ``topic://`` name.
        """
        if self._closing:
            raise Closed(f"{self} is closed")
        inbox, owners = self._inbox, self._by_consumer_id
        items = inbox._items
        # What is queued is taken without a wait (get_owned's work, inline: per message).
        owner = None
        while items and owner is None:
            raw = items.popleft()
            owner = owners.get(raw._entry.consumer_id)
        if owner is None:
            got = await inbox.get_owned(inbox.deadline(timeout), owners)
            if got is None:
                return None
            raw, owner = got
        consumer, segment_id = owner
        consumer._on_dequeued(raw)
        if not self._key_shared:  # individual acks need no position vector
            self._log.record((segment_id, raw))
        return raw  # its consumer stamped the segment id and the topic:// name

    async def acknowledge(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        """Acknowledge this one message (on its segment); the way to acknowledge in
        Key_Shared dispatch mode. A message of a segment this consumer no longer holds is
        ignored: the segment's new owner gets it again.

        Example::

            msg = await stream.receive()
            await stream.acknowledge(msg)
        """
        mid = message.message_id if isinstance(message, Message) else message
        if mid.segment_id is None:
            raise InvalidArgument(f"{mid} names no segment of {self.topic}")
        consumer = self._segments.get(mid.segment_id)
        if consumer is not None:  # its ids carry their segment (``_segment_stamp``)
            await consumer.acknowledge(message, txn)

    async def acknowledge_cumulative(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        """Acknowledge this message and, on every assigned segment, everything received
        before it (see the module docstring).

        With ``txn`` each segment's cumulative ack is part of that transaction (sent
        together, each awaiting its ACK_RESPONSE); they take effect when it commits.

        Example::

            async with client.transaction(timeout=30) as txn:
                await out.send(transform(msg.value), key=msg.key, txn=txn)
                await stream.acknowledge_cumulative(msg, txn=txn)
        """
        mid = message.message_id if isinstance(message, Message) else message
        if mid.segment_id is None:
            raise InvalidArgument(f"{mid} names no segment of {self.topic}")
        if self._key_shared:
            raise InvalidArgument(
                "a cumulative ack is not allowed in Key_Shared dispatch mode: use acknowledge"
            )
        if txn is not None:
            txn._check_usable()  # before the delivery log forgets what the ack covers
        acks = [
            (consumer, upto)
            for segment_id, upto in self._log.ack_upto(mid.segment_id, message).items()
            if (consumer := self._segments.get(segment_id)) is not None
        ]
        if txn is None:
            for consumer, upto in acks:
                await consumer.acknowledge_cumulative(upto)
            return
        results = await asyncio.gather(
            *(consumer.acknowledge_cumulative(upto, txn) for consumer, upto in acks),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    # --- closing ---------------------------------------------------------------------------

    async def close(self, *, leave: bool = True) -> None:
        """Close every segment's consumer, the registration and the DAG session.

        ``leave=True`` (the default) leaves the subscription: the controller deals this
        consumer's segments to the others at once. ``leave=False`` only disconnects: the
        controller keeps the segments for its grace period, so a restart with the same
        ``consumer_name`` gets them back without a rebalance (a planned restart).
        """
        if self._closing:
            return
        self._closing = True
        self._notify()
        self._inbox.shutdown()
        tasks = [*self._opening.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(self._segments, self._by_consumer_id, *self._background)
        if leave:
            await self._registration.close()
        else:
            await self._registration.disconnect()
        await self._session.close()


__all__ = [
    "DeliveryLog",
    "StreamConsumer",
    "StreamConsumerOptions",
    "StreamDispatchMode",
    "StreamSegmentConsumer",
    "diff_assignment",
    "leader_url",
]

"""The queue consumer of a scalable topic: Shared dispatch over every segment of the DAG.

Theory of operation
-------------------
A queue consumer never registers with the controller (upstream's ``QueueConsumer``): it
subscribes **Shared** to *every* segment in the DAG, active and sealed, and follows the
DAG session for new ones. Order across keys is not kept (that is what the stream and
checkpoint consumers are for); each message is delivered to one consumer of the
subscription and stays unacknowledged until acked, negatively acked (redelivered after
``nack_redelivery_delay_s``) or timed out (``ack_timeout_s``).

- Segments in the DAG when the consumer starts use ``initial_position``; segments that
  appear later (split and merge children) start at EARLIEST, so nothing produced after
  a split is missed.
- A sealed segment's consumer retires once the broker reported its end, this consumer
  holds none of its messages, and the subscription's mark-delete position reached the
  segment's last message (every consumer of the subscription acked it all). Segments
  that leave the DAG are closed.
- Dead letters: with ``max_redeliveries`` > 0, a message negatively acknowledged when its
  redelivery count is already ``max_redeliveries`` (or received beyond it, after ack
  timeouts) is published to ``dead_letter_topic`` (default
  ``persistent://<tenant>/<ns>/<topic>-<subscription>-DLQ``, upstream's
  ``<topic>-<subscription>-DLQ`` naming) with properties ``REAL_TOPIC`` and
  ``ORIGIN_MESSAGE_ID``, then acknowledged.
- Negative-ack backoff: with ``nack_backoff_max_s`` > 0 the redelivery delay doubles with
  each redelivery of the message, from ``nack_redelivery_delay_s`` up to that cap.

Message ids carry ``segment_id``; ``Message.topic`` is the scalable ``topic://`` name.

Example (with a client)::

    queue = await client.subscribe_queue("topic://public/default/jobs", subscription="work",
                                         initial_position="earliest", max_redeliveries=3)
    msg = await queue.receive(timeout=1.0)
    if msg is not None:
        await queue.acknowledge(msg)
    await queue.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from anabranch.client.connection import ConnectionPool
from anabranch.client.consumer import (
    NACK_REDELIVERY_DELAY_S,
    Consumer,
    ConsumerOptions,
    InitialPosition,
    SubscriptionType,
)
from anabranch.client.message import Message
from anabranch.client.message_id import MessageId
from anabranch.client.segment_consumers import CountingInbox, close_all, stop_task, wake_or_change
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import SegmentLayout, segment_name
from anabranch.errors import AnabranchError, Closed, InvalidArgument
from anabranch.limits import CONSUMER_RECEIVER_QUEUE_MESSAGES
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame

if TYPE_CHECKING:
    from anabranch.client.transaction import Transaction

log = logging.getLogger(__name__)
T = pb.BaseCommand

DRAIN_CHECK_INTERVAL_S = 1.0
"""How often sealed segments are checked for being fully acknowledged (to retire them)."""

REAL_TOPIC = "REAL_TOPIC"
ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
"""Properties a dead-lettered message carries (upstream ``RetryMessageUtil`` names)."""


class LayoutSource(Protocol):
    """The DAG of one scalable topic, kept current by a DAG-watch session."""

    @property
    def topic(self) -> TopicName:
        """The canonical ``topic://`` name."""
        ...

    @property
    def layout(self) -> SegmentLayout:
        """The latest layout received."""
        ...

    async def wait_for_change(self, epoch: int) -> SegmentLayout:
        """A layout with an epoch above ``epoch`` (raises ``Closed`` once closed)."""
        ...

    async def close(self) -> None:
        """End the session."""
        ...


class DeadLetterProducer(Protocol):
    """What a dead-letter topic needs of a producer."""

    async def send(
        self, value: bytes, *, key: str | None = None, properties: Mapping[str, str] | None = None
    ) -> MessageId: ...

    async def close(self) -> None: ...


ProducerFactory = Callable[[str], Awaitable[DeadLetterProducer]]


def dead_letter_topic_name(topic: TopicName, subscription: str) -> str:
    """The default dead-letter topic: a persistent topic beside the scalable one.

    Example:
        >>> t = TopicName.parse("topic://public/default/jobs")
        >>> dead_letter_topic_name(t, "work")
        'persistent://public/default/jobs-work-DLQ'
    """
    local = f"{topic.local_name}-{subscription}-DLQ"
    return f"persistent://{topic.tenant}/{topic.namespace}/{local}"


@dataclass(frozen=True, slots=True)
class QueueConsumerOptions:
    """Queue consumer settings (the keyword arguments of ``subscribe_queue``).

    Example:
        >>> QueueConsumerOptions(initial_position="earliest").initial_position
        <InitialPosition.EARLIEST: 1>
    """

    consumer_name: str | None = None
    initial_position: InitialPosition = InitialPosition.LATEST
    receiver_queue_size: int = CONSUMER_RECEIVER_QUEUE_MESSAGES
    ack_timeout_s: float = 0.0
    nack_redelivery_delay_s: float = NACK_REDELIVERY_DELAY_S
    nack_backoff_max_s: float = 0.0
    max_redeliveries: int = 0
    dead_letter_topic: str | None = None
    priority_level: int | None = None
    properties: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # ConsumerOptions validates the shared fields and parses the enum.
        checked = self.segment_options(self.initial_position)
        object.__setattr__(self, "initial_position", checked.initial_position)
        if self.max_redeliveries < 0:
            raise InvalidArgument("max_redeliveries must be >= 0")
        if self.nack_backoff_max_s < 0:
            raise InvalidArgument("nack_backoff_max_s must be >= 0")

    def nack_delay_s(self, redelivery_count: int) -> float:
        """How long a negatively acknowledged message waits before it comes again.

        Fixed ``nack_redelivery_delay_s``, or with ``nack_backoff_max_s`` > 0 doubling per
        earlier redelivery up to that cap (upstream's multiplier redelivery backoff).

        Example:
            >>> o = QueueConsumerOptions(nack_redelivery_delay_s=1, nack_backoff_max_s=5)
            >>> [o.nack_delay_s(n) for n in range(5)]
            [1, 2, 4, 5, 5]
        """
        base = self.nack_redelivery_delay_s
        if not self.nack_backoff_max_s:
            return base
        return min(base * (1 << min(redelivery_count, 32)), self.nack_backoff_max_s)

    def segment_options(self, initial_position: InitialPosition) -> ConsumerOptions:
        """The Shared options of one segment's consumer."""
        return ConsumerOptions(
            subscription_type=SubscriptionType.SHARED,
            consumer_name=self.consumer_name,
            initial_position=initial_position,
            receiver_queue_size=self.receiver_queue_size,
            ack_timeout_s=self.ack_timeout_s,
            nack_redelivery_delay_s=self.nack_redelivery_delay_s,
            priority_level=self.priority_level,
            properties=self.properties,
        )

    @staticmethod
    def from_kwargs(kwargs: Mapping[str, Any]) -> QueueConsumerOptions:
        """Build from keyword arguments (unknown names raise ``InvalidArgument``)."""
        try:
            return QueueConsumerOptions(**kwargs)
        except TypeError as err:
            raise InvalidArgument(f"bad queue consumer option: {err}") from err


class SegmentConsumer(Consumer):
    """A Consumer of one segment that reports REACHED_END_OF_TOPIC to its owner."""

    def __init__(
        self,
        segment_id: int,
        on_end: Callable[[SegmentConsumer], None],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.segment_id = segment_id
        self._on_end = on_end

    def on_frame(self, frame: Frame) -> None:
        super().on_frame(frame)
        if frame.type == T.REACHED_END_OF_TOPIC:
            self._on_end(self)

    async def _connect_once(self) -> None:
        # A reconnect resends what was queued; the end is reported again after it.
        self.reached_end_of_topic = False
        await super()._connect_once()

    def negative_acknowledge_after(self, message_id: MessageId, delay_s: float) -> None:
        """Like ``negative_acknowledge`` with this message's own delay."""
        entry = message_id.entry
        self._unacked.pop(entry, None)
        self._nacked[entry] = time.monotonic() + delay_s
        self._ensure_timer()

    async def drain_state(self) -> tuple[MessageId, MessageId]:
        """(last message id, subscription mark-delete position) from GET_LAST_MESSAGE_ID."""

        def build(request_id: int) -> pb.BaseCommand:
            body = pb.CommandGetLastMessageId(consumer_id=self._id, request_id=request_id)
            return pb.BaseCommand(type=T.GET_LAST_MESSAGE_ID, getLastMessageId=body)

        answer = (await self._request(build)).command.getLastMessageIdResponse
        return (
            MessageId.from_proto(answer.last_message_id).entry,
            MessageId.from_proto(answer.consumer_mark_delete_position).entry,
        )


def in_segment(message: Message, segment_id: int, topic: str) -> Message:
    """``message`` as the application sees it: the scalable topic and the segment id."""
    mid = dataclasses.replace(message.message_id, segment_id=segment_id)
    return message.relocated(mid, topic)


def _inner_id(mid: MessageId) -> MessageId:
    return dataclasses.replace(mid, segment_id=None)


class QueueConsumer:
    """Shared consumption of every segment of a scalable topic (see the module docstring)."""

    def __init__(
        self,
        pool: ConnectionPool,
        source: LayoutSource,
        subscription: str,
        options: QueueConsumerOptions,
        producer_factory: ProducerFactory | None = None,
    ) -> None:
        self._pool = pool
        self._source = source
        self.topic = str(source.topic)
        self.subscription = subscription
        self.options = options
        self._producer_factory = producer_factory
        self._inbox = CountingInbox()
        self._segments: dict[int, SegmentConsumer] = {}
        self._by_consumer_id: dict[int, SegmentConsumer] = {}
        self._outstanding: dict[int, set[MessageId]] = {}
        self._retired: set[int] = set()
        self._initial: frozenset[int] = frozenset()
        self._epoch = -1
        self._watcher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._dlq: DeadLetterProducer | None = None
        self._dlq_lock = asyncio.Lock()
        self._closed = False
        self.dead_letter_topic = options.dead_letter_topic or dead_letter_topic_name(
            source.topic, subscription
        )

    def __repr__(self) -> str:
        return f"QueueConsumer({self.topic!r}, {self.subscription!r})"

    @property
    def segment_ids(self) -> list[int]:
        """Ids of the segments this consumer is subscribed to now."""
        return sorted(self._segments)

    # --- segments --------------------------------------------------------------------------

    async def _start(self) -> None:
        layout = self._source.layout
        self._initial = frozenset(layout.segments)
        try:
            await self._follow(layout)
        except BaseException:
            await self.close()
            raise
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def _position_for(self, segment_id: int) -> InitialPosition:
        """Segments of the first layout seen use ``initial_position``; later ones EARLIEST."""
        if segment_id in self._initial:
            return self.options.initial_position
        return InitialPosition.EARLIEST

    async def _follow(self, layout: SegmentLayout) -> None:
        """Subscribe to segments new in ``layout`` (or not subscribed yet after an error);
        close those that left it."""
        self._epoch = max(self._epoch, layout.epoch)
        topic = self._source.topic
        skip = self._segments.keys() | self._retired
        new = [s for s in layout if s.segment_id not in skip]
        consumers = [
            SegmentConsumer(
                s.segment_id,
                self._on_segment_end,
                self._pool,
                str(segment_name(topic, s)),
                self.subscription,
                self.options.segment_options(self._position_for(s.segment_id)),
                inbox=self._inbox,
            )
            for s in new
        ]
        for c in consumers:
            self._segments[c.segment_id] = c
            self._by_consumer_id[c._id] = c
            self._outstanding.setdefault(c.segment_id, set())
        results = await asyncio.gather(*(c._start() for c in consumers), return_exceptions=True)
        for c, result in zip(consumers, results, strict=True):
            if isinstance(result, BaseException):
                self._forget(c)
                if not isinstance(result, AnabranchError):
                    raise result
                log.warning("%s: segment %d not subscribed: %s", self, c.segment_id, result)
        for seg_id in [i for i in self._segments if i not in layout.segments]:
            await self._retire(self._segments[seg_id])

    def _forget(self, consumer: SegmentConsumer) -> None:
        self._segments.pop(consumer.segment_id, None)
        self._by_consumer_id.pop(consumer._id, None)

    async def _retire(self, consumer: SegmentConsumer) -> None:
        self._forget(consumer)
        self._retired.add(consumer.segment_id)
        self._outstanding.pop(consumer.segment_id, None)
        with contextlib.suppress(AnabranchError):
            await consumer.close()

    def _on_segment_end(self, consumer: SegmentConsumer) -> None:
        self._wake.set()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        change: asyncio.Task[SegmentLayout] | None = None
        try:
            while not self._closed:
                if change is None:
                    change = loop.create_task(self._source.wait_for_change(self._epoch))
                await wake_or_change(change, self._wake, DRAIN_CHECK_INTERVAL_S)
                if change.done():
                    finished, change = change, None
                    finished.result()  # Closed ends the watcher
                try:
                    await self._follow(self._source.layout)
                    await self._retire_drained()
                except AnabranchError as err:
                    log.warning("%s: following the DAG failed (retrying): %s", self, err)
        except (Closed, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("%s: DAG watcher failed", self)
        finally:
            if change is not None:
                change.cancel()

    async def _retire_drained(self) -> None:
        layout = self._source.layout
        for seg_id, consumer in list(self._segments.items()):
            segment = layout.segments.get(seg_id)
            if segment is None or segment.is_active or not consumer.reached_end_of_topic:
                continue
            if self._outstanding.get(seg_id) or self._inbox.queued(consumer._id):
                continue
            try:
                last, mark_delete = await consumer.drain_state()
            except AnabranchError:
                continue
            if last.entry_id < 0 or mark_delete >= last:
                log.debug("%s: segment %d drained, retiring it", self, seg_id)
                await self._retire(consumer)

    # --- receiving -------------------------------------------------------------------------

    async def receive(self, timeout: float | None = None) -> Message | None:  # noqa: ASYNC109 (fixed API)
        """The next message from any segment, or None after ``timeout`` seconds."""
        if self._closed:
            raise Closed(f"{self} is closed")
        deadline = self._inbox.deadline(timeout)
        while (got := await self._inbox.get_owned(deadline, self._by_consumer_id)) is not None:
            raw, consumer = got
            consumer._on_dequeued(raw)
            if self.options.ack_timeout_s:
                consumer._wake_timer.set()  # its timer may sleep a whole tick otherwise
            msg = in_segment(raw, consumer.segment_id, self.topic)
            limit = self.options.max_redeliveries
            if limit and msg.redelivery_count > limit:
                await self._dead_letter(msg)
                continue
            self._outstanding[consumer.segment_id].add(raw.message_id)
            return msg
        return None

    def _owner(self, message: Message | MessageId) -> tuple[SegmentConsumer | None, MessageId]:
        mid = message.message_id if isinstance(message, Message) else message
        if mid.segment_id is None:
            raise InvalidArgument(f"{mid} names no segment of {self.topic}")
        return self._segments.get(mid.segment_id), _inner_id(mid)

    async def acknowledge(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        """Acknowledge one message (individual ack on its segment).

        With ``txn`` the ack is part of that transaction (see ``Consumer.acknowledge``).

        Example::

            async with client.transaction(timeout=30) as txn:
                await out.send(b"result", txn=txn)
                await queue.acknowledge(msg, txn=txn)
        """
        if txn is not None:
            txn._check_usable()
        consumer, inner = self._owner(message)
        if consumer is None:
            return  # the segment is gone; its messages cannot come back
        self._outstanding[consumer.segment_id].discard(inner)
        await consumer.acknowledge(inner, txn)
        if consumer.reached_end_of_topic and not self._outstanding[consumer.segment_id]:
            self._wake.set()

    async def negative_acknowledge(self, message: Message | MessageId) -> None:
        """Redeliver after ``nack_redelivery_delay_s``; dead-letter it past the limit."""
        consumer, inner = self._owner(message)
        if consumer is None:
            return
        limit = self.options.max_redeliveries
        if isinstance(message, Message) and limit and message.redelivery_count >= limit:
            await self._dead_letter(message)
            return
        self._outstanding[consumer.segment_id].discard(inner)
        count = message.redelivery_count if isinstance(message, Message) else 0
        consumer.negative_acknowledge_after(inner, self.options.nack_delay_s(count))

    async def _dead_letter(self, msg: Message) -> None:
        producer = await self._dead_letter_producer()
        properties = dict(msg.properties)
        properties.setdefault(REAL_TOPIC, self.topic)
        mid = msg.message_id
        properties.setdefault(
            ORIGIN_MESSAGE_ID, f"{mid.segment_id}:{mid.ledger_id}:{mid.entry_id}:{mid.batch_index}"
        )
        await producer.send(msg.value, key=msg.key, properties=properties)
        consumer, inner = self._owner(msg)
        if consumer is not None:
            self._outstanding[consumer.segment_id].discard(inner)
            await consumer.acknowledge(inner)

    async def _dead_letter_producer(self) -> DeadLetterProducer:
        async with self._dlq_lock:
            if self._dlq is None:
                if self._producer_factory is None:
                    raise InvalidArgument(f"{self} has no producer for its dead-letter topic")
                self._dlq = await self._producer_factory(self.dead_letter_topic)
            return self._dlq

    # --- closing ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Close every segment's consumer (unacked messages go back) and the DAG session."""
        if self._closed:
            return
        self._closed = True
        self._inbox.shutdown()
        watcher, self._watcher = self._watcher, None
        await stop_task(watcher)
        await close_all(self._segments, self._by_consumer_id)
        if self._dlq is not None:
            with contextlib.suppress(AnabranchError):
                await self._dlq.close()
        await self._source.close()

"""Async consumers: receiver queue with FLOW permits, acks, nacks, ack timeout, seek.

Theory of operation: after SUBSCRIBE the consumer grants ``receiver_queue_size`` FLOW
permits; each MESSAGE (a batch is unpacked into its messages) lands in the inbox, and every
message the application takes out (or that is filtered away) counts as consumed; at half
the queue size the consumed count is granted back in one FLOW. Acks are fire-and-forget
like upstream's default: an ack lost with a connection only causes a redelivery.

- Batch entries are acked when every delivered message of the batch is acked (upstream's
  default with batch-index acks off); the broker's ``ack_set`` in MESSAGE skips messages
  it already has acks for.
- ``negative_acknowledge`` and the ack timeout both end in REDELIVER_UNACKNOWLEDGED_MESSAGES:
  per entry for Shared/Key_Shared; for Exclusive/Failover (where the broker redelivers in
  order only) the whole unacked set is redelivered and the local queue is cleared.
- A reconnect resubscribes, clears the local queue (the broker redelivers everything
  unacked) and grants fresh permits; a reader resubscribes from its last received id.

Example (with a client)::

    consumer = await client.subscribe(topic, "sub", subscription_type="shared")
    msg = await consumer.receive(timeout=1.0)
    if msg is not None:
        await consumer.acknowledge(msg)
    await consumer.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from anabranch.client._reconnect import ReconnectingHandler
from anabranch.client.connection import ConnectionPool
from anabranch.client.errors import ConnectionClosed, from_server_error
from anabranch.client.message import EntryInfo, Message, batch_message, single_message
from anabranch.client.message_id import MessageId
from anabranch.errors import AnabranchError, Closed, InvalidArgument, NotAllowed
from anabranch.limits import CONSUMER_RECEIVER_QUEUE_MESSAGES
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.batch import compacted_out, split_batch
from anabranch.protocol.compression import decompress
from anabranch.protocol.frames import Frame

if TYPE_CHECKING:
    from anabranch.client.transaction import Transaction

log = logging.getLogger(__name__)
T = pb.BaseCommand

UNCOMPRESSED_BYTES_MAX = 64 * 1024 * 1024
"""Largest payload a compressed message may expand to; larger is dropped as corrupt (a
decompression bomb). Well above any batch a producer builds under the 5 MiB message cap."""

ACK_GROUP_MAX = 1000
"""Most individual acks sent in one ACK (upstream's maxAcknowledgmentGroupSize)."""

NACK_REDELIVERY_DELAY_S = 60.0
"""Default delay before a negatively acknowledged message is redelivered (upstream 1 min)."""

TIMER_TICK_MAX_S = 1.0
"""Longest sleep of the ack-timeout/nack timer: redeliveries are at most this late."""


class SubscriptionType(IntEnum):
    """``CommandSubscribe.SubType``."""

    EXCLUSIVE = 0
    SHARED = 1
    FAILOVER = 2
    KEY_SHARED = 3


class InitialPosition(IntEnum):
    """Where a new subscription starts."""

    LATEST = 0
    EARLIEST = 1


def _enum(cls: Any, value: Any) -> Any:
    if isinstance(value, str):
        try:
            return cls[value.upper()]
        except KeyError:
            raise InvalidArgument(f"unknown {cls.__name__} {value!r}") from None
    return cls(value)


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    """Consumer settings (the keyword arguments of ``subscribe``).

    Example:
        >>> ConsumerOptions(subscription_type="key_shared").subscription_type
        <SubscriptionType.KEY_SHARED: 3>
    """

    subscription_type: SubscriptionType = SubscriptionType.EXCLUSIVE
    consumer_name: str | None = None
    initial_position: InitialPosition = InitialPosition.LATEST
    receiver_queue_size: int = CONSUMER_RECEIVER_QUEUE_MESSAGES
    ack_timeout_s: float = 0.0
    nack_redelivery_delay_s: float = NACK_REDELIVERY_DELAY_S
    priority_level: int | None = None
    properties: Mapping[str, str] = field(default_factory=dict)
    read_compacted: bool = False
    """Read the topic's compacted view (latest message per key) up to its compaction
    horizon, then the topic (Exclusive/Failover only: the broker refuses others)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "subscription_type", _enum(SubscriptionType, self.subscription_type)
        )
        object.__setattr__(self, "initial_position", _enum(InitialPosition, self.initial_position))
        if self.receiver_queue_size < 1:
            raise InvalidArgument("receiver_queue_size must be >= 1")
        if self.ack_timeout_s < 0 or self.nack_redelivery_delay_s < 0:
            raise InvalidArgument("ack_timeout_s and nack_redelivery_delay_s must be >= 0")

    @staticmethod
    def from_kwargs(kwargs: Mapping[str, Any]) -> ConsumerOptions:
        """Build from ``subscribe`` keyword arguments (unknown names raise)."""
        try:
            return ConsumerOptions(**kwargs)
        except TypeError as err:
            raise InvalidArgument(f"bad consumer option: {err}") from err


class Inbox:
    """Received messages waiting for ``receive``; shared by a partitioned consumer's parts.

    A waiting receiver sleeps on a plain future (with a timer for its timeout), not on a
    task per call: a tailing consumer waits once per message."""

    def __init__(self) -> None:
        self._items: deque[Message] = deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, messages: list[Message]) -> None:
        """Append messages and wake receivers."""
        if messages:
            self._items.extend(messages)
            self._wake_all()

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def get(self, timeout: float | None) -> Message | None:  # noqa: ASYNC109
        """The next message, or None after ``timeout`` seconds (None: wait forever)."""
        if self._items:
            return self._items.popleft()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._items:
            if self._closed:
                raise Closed("the consumer is closed")
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            timer = None if remaining is None else loop.call_later(remaining, _wake, waiter)
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()
                if not waiter.done():
                    waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        return self._items.popleft()

    def remove_where(self, predicate: Callable[[Message], bool]) -> int:
        """Drop queued messages matching ``predicate``; returns how many."""
        kept = deque(m for m in self._items if not predicate(m))
        removed = len(self._items) - len(kept)
        self._items = kept
        return removed

    def close(self) -> None:
        """Wake every receiver with ``Closed``."""
        self._closed = True
        self._wake_all()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _now() -> float:
    return time.monotonic()


def _position(mid: MessageId) -> tuple[int, int, int]:
    return (mid.ledger_id, mid.entry_id, mid.batch_index)


class Consumer(ReconnectingHandler):
    """An async consumer of one subscription on one topic or partition."""

    def __init__(
        self,
        pool: ConnectionPool,
        topic: str,
        subscription: str,
        options: ConsumerOptions,
        *,
        partition: int = -1,
        inbox: Inbox | None = None,
        durable: bool = True,
        start_message_id: MessageId | None = None,
        start_inclusive: bool = False,
    ) -> None:
        super().__init__(pool, topic)
        self.subscription = subscription
        self.options = options
        self.partition = partition
        self._segment_stamp: int | None = None
        """Set by a stream consumer: the segment id every message id of this consumer
        carries (so its messages need no copy to name their segment)."""
        self._display_topic = topic
        """The topic name its messages carry (a stream consumer's: the ``topic://`` one)."""
        self.consumer_name = options.consumer_name or ""
        self.is_active: bool | None = None
        self.reached_end_of_topic = False
        self._id = pool.new_handler_id()
        self._inbox = inbox if inbox is not None else Inbox()
        self._plain_inbox = type(self._inbox) is Inbox
        self._durable = durable
        self._start_message_id = start_message_id
        self._filter_up_to: MessageId | None = None
        self._start_inclusive = start_inclusive
        if start_message_id is not None and start_message_id not in (
            MessageId.earliest(),
            MessageId.latest(),
        ):
            if not start_inclusive:
                self._filter_up_to = start_message_id
            elif start_message_id.batch_index > 0:
                # The broker sends the whole batch: skip the messages before the start.
                s = start_message_id
                self._filter_up_to = MessageId(s.ledger_id, s.entry_id, s.batch_index - 1)
        self._last_msg: Message | None = None
        """The last message the application took (its id is made only if needed)."""
        self._consumed = 0
        self._grant_at = max(1, options.receiver_queue_size // 2)
        self._epoch = 0
        self._batches: dict[MessageId, set[int]] = {}
        self._ack_group: list[pb.MessageIdData] = []
        """Individual acks not sent yet (see ``_send_ack``)."""
        self._generation = 0
        """Bumped whenever ``_batches`` is forgotten: an ``EntryInfo`` of an older
        generation no longer shares its pending set with ``_batches``."""
        self._unacked: dict[MessageId, float] = {}
        self._nacked: dict[MessageId, float] = {}
        self._timer: asyncio.Task[None] | None = None
        self._wake_timer = asyncio.Event()
        self._closed = False

    def __repr__(self) -> str:
        return f"Consumer({self.topic!r}, {self.subscription!r})"

    @property
    def _last_dequeued(self) -> MessageId | None:
        msg = self._last_msg
        return None if msg is None else msg.message_id

    def _forget_batches(self) -> None:
        self._batches.clear()
        self._generation += 1

    # --- connection ------------------------------------------------------------------------

    def _subscribe_command(self, request_id: int) -> pb.BaseCommand:
        opts = self.options
        cmd = commands.subscribe(
            self.topic,
            self.subscription,
            int(opts.subscription_type),
            self._id,
            request_id,
            initial_position=int(opts.initial_position),
        )
        body = cmd.subscribe
        if self.consumer_name:
            body.consumer_name = self.consumer_name
        if opts.priority_level is not None:
            body.priority_level = opts.priority_level
        for k, v in opts.properties.items():
            body.metadata.add(key=k, value=v)
        if opts.subscription_type == SubscriptionType.KEY_SHARED:
            body.keySharedMeta.keySharedMode = pb.AUTO_SPLIT
        body.consumer_epoch = self._epoch
        if opts.read_compacted:
            body.read_compacted = True
        if not self._durable:
            body.durable = False
            start = self._last_dequeued or self._start_message_id
            if start is not None:
                sentinel = start in (MessageId.earliest(), MessageId.latest())
                if self._last_dequeued is None and self._start_inclusive and not sentinel:
                    # The broker starts after the given id: name the entry before it.
                    start = MessageId(start.ledger_id, start.entry_id - 1, -1, start.partition)
                # Inside a batch the broker starts at the entry; the filter skips the rest.
                at = start if start.batch_index >= 0 else start.entry
                body.start_message_id.CopyFrom(at.to_proto())
        return cmd

    async def _connect_once(self) -> None:
        address = await self._pool.lookup(self.topic)
        conn = await self._pool.get(address)
        request_id = conn.new_request_id()
        conn.register_consumer(self._id, self)
        try:
            await conn.request(self._subscribe_command(request_id), request_id)
        except BaseException:
            conn.unregister_consumer(self._id)
            raise
        if self._closing:
            conn.unregister_consumer(self._id)
            raise Closed(f"{self} was closed while subscribing")
        # The broker redelivers everything unacked, so what is queued here would repeat.
        self._inbox.remove_where(self._owns)
        self._forget_batches()
        if self._last_dequeued is not None and not self._durable:
            self._filter_up_to = self._last_dequeued
        self._conn = conn
        self._consumed = 0
        conn.send_command(commands.flow(self._id, self.options.receiver_queue_size))
        if self._timer is None and (self.options.ack_timeout_s or self._nacked):
            self._ensure_timer()

    def _on_terminal_error(self, error: AnabranchError) -> None:
        self._closing = True
        self._inbox.close()

    def _owns(self, msg: Message) -> bool:
        return msg._consumer_id == self._id

    # --- receiving -------------------------------------------------------------------------

    def on_frame(self, frame: Frame) -> None:
        """MESSAGE, ACTIVE_CONSUMER_CHANGE, REACHED_END_OF_TOPIC from the broker."""
        if frame.type == T.MESSAGE:
            self._on_message(frame)
        elif frame.type == T.ACTIVE_CONSUMER_CHANGE:
            self.is_active = bool(frame.command.active_consumer_change.is_active)
        elif frame.type == T.REACHED_END_OF_TOPIC:
            self.reached_end_of_topic = True

    def _on_message(self, frame: Frame) -> None:
        body = frame.command.message
        if body.HasField("consumer_epoch") and body.consumer_epoch < self._epoch:
            return  # sent before a redeliver-all; it comes again under the new epoch
        md = frame.metadata
        if md is None or frame.checksum_ok is False:
            log.warning("%s: dropping a corrupt message %s", self, body.message_id)
            self._count_consumed(1)
            return
        try:
            messages = self._unpack(body, md, frame.payload)
        except AnabranchError as err:
            log.warning("%s: dropping an undecodable message: %s", self, err)
            self._count_consumed(max(1, int(md.num_messages_in_batch)))
            return
        self._inbox.put(messages)

    def _unpack(
        self, body: pb.CommandMessage, md: pb.MessageMetadata, payload: bytes
    ) -> list[Message]:
        payload = decompress(
            int(md.compression), payload, int(md.uncompressed_size), UNCOMPRESSED_BYTES_MAX
        )
        entry = MessageId.entry_from_proto(
            body.message_id, partition=self.partition, segment_id=self._segment_stamp
        )
        redeliveries = int(body.redelivery_count)
        if not md.HasField("num_messages_in_batch"):
            mid = entry
            if self._filtered(mid):
                self._count_consumed(1)
                return []
            return [self._message(payload, mid, md, redeliveries)]
        count = int(md.num_messages_in_batch)
        ack_set = list(body.ack_set)
        filtering = self._filter_up_to is not None
        # Per-message work is the consumer's cost: what the entry's messages share is read
        # once (EntryInfo), and each message's own metadata only when the application reads it.
        info = self._entry_info(entry, md, redeliveries, count)
        out: list[Message] = []
        append = out.append
        pending: set[int] = set()
        add = pending.add
        for index, (raw, value) in enumerate(split_batch(payload, count)):
            if (
                (ack_set and not (ack_set[index // 64] >> (index % 64)) & 1)
                or compacted_out(raw)
                or (filtering and self._filtered(MessageId(entry.ledger_id, entry.entry_id, index)))
            ):
                self._count_consumed(1)
                continue
            add(index)
            append(batch_message(value, info, index, raw))
        if out:
            self._batches[entry] = pending
            info.pending = pending
            info.generation = self._generation
        return out

    def _entry_info(
        self, entry: MessageId, md: pb.MessageMetadata, redeliveries: int, count: int = 0
    ) -> EntryInfo:
        return EntryInfo(
            self._display_topic,
            int(md.publish_time),
            md.producer_name,
            redeliveries,
            self._id,
            entry,
            count,
        )

    def _message(
        self, value: bytes, entry: MessageId, md: pb.MessageMetadata, redeliveries: int
    ) -> Message:
        """The message of a non-batched entry (its metadata is the entry's)."""
        return single_message(
            value,
            self._entry_info(entry, md, redeliveries),
            md.partition_key if md.HasField("partition_key") else None,
            {p.key: p.value for p in md.properties},
            int(md.event_time) or None,
            int(md.sequence_id),
        )

    def _filtered(self, mid: MessageId) -> bool:
        bound = self._filter_up_to
        if bound is None:
            return False
        if bound.batch_index < 0:
            return (mid.ledger_id, mid.entry_id) <= (bound.ledger_id, bound.entry_id)
        return _position(mid) <= _position(bound)

    def _count_consumed(self, count: int) -> None:
        self._consumed += count
        if self._consumed >= self._grant_at:
            self._grant(self._consumed)
            self._consumed = 0

    def _grant(self, permits: int) -> None:
        if self._conn is not None and permits > 0:
            with contextlib.suppress(AnabranchError):
                self._conn.send_command(commands.flow(self._id, permits))

    async def receive(self, timeout: float | None = None) -> Message | None:  # noqa: ASYNC109 (fixed API)
        """The next message, or None if none arrives within ``timeout`` seconds.

        Raises ``Closed`` once the consumer is closed.
        """
        if self._closing:
            raise Closed(f"{self} is closed")
        items = self._inbox._items
        # What is queued is taken without a wait (the common case of a consumer behind),
        # unless the inbox is a kind that keeps its own books on each get.
        if items and self._plain_inbox:
            msg: Message | None = items.popleft()
        else:
            msg = await self._inbox.get(timeout)
        if msg is not None:
            self._on_dequeued(msg)
        return msg

    def _on_dequeued(self, msg: Message) -> None:
        self._last_msg = msg
        if self.options.ack_timeout_s:
            self._unacked.setdefault(msg.message_id.entry, _now() + self.options.ack_timeout_s)
        self._count_consumed(1)

    # --- acknowledging ---------------------------------------------------------------------

    async def acknowledge(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        """Acknowledge one message (a batch entry is acked once all its messages are).

        With ``txn`` the ack is part of that transaction: it waits for the broker's
        ACK_RESPONSE and raises its typed refusal (e.g. ``TransactionConflict``); the ack
        takes effect when the transaction commits, and an abort redelivers the message.
        A batch entry is acked in the transaction that acks its last message.
        """
        if txn is None and type(message) is Message:
            info = message._entry
            pending = info.pending
            if info.consumer_id == self._id:
                if pending is not None and info.generation == self._generation:
                    # A message of a batch this consumer tracks: no id to build or look up.
                    pending.discard(message._index)
                    if not pending:
                        self._entry_acked(info)
                    return
                if message._index < 0 and info.position is not None:  # a non-batched one
                    self._entry_acked(info)
                    return
        elif txn is not None:
            txn._check_usable()
        mid = message.message_id if isinstance(message, Message) else message
        entry = mid.entry
        pending = self._batches.get(entry)
        if mid.batch_index >= 0 and pending is not None:
            pending.discard(mid.batch_index)
            if pending:
                return
            del self._batches[entry]
        self._unacked.pop(entry, None)
        self._nacked.pop(entry, None)
        if txn is None:
            self._send_ack([entry], cumulative=False)
        else:
            await self._ack_in(txn, [entry], cumulative=False)

    def _entry_acked(self, info: EntryInfo) -> None:
        entry = info.position
        assert entry is not None
        if info.pending is not None and self._batches.get(entry) is info.pending:
            del self._batches[entry]
        if self._unacked:
            self._unacked.pop(entry, None)
        if self._nacked:
            self._nacked.pop(entry, None)
        self._send_ack([entry], cumulative=False)

    async def acknowledge_cumulative(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        """Acknowledge this message and every earlier one (not on Shared/Key_Shared).

        ``txn``: as for :meth:`acknowledge` (an abort redelivers everything unacked).
        """
        if self.options.subscription_type in (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED):
            raise NotAllowed("cumulative acks are not allowed on Shared/Key_Shared subscriptions")
        if txn is not None:
            txn._check_usable()
        mid = message.message_id if isinstance(message, Message) else message
        entry = mid.entry
        whole = mid.batch_index < 0 or mid.batch_index >= mid.batch_size - 1
        # Inside a batch, ack up to the previous entry: the rest of this batch stays unacked.
        target = (
            entry
            if whole
            else MessageId(mid.ledger_id, mid.entry_id - 1, -1, mid.partition, mid.segment_id)
        )
        for tracked in (self._unacked, self._nacked, self._batches):
            for key in [k for k in tracked if k <= target]:
                del tracked[key]
        if txn is None:
            self._send_ack([target], cumulative=True)
        else:
            await self._ack_in(txn, [target], cumulative=True)

    def _send_ack(self, ids: list[MessageId], cumulative: bool) -> None:
        if self._conn is None:
            return  # lost with the connection: the broker redelivers
        if cumulative:
            self._flush_acks()
            with contextlib.suppress(AnabranchError):
                self._conn.send_command(
                    commands.ack(self._id, [i.to_proto() for i in ids], cumulative=True)
                )
            return
        # Individual acks made in one turn of the event loop (an application working
        # through its queue) go out as one ACK: one frame, one broker pass, like upstream's
        # ack grouping, but without its delay (the group ends with the loop's turn).
        group = self._ack_group
        if not group:
            asyncio.get_running_loop().call_soon(self._flush_acks)
        group.extend(i.to_proto() for i in ids)
        if len(group) >= ACK_GROUP_MAX:
            self._flush_acks()

    def _flush_acks(self) -> None:
        """Send the grouped individual acks (before anything they must precede: a
        redelivery, a seek, a close, a cumulative or transactional ack)."""
        group = self._ack_group
        if not group:
            return
        self._ack_group = []
        if self._conn is not None:
            with contextlib.suppress(AnabranchError):
                self._conn.send_command(commands.ack(self._id, group))

    async def _ack_in(self, txn: Transaction, ids: list[MessageId], cumulative: bool) -> None:
        """A transactional ACK (with a request id) and its ACK_RESPONSE; an abort of the
        transaction redelivers ``ids`` (upstream: the acks were undone). On Shared and
        Key_Shared the broker sends the acks it took again itself, so asking too would
        deliver each twice: only a refused ack is asked for here. Exclusive and Failover
        ask for everything unacked, in order."""
        redeliver = functools.partial(self._redeliver, ids)
        shared = self.options.subscription_type in (
            SubscriptionType.SHARED,
            SubscriptionType.KEY_SHARED,
        )
        if cumulative or not shared:
            txn._add_abort_hook(redeliver)
        try:
            await txn._run(functools.partial(self._ack_request, txn, ids, cumulative))
        except BaseException:
            if shared and not cumulative:
                txn._add_abort_hook(redeliver)  # the broker holds no ack of them to undo
            raise

    async def _ack_request(self, txn: Transaction, ids: list[MessageId], cumulative: bool) -> None:
        if self._closing:
            raise Closed(f"{self} is closed")
        conn = self._conn
        if conn is None:
            raise ConnectionClosed(f"{self} is reconnecting: transactional ack not sent")
        self._flush_acks()
        request_id = conn.new_request_id()
        cmd = commands.ack(
            self._id, [i.to_proto() for i in ids], cumulative=cumulative, request_id=request_id
        )
        cmd.ack.txnid_most_bits = txn.id.most_bits
        cmd.ack.txnid_least_bits = txn.id.least_bits
        answer = (await conn.request(cmd, request_id)).command.ackResponse
        if answer.HasField("error"):
            raise from_server_error(int(answer.error), answer.message)

    async def negative_acknowledge(self, message: Message | MessageId) -> None:
        """Ask for redelivery of this message after ``nack_redelivery_delay_s``."""
        mid = message.message_id if isinstance(message, Message) else message
        self._unacked.pop(mid.entry, None)
        self._nacked[mid.entry] = _now() + self.options.nack_redelivery_delay_s
        self._ensure_timer()

    # --- redelivery timer ------------------------------------------------------------------

    def _ensure_timer(self) -> None:
        if self._timer is None or self._timer.done():
            self._timer = asyncio.get_running_loop().create_task(self._timer_loop())
        self._wake_timer.set()

    async def _timer_loop(self) -> None:
        while not self._closing:
            deadlines = [*self._unacked.values(), *self._nacked.values()]
            now = _now()
            wait = TIMER_TICK_MAX_S if not deadlines else min(deadlines) - now
            if wait > 0:
                self._wake_timer.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake_timer.wait(), min(wait, TIMER_TICK_MAX_S))
                continue
            due = [k for k, t in self._unacked.items() if t <= now]
            due += [k for k, t in self._nacked.items() if t <= now]
            for key in due:
                self._unacked.pop(key, None)
                self._nacked.pop(key, None)
            self._redeliver(sorted(set(due)))

    def _redeliver(self, entries: list[MessageId]) -> None:
        if not entries or self._conn is None:
            return
        self._flush_acks()  # what was acked before must not come again
        body = pb.CommandRedeliverUnacknowledgedMessages(consumer_id=self._id)
        if self.options.subscription_type in (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED):
            body.message_ids.extend(e.to_proto() for e in entries)
        else:
            # Exclusive/Failover keep order: everything unacked comes again, so drop the
            # local queue and give its permits back (upstream redeliverUnacknowledgedMessages).
            self._epoch += 1
            body.consumer_epoch = self._epoch
            cleared = self._inbox.remove_where(self._owns)
            self._unacked.clear()
            self._forget_batches()
            self._grant(cleared)
        cmd = pb.BaseCommand(type=T.REDELIVER_UNACKNOWLEDGED_MESSAGES)
        cmd.redeliverUnacknowledgedMessages.CopyFrom(body)
        with contextlib.suppress(AnabranchError):
            self._conn.send_command(cmd)

    # --- requests --------------------------------------------------------------------------

    async def _request(self, build: Callable[[int], pb.BaseCommand]) -> Frame:
        if self._closing:
            raise Closed(f"{self} is closed")
        self._flush_acks()  # a seek, say, must not overtake acks made before it
        conn = self._conn
        if conn is None:
            raise ConnectionClosed(f"{self} is reconnecting")
        request_id = conn.new_request_id()
        return await conn.request(build(request_id), request_id)

    async def seek(self, target: MessageId | int) -> None:
        """Move the subscription to a message id (inclusive) or a publish time (ms)."""

        def build(request_id: int) -> pb.BaseCommand:
            body = pb.CommandSeek(consumer_id=self._id, request_id=request_id)
            if isinstance(target, MessageId):
                body.message_id.CopyFrom(target.entry.to_proto())
            else:
                body.message_publish_time = int(target)
            return pb.BaseCommand(type=T.SEEK, seek=body)

        await self._request(build)
        # What is queued predates the seek. A reader resumes from the target itself.
        self._epoch += 1
        cleared = self._inbox.remove_where(self._owns)
        self._forget_batches()
        self._unacked.clear()
        self._nacked.clear()
        self._last_msg = None
        self._filter_up_to = None
        if isinstance(target, MessageId):
            self._start_message_id = target
            self._start_inclusive = True
        self._grant(cleared)

    async def get_last_message_id(self) -> MessageId:
        """The id of the last message stored in the topic (GET_LAST_MESSAGE_ID)."""

        def build(request_id: int) -> pb.BaseCommand:
            body = pb.CommandGetLastMessageId(consumer_id=self._id, request_id=request_id)
            return pb.BaseCommand(type=T.GET_LAST_MESSAGE_ID, getLastMessageId=body)

        frame = await self._request(build)
        last = frame.command.getLastMessageIdResponse.last_message_id
        return MessageId.from_proto(last, partition=self.partition)

    def has_queued_messages(self) -> bool:
        """True if received messages are waiting in the local queue."""
        return len(self._inbox) > 0

    async def unsubscribe(self) -> None:
        """Delete the subscription on the broker, then close this consumer."""

        def build(request_id: int) -> pb.BaseCommand:
            body = pb.CommandUnsubscribe(consumer_id=self._id, request_id=request_id)
            return pb.BaseCommand(type=T.UNSUBSCRIBE, unsubscribe=body)

        await self._request(build)
        await self._close(send_close=False)

    async def close(self) -> None:
        """Close the consumer; unacked messages go back to the subscription. Idempotent."""
        await self._close(send_close=True)

    async def _close(self, send_close: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing = True
        self._inbox.close()
        await self._stop_reconnecting()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        self._flush_acks()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.unregister_consumer(self._id)
            if send_close:
                request_id = conn.new_request_id()
                with contextlib.suppress(AnabranchError):
                    await conn.request(commands.close_consumer(self._id, request_id), request_id)


class RoutedAcks:
    """Acks of a consumer made of several (partitions, matched topics): each goes to the
    consumer that owns the message (``_owner``; the owners are ordered separately)."""

    def _owner(self, message: Message | MessageId) -> Consumer:
        raise NotImplementedError

    async def acknowledge(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        """Acknowledge on the message's own consumer (``txn``: see ``Consumer.acknowledge``)."""
        await self._owner(message).acknowledge(message, txn)

    async def acknowledge_cumulative(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        """Cumulative ack on the message's own consumer (partitions and topics are ordered
        separately)."""
        await self._owner(message).acknowledge_cumulative(message, txn)

    async def negative_acknowledge(self, message: Message | MessageId) -> None:
        """Negative ack on the message's own consumer."""
        await self._owner(message).negative_acknowledge(message)


class PartitionedConsumer(RoutedAcks):
    """One subscription over every partition of a partitioned topic.

    The partitions' consumers share one inbox; acks go to the partition named in the
    message id. Seeking by publish time seeks every partition; by id, the id's partition.
    """

    def __init__(self, topic: str, consumers: list[Consumer], inbox: Inbox) -> None:
        self.topic = topic
        self.consumers = consumers
        self.subscription = consumers[0].subscription
        self._inbox = inbox
        self._by_id = {c._id: c for c in consumers}

    def _owner(self, message: Message | MessageId) -> Consumer:
        mid = message.message_id if isinstance(message, Message) else message
        if not 0 <= mid.partition < len(self.consumers):
            raise InvalidArgument(f"{mid} names no partition of {self.topic}")
        return self.consumers[mid.partition]

    async def receive(self, timeout: float | None = None) -> Message | None:  # noqa: ASYNC109 (fixed API)
        """The next message from any partition, or None after ``timeout`` seconds."""
        msg = await self._inbox.get(timeout)
        if msg is not None:
            self._by_id[msg._consumer_id]._on_dequeued(msg)
        return msg

    async def seek(self, target: MessageId | int) -> None:
        """Seek every partition to a publish time, or the id's partition to the id."""
        if isinstance(target, MessageId):
            await self._owner(target).seek(target)
        else:
            await asyncio.gather(*(c.seek(target) for c in self.consumers))

    async def unsubscribe(self) -> None:
        """Unsubscribe every partition."""
        await asyncio.gather(*(c.unsubscribe() for c in self.consumers))

    async def close(self) -> None:
        """Close every partition's consumer."""
        await asyncio.gather(*(c.close() for c in self.consumers))


async def subscribe(
    pool: ConnectionPool, topic: str, subscription: str, options: ConsumerOptions
) -> Consumer | PartitionedConsumer:
    """Subscribe (partitioned if the topic has partitions); returns once subscribed."""
    partitions = await pool.partitioned_metadata(topic)
    if partitions == 0:
        consumer = Consumer(pool, topic, subscription, options)
        await consumer._start()
        return consumer
    inbox = Inbox()
    consumers = [
        Consumer(pool, f"{topic}-partition-{i}", subscription, options, partition=i, inbox=inbox)
        for i in range(partitions)
    ]
    try:
        await asyncio.gather(*(c._start() for c in consumers))
    except BaseException:
        await asyncio.gather(*(c.close() for c in consumers), return_exceptions=True)
        raise
    return PartitionedConsumer(topic, consumers, inbox)

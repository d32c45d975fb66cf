"""Async producers: batching, compression, sequence ids, bounded pending queue, resend.

Theory of operation: ``send_async`` waits for room in the pending queue (one slot per
message, ``pending_messages_max``), assigns a sequence id and either appends the message
to the open batch or wraps it in its own SEND. A SEND ("op") is kept in ``_pending``, in
sequence order, until the broker's SEND_RECEIPT for its first sequence id resolves the
futures of its messages. After a reconnect every pending op is written again, in order;
the broker's dedup (producer name, sequence id) drops what it already stored. A receipt
for an id ahead of the head of the queue means a SEND was lost, so the connection is
closed and everything is resent (upstream's rule). SEND_ERROR with a retriable code
(checksum, not ready) does the same; any other code fails that op's futures with the
typed error. Sequence ids continue from the broker's ``last_sequence_id`` on the first
connect, unless ``initial_sequence_id`` is given.

A connection can also go silent without closing (the broker paused, or cut off by the
network): while SENDs are pending, a timer looks at the head of the queue a few times per
``operation_stuck_s``, and when the same op has waited that long on the same connection
it probes the connection (``ClientConnection.probe``). A connection that does not answer
is closed, and the reconnect above looks the topic up again (through another broker) and
resends the pending ops under their sequence ids and the same producer name, so the new
owner's dedup state, rebuilt from the topic's ledger, drops what the old owner stored.

Example (with a client)::

    producer = await client.create_producer("persistent://public/default/t")
    message_id = await producer.send(b"hello", key="k", properties={"a": "1"})
    future = await producer.send_async(b"more")   # waits only for room in the queue
    await producer.flush()
    await producer.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from anabranch.client._reconnect import ReconnectingHandler
from anabranch.client.connection import ClientConnection, ConnectionPool
from anabranch.client.errors import MessageTooBig, from_server_error
from anabranch.client.message_id import MessageId
from anabranch.client.pending_bound import PendingBound
from anabranch.client.routing import Hashing, Router
from anabranch.client.txn_join_ahead import JoinAhead
from anabranch.core.batch_keys import KEY_SLOTS_PROPERTY, NONE_KEY, encode_key_slots
from anabranch.core.txn_id import BRANCH_PROPERTY, TxnId
from anabranch.errors import AnabranchError, Closed, InvalidArgument
from anabranch.limits import (
    MESSAGE_SIZE_MAX_BYTES,
    PRODUCER_BATCH_BYTES_MAX,
    PRODUCER_BATCH_DELAY_S,
    PRODUCER_BATCH_MESSAGES_MAX,
    PRODUCER_PENDING_MESSAGES_MAX,
)
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.batch import join_batch, single_metadata
from anabranch.protocol.compression import CompressionType, compress
from anabranch.protocol.frames import Frame

if TYPE_CHECKING:
    from anabranch.client.transaction import Transaction

log = logging.getLogger(__name__)
T = pb.BaseCommand

BATCH_ENTRY_OVERHEAD_BYTES = 16
"""Rough size of one SingleMessageMetadata and its length prefix (batch-bytes accounting)."""


def _compression(value: str | int | CompressionType) -> CompressionType:
    if isinstance(value, str):
        try:
            return CompressionType[value.upper()]
        except KeyError:
            raise InvalidArgument(f"unknown compression {value!r}") from None
    return CompressionType(value)


@dataclass(frozen=True, slots=True)
class ProducerOptions:
    """Producer settings (the keyword arguments of ``create_producer``).

    Example:
        >>> ProducerOptions(compression="zstd").compression
        <CompressionType.ZSTD: 3>
    """

    producer_name: str | None = None
    batching: bool = True
    batch_messages_max: int = PRODUCER_BATCH_MESSAGES_MAX
    batch_bytes_max: int = PRODUCER_BATCH_BYTES_MAX
    batch_delay_s: float = PRODUCER_BATCH_DELAY_S
    compression: CompressionType = CompressionType.NONE
    pending_messages_max: int = PRODUCER_PENDING_MESSAGES_MAX
    block_if_queue_full: bool = True
    initial_sequence_id: int | None = None
    properties: Mapping[str, str] = field(default_factory=dict)
    hashing: Hashing = "java"

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", _compression(self.compression))
        if self.pending_messages_max < 1 or self.batch_messages_max < 1:
            raise InvalidArgument("pending_messages_max and batch_messages_max must be >= 1")

    @staticmethod
    def from_kwargs(kwargs: Mapping[str, Any]) -> ProducerOptions:
        """Build from ``create_producer`` keyword arguments (unknown names raise)."""
        try:
            return ProducerOptions(**kwargs)
        except TypeError as err:
            raise InvalidArgument(f"bad producer option: {err}") from err


class Completion(Protocol):
    """What a sent message's answer resolves: an ``asyncio.Future`` or, for a scalable
    topic's producer, its own per-message record (one completion per message instead of
    a future here plus one there and a callback between them)."""

    def done(self) -> bool: ...

    def set_result(self, result: MessageId, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


@dataclass(slots=True)
class _Op:
    """One SEND: a message or a batch, with a completion per message."""

    sequence_id: int
    highest_sequence_id: int
    metadata: pb.MessageMetadata
    payload: bytes
    futures: list[Completion]
    batched: bool
    txn: TxnId | None = None


@dataclass(slots=True)
class _Pending:
    """One message waiting in the open batch (plain fields: no protobuf object per message)."""

    value: bytes
    future: Completion
    sequence_id: int
    key: str | None
    event_time: int | None
    properties: tuple[tuple[str, str], ...]
    txn: TxnId | None = None
    deliver_at: int | None = None


def deliver_time_ms(deliver_at: int | None, deliver_after: float | None) -> int | None:
    """The ``deliver_at_time`` of a send: ``deliver_at`` (ms since the epoch) or now plus
    ``deliver_after`` seconds; None for immediate delivery. Giving both is an error.

    Example:
        >>> deliver_time_ms(1_700_000_000_000, None), deliver_time_ms(None, None)
        (1700000000000, None)
    """
    if deliver_at is not None and deliver_after is not None:
        raise InvalidArgument("give deliver_at or deliver_after, not both")
    if deliver_after is not None:
        if deliver_after < 0:
            raise InvalidArgument(f"deliver_after {deliver_after} s is negative")
        return _now_ms() + int(deliver_after * 1000)
    if deliver_at is not None and deliver_at < 0:
        raise InvalidArgument(f"deliver_at {deliver_at} is negative")
    return deliver_at


def _as_bytes(value: bytes | bytearray | memoryview) -> bytes:
    if type(value) is bytes:
        return value
    if not isinstance(value, bytearray | memoryview):
        raise InvalidArgument(f"message value must be bytes, not {type(value).__name__}")
    return bytes(value)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _branch(item: _Pending) -> str | None:
    """The batch-transaction branch a message names (its ``__txn_branch`` property)."""
    for key, value in item.properties:
        if key == BRANCH_PROPERTY:
            return value
    return None


def _mark_txn(md: pb.MessageMetadata, txn: TxnId | None) -> None:
    if txn is not None:
        md.txnid_most_bits = txn.most_bits
        md.txnid_least_bits = txn.least_bits


class Producer(ReconnectingHandler):
    """An async producer on one (non-partitioned) topic or one partition."""

    def __init__(
        self,
        pool: ConnectionPool,
        topic: str,
        options: ProducerOptions,
        partition: int = -1,
    ) -> None:
        super().__init__(pool, topic)
        self.options = options
        self.partition = partition
        self.segment_id: int | None = None
        """Set by a scalable topic's producer: the segment this producer writes, named in
        the message ids it answers."""
        self.producer_name = options.producer_name or ""
        self._id = pool.new_handler_id()
        self._epoch = 0
        self._next_sequence_id = options.initial_sequence_id or 0
        self._sequence_known = options.initial_sequence_id is not None
        self.last_sequence_id = self._next_sequence_id - 1
        self._pending: deque[_Op] = deque()
        # Messages accepted and not yet completed (batched or in a pending op). A message
        # whose future the caller cancelled still holds its slot until it leaves the
        # queue, so the bound covers the memory really held.
        self._bound = PendingBound(options.pending_messages_max)
        self._batch: list[_Pending] = []
        self._batch_bytes = 0
        # Read once per message: kept here rather than looked up through options/connection.
        self._batch_messages_max = options.batch_messages_max
        self._batch_bytes_max = options.batch_bytes_max
        self._size_limit = MESSAGE_SIZE_MAX_BYTES
        """The connected broker's max message size (the last one known while disconnected)."""
        self._batch_timer: asyncio.Handle | None = None
        """Sends the open batch: after the batch delay, or at the end of this loop turn once
        a caller waits on one of its messages (``_flush_soon``)."""
        self._closed_error: AnabranchError | None = None
        self._stuck_timer: asyncio.TimerHandle | None = None
        """Runs while ops are pending (started by ``_enqueue``, see ``_check_stuck``)."""
        self._watched: tuple[_Op, ClientConnection | None, float] | None = None
        """The head op, its connection, and since when the pair has not changed."""
        self._probing: asyncio.Task[None] | None = None
        self._flush_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._join_ahead = JoinAhead()  # a transaction's topic joins ahead of its batch
        """``flush`` calls waiting until the op with this highest sequence id is answered."""

    def __repr__(self) -> str:
        return f"Producer({self.topic!r}, name={self.producer_name!r})"

    # --- connection ------------------------------------------------------------------------

    async def _connect_once(self) -> None:
        address = await self._pool.lookup(self.topic)
        conn = await self._pool.get(address)
        request_id = conn.new_request_id()
        cmd = commands.producer(self.topic, self._id, request_id, self.producer_name or None)
        cmd.producer.user_provided_producer_name = self.options.producer_name is not None
        cmd.producer.epoch = self._epoch
        for k, v in self.options.properties.items():
            cmd.producer.metadata.add(key=k, value=v)
        self._epoch += 1
        conn.register_producer(self._id, self)
        try:
            frame = await conn.request(cmd, request_id)
        except BaseException:
            conn.unregister_producer(self._id)
            raise
        if self._closing:
            conn.unregister_producer(self._id)
            raise Closed(f"{self} was closed while connecting")
        resp = frame.command.producer_success
        self.producer_name = resp.producer_name
        if not self._sequence_known:
            # Continue where the broker's dedup state says this producer name stopped.
            self._next_sequence_id = max(self._next_sequence_id, int(resp.last_sequence_id) + 1)
            self.last_sequence_id = self._next_sequence_id - 1
            self._sequence_known = True
        self._conn = conn
        self._size_limit = conn.max_message_size
        for op in list(self._pending):
            self._write(op)

    def _on_terminal_error(self, error: AnabranchError) -> None:
        self._closing = True
        self._closed_error = error
        self._fail_all(error)

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
        """Send one message and wait until the broker stored it; returns its id.

        ``event_time`` is milliseconds since the epoch. Errors are typed exceptions, e.g.
        ``MessageTooBig``, ``TopicTerminated``, ``Closed``. With ``txn`` the message is
        part of that transaction: readers see it once the transaction commits.
        ``deliver_at`` (ms since the epoch) or ``deliver_after`` (seconds) delay its
        delivery to Shared and Key_Shared subscriptions (sent unbatched, as upstream).
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
        if not fut.done():
            self._flush_soon()
        return await fut

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
        """Queue one message; returns a future of its id once there is room in the queue.

        Waits while ``pending_messages_max`` messages are unacknowledged (or raises
        ``ProducerQueueFull`` with ``block_if_queue_full=False``). With ``txn`` the
        message joins the transaction (which raises at once, sending nothing, when it is
        no longer open); its commit waits for this send.
        """
        due = (
            None
            if deliver_at is None and deliver_after is None
            else deliver_time_ms(deliver_at, deliver_after)
        )
        if txn is None:
            return await self._send_async(
                value, key, properties, event_time, sequence_id, None, deliver_at=due
            )
        # With room in the queue nothing awaits between the check and the tracking, so the
        # send needs no in-flight count (nor a coroutine): that bookkeeping per message was
        # most of what a transactional send cost more than a plain one.
        txn._check_usable()
        txn._senders.add(self)
        fut = self._try_send(value, key, properties, event_time, sequence_id, txn.id, due)
        if fut is not None:
            txn._add_send(fut)
            return fut
        txn._begin_op()
        try:
            fut = await self._send_waiting(
                value, key, properties, event_time, sequence_id, txn.id, due
            )
        except BaseException as err:
            txn._end_op(err)
            raise
        txn._track(fut)
        return fut

    async def _send_async(  # noqa: PLR0917 (private)
        self,
        value: bytes,
        key: str | None,
        properties: Mapping[str, str] | None,
        event_time: int | None,
        sequence_id: int | None,
        txn_id: TxnId | None,
        *,
        deliver_at: int | None = None,
    ) -> asyncio.Future[MessageId]:
        """``send_async`` with the wire transaction id (the scalable producer's entry)."""
        fut = self._try_send(value, key, properties, event_time, sequence_id, txn_id, deliver_at)
        if fut is not None:
            return fut
        return await self._send_waiting(
            value, key, properties, event_time, sequence_id, txn_id, deliver_at
        )

    def _try_send(  # noqa: PLR0917 (private)
        self,
        value: bytes,
        key: str | None,
        properties: Mapping[str, str] | None,
        event_time: int | None,
        sequence_id: int | None,
        txn_id: TxnId | None,
        deliver_at: int | None,
    ) -> asyncio.Future[MessageId] | None:
        """Queue without waiting (None when the queue is full), announcing the topic on the
        first send in a transaction."""
        if txn_id is not None and self._join_ahead.wants(txn_id):
            self._join_ahead.announce(self._conn, self.topic, txn_id)
        return self._send_nowait(
            value, key, properties, event_time, sequence_id, txn_id, deliver_at=deliver_at
        )

    async def _send_waiting(  # noqa: PLR0917 (private)
        self,
        value: bytes,
        key: str | None,
        properties: Mapping[str, str] | None,
        event_time: int | None,
        sequence_id: int | None,
        txn_id: TxnId | None,
        deliver_at: int | None,
    ) -> asyncio.Future[MessageId]:
        """Wait for room in the queue, then queue the message."""
        await self._bound.enter(block=self.options.block_if_queue_full, owner=self)
        fut = asyncio.get_running_loop().create_future()
        try:
            self._check_open()  # closed while this send waited for room
        except Closed as err:
            self._bound.leave(1)
            fut.set_exception(err)
            return fut
        self._submit(
            fut, _as_bytes(value), key, properties, event_time, sequence_id, txn_id, deliver_at
        )
        return fut

    def _send_nowait(  # noqa: PLR0917 (private)
        self,
        value: bytes,
        key: str | None,
        properties: Mapping[str, str] | None,
        event_time: int | None,
        sequence_id: int | None,
        txn_id: TxnId | None = None,
        *,
        deliver_at: int | None = None,
    ) -> asyncio.Future[MessageId] | None:
        """``send_async`` without waiting: None when the queue is full (nothing queued)."""
        self._check_open()
        value = _as_bytes(value)
        if not self._bound.try_enter():
            return None
        fut: asyncio.Future[MessageId] = asyncio.get_running_loop().create_future()
        self._submit(fut, value, key, properties, event_time, sequence_id, txn_id, deliver_at)
        return fut

    def _offer(  # noqa: PLR0917 (private)
        self,
        completion: Completion,
        value: bytes,
        key: str | None,
        properties: Mapping[str, str] | None,
        event_time: int | None,
        sequence_id: int,
        txn_id: TxnId | None,
        deliver_at: int | None = None,
    ) -> bool:
        """Queue a message answered through ``completion`` if there is room now; False
        (nothing queued) when the queue is full. Raises Closed when closed."""
        self._check_open()
        if not self._bound.try_enter():
            return False
        self._submit(
            completion,
            _as_bytes(value),
            key,
            properties,
            event_time,
            sequence_id,
            txn_id,
            deliver_at,
        )
        return True

    async def _offer_waiting(  # noqa: PLR0917 (private)
        self,
        completion: Completion,
        value: bytes,
        key: str | None,
        properties: Mapping[str, str] | None,
        event_time: int | None,
        sequence_id: int,
        txn_id: TxnId | None,
        deliver_at: int | None = None,
    ) -> None:
        """``_offer`` that waits for room (Closed if the producer closes meanwhile)."""
        await self._bound.enter(block=self.options.block_if_queue_full, owner=self)
        try:
            self._check_open()
        except Closed:
            self._bound.leave(1)
            raise
        self._submit(
            completion,
            _as_bytes(value),
            key,
            properties,
            event_time,
            sequence_id,
            txn_id,
            deliver_at,
        )

    def _submit(  # noqa: PLR0917 (private)
        self,
        fut: Completion,
        value: bytes,
        key: str | None,
        properties: Mapping[str, str] | None,
        event_time: int | None,
        sequence_id: int | None,
        txn_id: TxnId | None = None,
        deliver_at: int | None = None,
    ) -> None:
        """Queue a message that holds a slot of the bound; its answer resolves ``fut``."""
        bound = self._bound
        if sequence_id is None:
            sequence_id = self._next_sequence_id
            self._next_sequence_id = sequence_id + 1
        elif sequence_id >= self._next_sequence_id:
            self._next_sequence_id = sequence_id + 1
        if len(value) > self._size_limit:
            bound.leave(1)
            fut.set_exception(MessageTooBig("message", len(value), self._size_limit))
            return
        props = tuple(properties.items()) if properties else ()
        item = _Pending(value, fut, sequence_id, key, event_time, props, txn_id, deliver_at)
        if self.options.batching and deliver_at is None:
            self._add_to_batch(item)
        else:
            self._enqueue(self._single_op(item))

    def _check_open(self) -> None:
        if self._closing:
            raise self._closed_error or Closed(f"{self} is closed")

    def _metadata(self, sequence_id: int) -> pb.MessageMetadata:
        return pb.MessageMetadata(
            producer_name=self.producer_name, sequence_id=sequence_id, publish_time=_now_ms()
        )

    def _single_op(self, item: _Pending) -> _Op:
        md = self._metadata(item.sequence_id)
        if item.key is not None:
            md.partition_key = item.key
        if item.event_time:
            md.event_time = item.event_time
        if item.deliver_at is not None:
            md.deliver_at_time = item.deliver_at
        for k, v in item.properties:
            md.properties.add(key=k, value=v)
        _mark_txn(md, item.txn)
        op = _Op(item.sequence_id, item.sequence_id, md, item.value, [item.future], False)
        op.txn = item.txn
        return op

    def _add_to_batch(self, item: _Pending) -> None:
        size = len(item.value) + BATCH_ENTRY_OVERHEAD_BYTES
        batch = self._batch
        if batch and (
            self._batch_bytes + size > self._batch_bytes_max
            or batch[0].txn != item.txn
            or (
                item.txn is not None
                and (item.properties or batch[0].properties)
                and _branch(batch[0]) != _branch(item)
            )
        ):
            # A batch is one entry of one transaction (or of none), and of one branch of
            # it (the broker reads the branch from the entry's own metadata): never mixed.
            self._flush_batch()
            batch = self._batch
        batch.append(item)
        self._batch_bytes += size
        if (
            len(batch) >= self._batch_messages_max
            or self._batch_bytes >= self._batch_bytes_max
            # A full bound: room comes only from receipts, so send now rather than after
            # the batch delay (pending_messages_max below batch_messages_max would stall).
            or self._bound.count >= self._bound.limit
        ):
            self._flush_batch()
        elif self._batch_timer is None:
            loop = asyncio.get_running_loop()
            self._batch_timer = loop.call_later(self.options.batch_delay_s, self._flush_batch)

    def _flush_soon(self) -> None:
        """Send the open batch at the end of this loop turn, not after the batch delay: a
        caller waits on a message in it (upstream's synchronous send triggers a flush the
        same way). Sends other tasks make in this turn still join the batch, so concurrent
        awaited sends are still batched while a lone one gains no delay."""
        timer = self._batch_timer
        if self._batch and (timer is None or isinstance(timer, asyncio.TimerHandle)):
            if timer is not None:
                timer.cancel()
            self._batch_timer = asyncio.get_running_loop().call_soon(self._flush_batch)

    def _flush_batch(self) -> None:
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        live = [item for item in batch if not item.future.done()]
        if len(live) != len(batch):
            self._bound.leave(len(batch) - len(live))
        if not live:
            return
        md = self._metadata(live[0].sequence_id)
        md.num_messages_in_batch = len(live)
        txn = live[0].txn
        _mark_txn(md, txn)
        branch = _branch(live[0])
        if branch is not None:
            md.properties.add(key=BRANCH_PROPERTY, value=branch)
        first_key = live[0].key
        if first_key is not None and all(i.key == first_key for i in live):
            # A one-key batch carries its key, so key-based dispatch can route the entry.
            md.partition_key = first_key
        else:
            # A mixed one names its messages' key slots, so Key_Shared routes each message
            # to its key's consumer without opening the batch (core/batch_keys).
            slots = encode_key_slots(
                NONE_KEY if i.key is None else i.key.encode("utf-8") for i in live
            )
            if slots is not None:
                md.properties.add(key=KEY_SLOTS_PROPERTY, value=slots)
        payload = join_batch(
            (
                single_metadata(len(i.value), i.sequence_id, i.key, i.event_time, i.properties),
                i.value,
            )
            for i in live
        )
        highest = max(i.sequence_id for i in live)
        futures = [i.future for i in live]
        self._enqueue(_Op(live[0].sequence_id, highest, md, payload, futures, True, txn))

    def _enqueue(self, op: _Op) -> None:
        codec = self.options.compression
        if codec != CompressionType.NONE:
            op.metadata.compression = int(codec)  # type: ignore[assignment]
            op.metadata.uncompressed_size = len(op.payload)
            op.payload = compress(codec, op.payload)
        size = len(op.payload) + op.metadata.ByteSize()
        if size > self._size_limit:
            err = MessageTooBig("message", size, self._size_limit)
            self._bound.leave(len(op.futures))
            for fut in op.futures:
                if not fut.done():
                    fut.set_exception(err)
            return
        self._pending.append(op)
        self.last_sequence_id = max(self.last_sequence_id, op.highest_sequence_id)
        if self._stuck_timer is None:
            self._watch_stuck()
        if self._conn is not None:
            self._write(op)

    def _write(self, op: _Op) -> None:
        conn = self._conn
        if conn is None:
            return
        cmd = commands.send(self._id, op.sequence_id, len(op.futures))
        if op.highest_sequence_id != op.sequence_id:
            cmd.send.highest_sequence_id = op.highest_sequence_id
        if op.txn is not None:
            cmd.send.txnid_most_bits = op.txn.most_bits
            cmd.send.txnid_least_bits = op.txn.least_bits
        with contextlib.suppress(AnabranchError):
            # A closed connection: the op stays pending and is resent after reconnecting.
            conn.send_command(cmd, op.metadata, op.payload)

    # --- receipts --------------------------------------------------------------------------

    def on_frame(self, frame: Frame) -> None:
        """SEND_RECEIPT / SEND_ERROR from the broker."""
        if frame.type == T.SEND_RECEIPT:
            self._on_receipt(frame.command.send_receipt)
        elif frame.type == T.SEND_ERROR:
            self._on_send_error(frame.command.send_error)

    def _on_receipt(self, body: pb.CommandSendReceipt) -> None:
        sequence_id = int(body.sequence_id)
        if not self._pending or sequence_id < self._pending[0].sequence_id:
            return  # a late duplicate receipt for something already completed
        op = self._pending[0]
        if sequence_id > op.sequence_id:
            # The head's SEND was lost: resend everything from a fresh connection.
            self._drop_connection()
            return
        self._pending.popleft()
        self._bound.leave(len(op.futures))
        wire = body.message_id
        ledger_id, entry_id = int(wire.ledgerId), int(wire.entryId)
        partition, segment_id = self.partition, self.segment_id
        size = len(op.futures) if op.batched else 0
        for index, fut in enumerate(op.futures):
            if fut.done():
                continue
            fut.set_result(
                MessageId(
                    ledger_id, entry_id, index if op.batched else -1, partition, segment_id, size
                )
            )
        if self._flush_waiters:
            self._wake_flushers()

    def _on_send_error(self, body: pb.CommandSendError) -> None:
        err = from_server_error(int(body.error), body.message)
        if err.retriable:
            self._drop_connection()
            return
        if self._pending and self._pending[0].sequence_id == int(body.sequence_id):
            op = self._pending.popleft()
            self._bound.leave(len(op.futures))
            for fut in op.futures:
                if not fut.done():
                    fut.set_exception(err)
            if self._flush_waiters:
                self._wake_flushers()

    # --- stuck sends -----------------------------------------------------------------------

    def _watch_stuck(self) -> None:
        # A few looks per bound: a stuck op is noticed within 1.25 bounds, at the cost of
        # one timer per producer with pending sends (none when idle).
        interval = self._pool.operation_stuck_s / 4
        self._stuck_timer = asyncio.get_running_loop().call_later(interval, self._check_stuck)

    def _check_stuck(self) -> None:
        """Probe the connection when the head op has waited ``operation_stuck_s`` on it."""
        self._stuck_timer = None
        if self._closing or not self._pending:
            self._watched = None
            return  # the next _enqueue starts watching again
        now = asyncio.get_running_loop().time()
        head, conn, watched = self._pending[0], self._conn, self._watched
        if watched is None or watched[0] is not head or watched[1] is not conn:
            self._watched = (head, conn, now)  # progress (or a new connection): start over
        elif (
            conn is not None
            and self._probing is None
            and now - watched[2] >= self._pool.operation_stuck_s
        ):
            self._probing = asyncio.get_running_loop().create_task(self._probe(conn))
        self._watch_stuck()

    async def _probe(self, conn: ClientConnection) -> None:
        try:
            alive = await conn.probe()
        finally:
            self._probing = None
        if alive:
            # The broker answers: it is slow, not gone. Look again after another bound.
            self._watched = None
        else:
            log.info("%s: %s stopped answering; moving to the topic's owner", self, conn.address)

    def _drop_connection(self) -> None:
        conn = self._conn
        if conn is not None:
            asyncio.get_running_loop().create_task(conn.close())

    def _fail_all(self, error: AnabranchError) -> None:
        pending, self._pending = self._pending, deque()
        batch, self._batch = self._batch, []
        futures = [f for op in pending for f in op.futures] + [i.future for i in batch]
        self._bound.leave(len(futures))
        for fut in futures:
            if not fut.done():
                fut.set_exception(error)
        self._wake_flushers()

    def _wake_flushers(self) -> None:
        """Release the ``flush`` calls whose last op left the queue (answered or failed)."""
        head = self._pending[0].sequence_id if self._pending else None
        waiting = []
        for upto, fut in self._flush_waiters:
            if head is None or upto < head:
                if not fut.done():
                    fut.set_result(None)
            else:
                waiting.append((upto, fut))
        self._flush_waiters = waiting

    # --- flush and close -------------------------------------------------------------------

    async def flush(self) -> None:
        """Send the open batch and wait until every message sent so far is acknowledged.

        Failed sends are not raised here: their own futures carry the errors.
        """
        self._flush_batch()
        if not self._pending:
            return
        # Not the ops' own completions: they need not be futures (see ``Completion``).
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append((self._pending[-1].highest_sequence_id, done))
        await done

    async def close(self) -> None:
        """Flush (bounded by the operation timeout), then close; later sends raise Closed."""
        if self._closing:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), self._pool.operation_timeout_s)
        self._closing = True
        if self._stuck_timer is not None:
            self._stuck_timer.cancel()
            self._stuck_timer = None
        probing, self._probing = self._probing, None
        if probing is not None:
            probing.cancel()  # the connection's probe itself goes on (shared, shielded)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await probing
        await self._stop_reconnecting()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.unregister_producer(self._id)
            request_id = conn.new_request_id()
            with contextlib.suppress(AnabranchError):
                await conn.request(commands.close_producer(self._id, request_id), request_id)
        self._fail_all(Closed(f"{self} was closed"))


class PartitionedProducer:
    """A producer over every partition of a partitioned topic, routing by key.

    Keyed messages go to ``java_string_hash(key) % n`` (see ``routing``), keyless ones
    round-robin. The returned ``MessageId.partition`` names the partition.
    """

    def __init__(self, topic: str, producers: list[Producer], options: ProducerOptions) -> None:
        self.topic = topic
        self.producers = producers
        self.options = options
        self._router = Router(len(producers), options.hashing)

    @property
    def producer_name(self) -> str:
        """The name of the first partition's producer."""
        return self.producers[0].producer_name

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
        """Send to the partition the router picks; returns the stored message's id."""
        producer = self.producers[self._router.partition(key)]
        return await producer.send(
            value,
            key=key,
            properties=properties,
            event_time=event_time,
            sequence_id=sequence_id,
            txn=txn,
            deliver_at=deliver_at,
            deliver_after=deliver_after,
        )

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
        """Queue on the routed partition's producer (see ``Producer.send_async``)."""
        producer = self.producers[self._router.partition(key)]
        return await producer.send_async(
            value,
            key=key,
            properties=properties,
            event_time=event_time,
            sequence_id=sequence_id,
            txn=txn,
            deliver_at=deliver_at,
            deliver_after=deliver_after,
        )

    async def flush(self) -> None:
        """Flush every partition."""
        await asyncio.gather(*(p.flush() for p in self.producers))

    async def close(self) -> None:
        """Close every partition's producer."""
        await asyncio.gather(*(p.close() for p in self.producers))


async def create_producer(
    pool: ConnectionPool, topic: str, options: ProducerOptions
) -> Producer | PartitionedProducer:
    """Create (and connect) a producer, partitioned if the topic has partitions."""
    partitions = await pool.partitioned_metadata(topic)
    if partitions == 0:
        producer = Producer(pool, topic, options)
        await producer._start()
        return producer
    producers = [
        Producer(pool, f"{topic}-partition-{i}", options, partition=i) for i in range(partitions)
    ]
    try:
        await asyncio.gather(*(p._start() for p in producers))
    except BaseException:
        await asyncio.gather(*(p.close() for p in producers), return_exceptions=True)
        raise
    return PartitionedProducer(topic, producers, options)


__all__ = ["PartitionedProducer", "Producer", "ProducerOptions"]

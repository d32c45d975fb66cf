"""A producer attached to a topic through one connection: validates SENDs and answers them
with receipts strictly in the order they arrived.

Each SEND becomes a future right away (``PersistentTopic.publish`` or an already failed
one for a send refused up front), queued in ``pending``; whenever the oldest futures are
done they are answered in order: SEND_RECEIPT with the stored position, or SEND_ERROR.
The socket is read ahead of the disk (pipelining), yet a producer never sees receipts out
of order.

Example (a client's SEND reaches :meth:`Producer.send`, which returns at once; the
receipt follows when the entry is durable):
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.aio import Client
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(client: Client, service: BrokerService) -> None:
    ...     sender = await client.create_producer("persistent://public/default/t")
    ...     print(await sender.send(b"hello"))       # the SEND_RECEIPT
    ...     topic = await service.get_topic("persistent://public/default/t", create=False)
    ...     [producer] = topic.producers.values()     # the broker's Producer of that client
    ...     print(producer.stats()["msgInCounter"], producer.stats()["pendingSends"])
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             async with Client(broker.service_url) as client:
    ...                 await demo(client, broker.service)
    >>> asyncio.run(main())
    MessageId(ledger_id=1, entry_id=0, batch_index=0, partition=-1, segment_id=None)
    1 0
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.broker.error_codes import client_message, server_error
from anabranch.broker.hot_frames import encode_send_receipt
from anabranch.errors import (
    AnabranchError,
    ChecksumMismatch,
    Closed,
    LedgerFenced,
    ResourceLimitReached,
    ValueTooLarge,
)
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame
from anabranch.storage.api import Position
from anabranch.transactions.ids import TxnId

if TYPE_CHECKING:
    from anabranch.broker.nonpersistent import NonPersistentTopic
    from anabranch.broker.session import Session
    from anabranch.broker.topic import PersistentTopic

log = logging.getLogger(__name__)
_U64 = 2**64 - 1


class Producer:
    """One producer (see the module docstring)."""

    def __init__(
        self,
        session: Session,
        topic: PersistentTopic | NonPersistentTopic,
        producer_id: int,
        name: str,
        *,
        access_mode: int = pb.Shared,
        user_provided_name: bool = False,
        schema_version: bytes | None = None,
        requested_epoch: int | None = None,
    ) -> None:
        self.session = session
        self.topic = topic
        self.producer_id = producer_id
        self.name = name
        self.access_mode = access_mode
        self.user_provided_name = user_provided_name
        self.schema_version = schema_version
        self.topic_epoch: int | None = None
        self.requested_epoch = requested_epoch
        """The topic epoch a reconnecting exclusive producer last held."""
        self.pending: deque[tuple[int, int | None, asyncio.Future[Position], int]] = deque()
        """Unanswered sends: sequence id, highest sequence id, outcome, entry bytes."""
        self.closed = False
        self.msg_in = 0
        self.bytes_in = 0
        self._on_done = lambda _: self._answer()

    # --- sending --------------------------------------------------------------------------

    def send(self, frame: Frame) -> None:
        """Validate and start storing one SEND; never raises (errors become SEND_ERROR)."""
        cmd = frame.command.send
        highest = cmd.highest_sequence_id if cmd.HasField("highest_sequence_id") else None
        future: asyncio.Future[Position]
        try:
            self._validate(frame)
            assert frame.metadata is not None
            txn = role = None
            if cmd.HasField("txnid_most_bits") or cmd.HasField("txnid_least_bits"):
                txn = TxnId(cmd.txnid_most_bits, cmd.txnid_least_bits)
                role = self.session.service.authorizer.txn_role(getattr(self.session, "role", None))
            future = self.topic.publish(
                self.name,
                cmd.sequence_id,
                highest,
                frame.entry,
                cmd.num_messages,
                txn=txn,
                role=role,
            )
        except BaseException as err:  # a refused send is answered in its turn
            future = _failed(err)
        else:
            self.msg_in += max(cmd.num_messages, 1)
            self.bytes_in += len(frame.entry)
            throttle = self.topic.publish_throttle
            if throttle is not None:
                delay = throttle.take(
                    messages=max(cmd.num_messages, 1),
                    size=len(frame.payload),
                    now=self.session.service.clock.monotonic(),
                )
                if delay > 0:
                    self.session.service.counters.publish_throttled += 1
                    self.session.throttle(delay)
        size = len(frame.entry)
        self.pending.append((cmd.sequence_id, highest, future, size))
        self.session.pending_appends += 1
        buffer = self.session.service.publish_buffer
        was_over = buffer.over
        buffer.add(size)
        if buffer.over:
            if not was_over:
                self.session.service.counters.publish_buffer_pauses += 1
            self.session.update_reading()
        if future.done():
            self._answer()
        else:
            future.add_done_callback(self._on_done)

    def _validate(self, frame: Frame) -> None:
        if self.closed:
            raise Closed(f"producer {self.producer_id} is closed")
        if frame.checksum_ok is False or frame.metadata is None:
            raise ChecksumMismatch("payload checksum mismatch; message not stored")
        max_size = self.session.service.config.max_message_size
        if len(frame.payload) > max_size:
            raise ValueTooLarge("message", len(frame.payload), max_size)

    def _answer(self) -> None:
        buffer = self.session.service.publish_buffer
        while self.pending:
            sequence_id, highest, future, size = self.pending[0]
            if not future.done():
                return
            self.pending.popleft()
            self.session.pending_appends -= 1
            buffer.remove(size)
            self._reply(sequence_id, highest, future)
        self.session.update_reading()

    def _reply(self, sequence_id: int, highest: int | None, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            err: BaseException = Closed("send cancelled")
        elif future.exception() is None:
            pos: Position = future.result()
            # uint64 on the wire: a duplicate's (-1, -1) goes out as upstream's Java does.
            self.session.write_bytes(
                encode_send_receipt(
                    self.producer_id, sequence_id, pos[0] & _U64, pos[1] & _U64, highest
                )
            )
            return
        else:
            err = future.exception()  # type: ignore[assignment]
        if isinstance(err, LedgerFenced):
            self._lost_to_new_owner()
            return
        if not isinstance(err, AnabranchError):
            log.error("send on %s failed unexpectedly", self.topic.name, exc_info=err)
        code = server_error(err)
        self.session.write(
            commands.send_error(self.producer_id, sequence_id, code, client_message(err))
        )

    # --- lifecycle ------------------------------------------------------------------------

    def fence(self) -> None:
        """Closed by an ExclusiveWithFencing producer: tell the client, forget it."""
        self.session.write(commands.close_producer(self.producer_id, 0))
        self.close()

    def _lost_to_new_owner(self) -> None:
        # Another broker's recovery-open fenced this topic's ledger: the send was not
        # stored and this broker no longer owns the topic. No SEND_ERROR (the client would
        # give up): close the producer so the client looks the topic up again and resends
        # everything pending to the new owner (whose dedup drops what was stored), and
        # unload the topic here.
        if not self.closed:
            log.warning("%s: ledger fenced by a new owner; unloading", self.topic.name)
            self.session.write(commands.close_producer(self.producer_id, 0))
            self.close()
            self.session.service.unload_in_background(self.topic.name)

    def close(self) -> None:
        """Detach from the topic and the session (receipts still pending are sent)."""
        if self.closed:
            return
        self.closed = True
        self.topic.remove_producer(self)
        if self.session.producers.get(self.producer_id) is self:
            del self.session.producers[self.producer_id]

    def detach(self) -> None:
        """The topic is going away: the client reconnects when told to close."""
        if not self.closed:
            self.session.write(commands.close_producer(self.producer_id, 0))
            self.close()

    def stats(self) -> dict[str, Any]:
        return {
            "producerId": self.producer_id,
            "producerName": self.name,
            "accessMode": pb.ProducerAccessMode.Name(self.access_mode),
            "msgInCounter": self.msg_in,
            "bytesInCounter": self.bytes_in,
            "address": self.session.remote_address,
            "pendingSends": len(self.pending),
        }


def _failed(err: BaseException) -> asyncio.Future[Position]:
    fut: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
    fut.set_exception(err)
    return fut


async def handle_producer(session: Session, cmd: pb.CommandProducer) -> None:
    """PRODUCER → PRODUCER_SUCCESS (or ERROR); WaitForExclusive first answers
    ``producer_ready=false`` and again once the topic is granted."""
    from anabranch.broker.service import canonical_topic
    from anabranch.errors import ProducerBusy

    pid = cmd.producer_id
    if pid in session.producers or pid in session.creating_producers:
        raise ProducerBusy(f"producer id {pid} is already in use on this connection")
    if len(session.producers) + len(session.creating_producers) >= limits.SESSION_PRODUCERS_MAX:
        raise ResourceLimitReached("producers on this connection", limits.SESSION_PRODUCERS_MAX)
    session.creating_producers.add(pid)
    try:
        parsed = canonical_topic(cmd.topic)  # invalid names fail before any write
        service = session.service
        topic = await service.get_any_topic(str(parsed), create=True)
        caps = await service.topic_limits(parsed)
        user_named = bool(cmd.producer_name)
        producer_name = cmd.producer_name if user_named else service.new_producer_name()
        schema_version = None
        if cmd.HasField("schema"):
            schema_version = await service.schemas.get_or_create(topic.name, cmd.schema)
        if session.closed:
            return
        producer = Producer(
            session,
            topic,
            pid,
            producer_name,
            access_mode=cmd.producer_access_mode,
            user_provided_name=user_named,
            schema_version=schema_version,
            requested_epoch=cmd.topic_epoch if cmd.HasField("topic_epoch") else None,
        )
        waiter = topic.add_producer(producer, caps)
        session.producers[pid] = producer
        if waiter is not None:
            session.write(_producer_success(cmd.request_id, producer, ready=False))
            try:
                await waiter
            except BaseException:
                producer.close()
                raise
        session.write(_producer_success(cmd.request_id, producer, ready=True))
    finally:
        session.creating_producers.discard(pid)


def _producer_success(request_id: int, producer: Producer, *, ready: bool) -> pb.BaseCommand:
    body = pb.CommandProducerSuccess(
        request_id=request_id,
        producer_name=producer.name,
        last_sequence_id=producer.topic.last_sequence_id(producer.name),
    )
    if producer.schema_version is not None:
        body.schema_version = producer.schema_version
    if producer.topic_epoch is not None:
        body.topic_epoch = producer.topic_epoch
    if not ready:
        body.producer_ready = False
    return pb.BaseCommand(type=pb.BaseCommand.PRODUCER_SUCCESS, producer_success=body)

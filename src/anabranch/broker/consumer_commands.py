"""The session's handlers for the consume-side commands.

Each ``handle_<command>(session, body)`` takes the command body; per-request failures are
raised as ``anabranch.errors`` and answered by the session with ERROR (the connection
stays). Commands without a request id (FLOW, ACK without receipt, REDELIVER) naming an
unknown consumer are ignored, as upstream does. ``HANDLERS`` maps each BaseCommand type to
its handler; the session also finds them by name.

Example (a client's SUBSCRIBE reaches ``HANDLERS[pb.BaseCommand.SUBSCRIBE]`` through its
session, which answers SUCCESS on the wire):
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> from anabranch.aio import Client
    >>> from anabranch.testing.broker import InProcessBroker
    >>> HANDLERS[pb.BaseCommand.SUBSCRIBE].__name__
    'handle_subscribe'
    >>> async def demo(client: Client, service: BrokerService) -> None:
    ...     consumer = await client.subscribe("persistent://public/default/t", "billing")
    ...     topic = await service.get_topic("persistent://public/default/t", create=False)
    ...     print(topic.subscriptions["billing"].consumers)
    ...     await consumer.close()                            # CLOSE_CONSUMER
    ...     print(topic.subscriptions["billing"].consumers)
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             async with Client(broker.service_url) as client:
    ...                 await demo(client, broker.service)
    >>> asyncio.run(main())
    [Consumer(id=1, name='billing-1')]
    []
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.broker.consumer import Consumer, message_id_data
from anabranch.broker.dispatcher_entries import read_info
from anabranch.broker.error_codes import client_message, server_error
from anabranch.broker.nonpersistent import NonPersistentTopic
from anabranch.broker.nonpersistent_subscription import NonPersistentSubscription
from anabranch.broker.subscription import NonDurableCursor, Subscription, position_of
from anabranch.core.names import SegmentName, parse_name
from anabranch.errors import (
    AnabranchError,
    ConsumerBusy,
    ConsumerNotFound,
    InvalidArgument,
    NonPersistentUnsupported,
    NotAllowed,
    ResourceLimitReached,
)
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import EARLIEST, LATEST, Position

if TYPE_CHECKING:
    from anabranch.broker.topic import PersistentTopic

log = logging.getLogger(__name__)
T = pb.BaseCommand
SubType = pb.CommandSubscribe
SUBSCRIPTION_NAME_CHARS_MAX = 1024
"""Longest subscription name accepted; it becomes a cursor name and a metadata key."""

Session = Any
"""``anabranch.broker.session.Session`` (kept loose: the session imports this module)."""


def _consumer(session: Session, consumer_id: int) -> Consumer:
    consumer = session.consumers.get(consumer_id)
    if not isinstance(consumer, Consumer):
        raise ConsumerNotFound(consumer_id)
    return consumer


def _subscription(consumer: Consumer) -> Subscription | NonPersistentSubscription:
    if consumer.subscription is None:
        raise ConsumerNotFound(consumer.consumer_id)
    return consumer.subscription


def _check_subscription_name(name: str) -> None:
    if not name or len(name) > SUBSCRIPTION_NAME_CHARS_MAX:
        raise InvalidArgument(f"invalid subscription name {name!r}")
    if any(ch in name for ch in "/\0\n\r") or not name.isprintable():
        raise InvalidArgument(f"invalid subscription name {name!r}")


def _start_position(cmd: pb.CommandSubscribe) -> Position:
    """Where a reader's non-durable cursor starts: after ``start_message_id`` (one entry
    earlier for an id inside a batch, so the client can skip the consumed part)."""
    if not cmd.HasField("start_message_id"):
        return EARLIEST if cmd.initialPosition == pb.CommandSubscribe.Earliest else LATEST
    msg_id = cmd.start_message_id
    pos = position_of(msg_id)
    if pos[0] < 0:
        return EARLIEST
    if pos == LATEST:
        return LATEST
    if msg_id.HasField("batch_index") and msg_id.batch_index >= 0:
        return Position(pos[0], pos[1] - 1)
    return pos


def _check_subscribe_rate(session: Session, topic: PersistentTopic, consumer: Consumer) -> None:
    """Refuse a consumer (client host, name, id) that subscribes to ``topic`` more often
    than its subscribe rate allows (``broker/subscribe_throttling.py``), as upstream does."""
    limiter = topic.subscribe_limiter
    if limiter is None:
        return
    host = consumer.remote_address.rsplit(":", 1)[0]
    key = (host, consumer.name, consumer.consumer_id)
    if not limiter.try_acquire(key, topic.clock.monotonic()):
        session.service.counters.subscribes_throttled += 1
        raise NotAllowed("Subscribe limited by subscribe rate limit per consumer.")


async def handle_subscribe(session: Session, cmd: pb.CommandSubscribe) -> None:
    """SUBSCRIBE -> SUCCESS, or ERROR (ConsumerBusy, bad names, ...)."""
    if cmd.consumer_id in session.consumers:
        raise ConsumerBusy(f"consumer id {cmd.consumer_id} is already used on this connection")
    if len(session.consumers) >= limits.SESSION_CONSUMERS_MAX:
        raise ResourceLimitReached("consumers on this connection", limits.SESSION_CONSUMERS_MAX)
    _check_subscription_name(cmd.subscription)
    if cmd.read_compacted and cmd.subType not in (SubType.Exclusive, SubType.Failover):
        raise NotAllowed("readCompacted only allowed on failover or exclusive subscriptions")
    topic_name = parse_name(cmd.topic)
    partition = -1 if isinstance(topic_name, SegmentName) else topic_name.partition
    consumer = Consumer(
        session,
        cmd.consumer_id,
        cmd.consumer_name or f"{cmd.subscription}-{cmd.consumer_id}",
        int(cmd.subType),
        priority=cmd.priority_level,
        partition=partition if partition is not None else -1,
        key_shared_meta=cmd.keySharedMeta if cmd.HasField("keySharedMeta") else None,
        epoch=cmd.consumer_epoch,
        remote_address=getattr(session, "remote_address", ""),
    )
    consumer.read_compacted = cmd.read_compacted
    # Claimed before any await, so a concurrent SUBSCRIBE with the same id is refused.
    session.consumers[cmd.consumer_id] = consumer
    reader_sub: Subscription | None = None
    try:
        if not isinstance(topic_name, SegmentName) and not topic_name.is_persistent:
            await _subscribe_non_persistent(session, cmd, consumer)
            session.reply_success(cmd.request_id)
            return
        topic = await session.service.get_topic(str(topic_name), create=cmd.force_topic_creation)
        _check_subscribe_rate(session, topic, consumer)
        caps = await session.service.topic_limits(topic_name)
        if cmd.read_compacted:
            session.service.compactions.of(topic)  # so that dispatch finds the view
        if cmd.HasField("schema"):
            consumers = sum(len(sub.consumers) for sub in topic.subscriptions.values())
            idle = not topic.producers and not consumers and topic.ledger.entry_count == 0
            await session.service.schemas.check_for_consumer(topic.name, cmd.schema, idle=idle)
        if cmd.durable:
            initial = EARLIEST if cmd.initialPosition == pb.CommandSubscribe.Earliest else LATEST
            sub = await topic.get_or_create_subscription(
                cmd.subscription, int(cmd.subType), initial, caps=caps
            )
        else:
            sub = topic.subscriptions.get(cmd.subscription)
            if sub is None:
                cursor = NonDurableCursor(topic.ledger, cmd.subscription, _start_position(cmd))
                reader_sub = Subscription(
                    topic, cmd.subscription, int(cmd.subType), cursor,
                    clock=topic.clock, durable=False,
                )  # fmt: skip
                topic.subscriptions[cmd.subscription] = sub = reader_sub
        await sub.add_consumer(consumer, caps)
    except BaseException:
        if session.consumers.get(cmd.consumer_id) is consumer:
            del session.consumers[cmd.consumer_id]
        if reader_sub is not None and not reader_sub.consumers:
            # A reader's subscription made for a consumer that was refused (a consumer
            # cap): it would stay without anyone to end it.
            name, subscriptions = reader_sub.name, reader_sub.topic.subscriptions
            if subscriptions.get(name) is reader_sub:
                del subscriptions[name]
            await reader_sub.close()
        raise
    session.reply_success(cmd.request_id)


async def _subscribe_non_persistent(
    session: Session, cmd: pb.CommandSubscribe, consumer: Consumer
) -> None:
    """SUBSCRIBE on a non-persistent topic: durable or not, start position and all, the
    consumer gets what is published from now on (upstream)."""
    if cmd.read_compacted:
        raise NonPersistentUnsupported("readCompacted")  # nothing is kept to compact
    topic: NonPersistentTopic = await session.service.get_non_persistent_topic(
        cmd.topic, create=cmd.force_topic_creation
    )
    caps = await session.service.topic_limits(parse_name(cmd.topic))
    if cmd.HasField("schema"):
        idle = not topic.in_use
        await session.service.schemas.check_for_consumer(topic.name, cmd.schema, idle=idle)
    sub = topic.get_or_create_subscription(cmd.subscription, int(cmd.subType), caps)
    try:
        await sub.add_consumer(consumer, caps)
    except BaseException:
        if not sub.consumers:
            topic.forget_subscription(sub)
        raise


async def handle_flow(session: Session, cmd: pb.CommandFlow) -> None:
    """FLOW: more permits; the dispatcher may send now."""
    consumer = session.consumers.get(cmd.consumer_id)
    if not isinstance(consumer, Consumer):
        log.info("FLOW for unknown consumer %d", cmd.consumer_id)
        return
    consumer.add_permits(cmd.messagePermits)
    if isinstance(consumer.subscription, Subscription):
        consumer.subscription.dispatcher.kick()


async def handle_ack(session: Session, cmd: pb.CommandAck) -> None:
    """ACK (individual, cumulative, batch-index, transactional); ACK_RESPONSE when the
    client asked for a receipt (``request_id``), carrying the error if it failed."""
    receipt = cmd.HasField("request_id")
    try:
        consumer = _consumer(session, cmd.consumer_id)
        await _subscription(consumer).acknowledge(consumer, cmd)
    except AnabranchError as err:
        if not receipt:
            log.info("ACK from consumer %d failed: %s", cmd.consumer_id, err)
            return
        response = commands.ack_response(
            cmd.consumer_id, cmd.request_id, server_error(err), client_message(err)
        )
    else:
        if not receipt:
            return
        response = commands.ack_response(cmd.consumer_id, cmd.request_id)
    if cmd.HasField("txnid_most_bits") or cmd.HasField("txnid_least_bits"):
        response.ackResponse.txnid_most_bits = cmd.txnid_most_bits
        response.ackResponse.txnid_least_bits = cmd.txnid_least_bits
    session.write(response)


async def handle_redeliver_unacknowledged_messages(
    session: Session, cmd: pb.CommandRedeliverUnacknowledgedMessages
) -> None:
    """Nack / ack timeout: redeliver everything pending at the consumer, or these ids."""
    consumer = session.consumers.get(cmd.consumer_id)
    if not isinstance(consumer, Consumer) or consumer.subscription is None:
        log.info("REDELIVER for unknown consumer %d", cmd.consumer_id)
        return
    if cmd.HasField("consumer_epoch") and cmd.consumer_epoch > consumer.epoch:
        consumer.epoch = cmd.consumer_epoch
    ids = list(cmd.message_ids[: limits.REDELIVER_MESSAGE_IDS_MAX + 1]) if cmd.message_ids else None
    await consumer.subscription.redeliver(consumer, ids)


async def handle_seek(session: Session, cmd: pb.CommandSeek) -> None:
    """SEEK by message id or publish time -> SUCCESS (consumers reconnect)."""
    sub = _subscription(_consumer(session, cmd.consumer_id))
    if cmd.HasField("message_publish_time"):
        await sub.seek(timestamp_ms=cmd.message_publish_time)
    elif cmd.HasField("message_id"):
        await sub.seek(position_of(cmd.message_id))
    else:
        raise InvalidArgument("SEEK without a message id or a publish time")
    session.reply_success(cmd.request_id)


async def handle_get_last_message_id(session: Session, cmd: pb.CommandGetLastMessageId) -> None:
    """GET_LAST_MESSAGE_ID -> the last readable message (with its batch index, so that a
    reader's hasMessageAvailable sees the rest of a batch) and the mark-delete position."""
    consumer = _consumer(session, cmd.consumer_id)
    sub = _subscription(consumer)
    if isinstance(sub, NonPersistentSubscription):
        raise NonPersistentUnsupported("GET_LAST_MESSAGE_ID")
    last = min(sub.transaction_buffer.max_read_position(), sub.ledger.last_confirmed)
    batch_index = -1
    compacted = await _last_compacted(consumer, sub, last)
    if compacted is not None:
        last, batch_index = compacted
    elif last[1] >= 0:
        info = await read_info(sub.ledger, last)
        if info is not None and info.batch_size > 1:
            batch_index = info.batch_size - 1
    body = pb.CommandGetLastMessageIdResponse(
        request_id=cmd.request_id,
        last_message_id=message_id_data(last, consumer.partition, batch_index),
    )
    body.consumer_mark_delete_position.CopyFrom(
        message_id_data(sub.cursor.mark_delete_position, consumer.partition)
    )
    session.write(
        pb.BaseCommand(type=T.GET_LAST_MESSAGE_ID_RESPONSE, getLastMessageIdResponse=body)
    )


async def _last_compacted(
    consumer: Consumer, sub: Subscription, last: Position
) -> tuple[Position, int] | None:
    """A compacted reader whose topic has nothing after the compaction horizon: the last
    message of the compacted view (the topic's last entry may have been compacted away,
    and a reader waiting for it would wait forever)."""
    compaction: Any = getattr(sub.topic, "compaction", None)
    if not consumer.read_compacted or compaction is None:
        return None
    horizon = await compaction.horizon()
    if horizon is None or last > horizon:
        return None
    found: tuple[Position, int] | None = await compaction.last_in_view()
    return found if found is not None else (EARLIEST, -1)


async def handle_unsubscribe(session: Session, cmd: pb.CommandUnsubscribe) -> None:
    """UNSUBSCRIBE: delete the subscription; refused while other consumers are connected
    (unless ``force``, which disconnects them)."""
    consumer = _consumer(session, cmd.consumer_id)
    sub = _subscription(consumer)
    others = [c for c in sub.consumers if c is not consumer]
    if others and not cmd.force:
        raise ConsumerBusy(f"subscription {sub.name} has {len(others)} other connected consumer(s)")
    del session.consumers[cmd.consumer_id]
    await sub.remove_consumer(consumer)
    await sub.topic.remove_subscription(sub.name)  # closes it: the others are disconnected
    session.reply_success(cmd.request_id)


async def handle_close_consumer(session: Session, cmd: pb.CommandCloseConsumer) -> None:
    """CLOSE_CONSUMER -> SUCCESS (also for an id already gone: closing is idempotent)."""
    consumer = session.consumers.pop(cmd.consumer_id, None)
    if isinstance(consumer, Consumer):
        await _detach(consumer)
    session.reply_success(cmd.request_id)


async def _detach(consumer: Consumer) -> None:
    sub = consumer.subscription
    if sub is None:
        consumer.closed = True
        return
    await sub.remove_consumer(consumer)
    if sub.durable or sub.consumers:
        return
    if isinstance(sub, NonPersistentSubscription):
        # Its counters stay in the topic's stats; the subscription itself ends (upstream).
        sub.topic.forget_subscription(sub)
        await sub.close()
        return
    subscriptions: dict[str, Any] = sub.topic.subscriptions
    name = sub.name
    registered = subscriptions.get(name) is sub
    if registered:
        # A reader's subscription ends with its last consumer (upstream).
        del subscriptions[name]
    await sub.close()


async def on_session_closed(session: Session) -> None:
    """The connection is gone: its consumers leave their subscriptions."""
    consumers = list(session.consumers.values())
    session.consumers.clear()
    for consumer in consumers:
        if isinstance(consumer, Consumer):
            try:
                await _detach(consumer)
            except Exception:
                log.exception("detaching consumer %d failed", consumer.consumer_id)


Handler = Callable[[Session, Any], Awaitable[None]]

HANDLERS: dict[int, Handler] = {
    T.SUBSCRIBE: handle_subscribe,
    T.FLOW: handle_flow,
    T.ACK: handle_ack,
    T.REDELIVER_UNACKNOWLEDGED_MESSAGES: handle_redeliver_unacknowledged_messages,
    T.SEEK: handle_seek,
    T.GET_LAST_MESSAGE_ID: handle_get_last_message_id,
    T.UNSUBSCRIBE: handle_unsubscribe,
    T.CLOSE_CONSUMER: handle_close_consumer,
}

"""A subscription: a cursor, its consumers, a dispatcher, and the ack/seek/redeliver paths.

Durable subscriptions sit on a managed-ledger cursor (they survive restarts); readers use
a :class:`NonDurableCursor` that lives in memory and disappears with its last consumer.
Every acknowledgement goes through the ``PendingAckStore`` (transactions, PIP-473); a
partial batch-index ack is recorded on the cursor with ``set_batch_ack_state`` and becomes
a full ack when the last index is acknowledged.

Example:
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> from anabranch.broker.consumer import FakeWriter
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.protocol.frames import encode_entry
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(topic: PersistentTopic, cursor: Cursor, consumer: Consumer) -> None:
    ...     sub = Subscription(topic, "billing", pb.CommandSubscribe.Shared, cursor,
    ...                        clock=SystemClock())
    ...     await sub.add_consumer(consumer)
    ...     consumer.add_permits(100); sub.dispatcher.kick()
    ...     while len(consumer.session.written) < 2:      # MESSAGE commands
    ...         await asyncio.sleep(0.01)
    ...     print([w.message.message_id.entryId for w in consumer.session.written])
    ...     await sub.close()
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             topic = await broker.service.get_topic("persistent://public/default/t",
    ...                                                    create=True)
    ...             md = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=0)
    ...             for payload in (b"a", b"b"):
    ...                 await topic.ledger.append(encode_entry(md, payload))
    ...             cursor = await topic.ledger.open_cursor("billing", EARLIEST)
    ...             consumer = Consumer(FakeWriter(), 1, "c1", pb.CommandSubscribe.Shared)
    ...             await demo(topic, cursor, consumer)
    >>> asyncio.run(main())
    [0, 1]
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.broker.consumer import Consumer, from_u64
from anabranch.broker.dispatch_throttling import put_in_force
from anabranch.broker.dispatcher import Dispatcher, make_dispatcher
from anabranch.broker.dispatcher_entries import (
    acked_count,
    find_by_publish_time,
    merge_acked,
    read_info,
    wire_to_acked,
)
from anabranch.broker.topic_limits import NO_LIMITS, TopicLimits
from anabranch.clock import Clock
from anabranch.core.ack_state import AckState
from anabranch.core.dispatch_rate import (
    UNLIMITED,
    Allowance,
    DispatchRate,
    DispatchThrottle,
    combined,
)
from anabranch.core.names import TopicName
from anabranch.core.rate_window import RateWindow
from anabranch.errors import (
    Closed,
    ConsumerBusy,
    InvalidArgument,
    LedgerFenced,
    MetadataError,
    NotAllowed,
)
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import EARLIEST, LATEST, Cursor, ManagedLedger, Position
from anabranch.transactions.ids import TxnId
from anabranch.transactions.pending_ack import NoPendingAckStore, PendingAckStore

if TYPE_CHECKING:
    from anabranch.broker.topic import PersistentTopic

log = logging.getLogger(__name__)

SubType = pb.CommandSubscribe
TYPE_NAMES: dict[int, str] = {
    SubType.Exclusive: "Exclusive",
    SubType.Shared: "Shared",
    SubType.Failover: "Failover",
    SubType.Key_Shared: "Key_Shared",
}


def position_of(msg_id: pb.MessageIdData) -> Position:
    """The (signed) position a client's MessageIdData names."""
    return Position(from_u64(msg_id.ledgerId), from_u64(msg_id.entryId))


class NonDurableCursor:
    """An in-memory cursor for readers (upstream's NonDurableCursorImpl): same interface as
    a durable one, nothing persisted.

    >>> import asyncio
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo() -> int:
    ...     ml = await MemoryManagedLedgerFactory().open("t")
    ...     await ml.append(b"a"); await ml.append(b"b")
    ...     return NonDurableCursor(ml, "reader", EARLIEST).backlog()
    >>> asyncio.run(demo())
    2
    """

    def __init__(self, ledger: ManagedLedger, name: str, mark_delete: Position) -> None:
        self._ledger = ledger
        self._name = name
        if mark_delete == LATEST:
            mark_delete = ledger.last_confirmed
        self._state = AckState(mark_delete)

    def _successor(self, pos: tuple[int, int]) -> tuple[int, int]:
        successor = getattr(self._ledger, "successor", None)
        if successor is None:
            return (pos[0], pos[1] + 1)
        result: tuple[int, int] = successor(pos)
        return result

    @property
    def name(self) -> str:
        return self._name

    @property
    def mark_delete_position(self) -> Position:
        return Position(*self._state.mark_delete)

    @property
    def read_position(self) -> Position:
        return Position(*self._successor(self._state.mark_delete))

    async def acknowledge_cumulative(self, position: Position) -> None:
        self._state.acknowledge_cumulative(position, self._successor)

    async def acknowledge(self, positions: Iterable[Position]) -> None:
        for pos in positions:
            self._state.acknowledge(pos, self._successor)

    def is_acknowledged(self, position: Position) -> bool:
        return self._state.is_acked(position)

    def backlog(self) -> int:
        md = self.mark_delete_position
        last = self._ledger.last_confirmed
        if last <= md:
            return 0
        first = Position(*self._successor(md))
        return self._ledger.backlog(md, last) - self._state.acked_count(first, last)

    async def reset(self, position: Position) -> None:
        if position == EARLIEST:
            self._state.reset(EARLIEST)
        elif position == LATEST:
            self._state.reset(self._ledger.last_confirmed)
        else:
            self._state.reset((position[0], position[1] - 1))

    def batch_ack_state(self, position: Position) -> bytes | None:
        return self._state.batch_acks.get(position)

    async def set_batch_ack_state(self, position: Position, bits: bytes) -> None:
        self._state.set_batch_ack(position, bits)

    async def flush(self) -> None:
        return None


class Subscription:
    """One named subscription of a topic (see the module docstring)."""

    def __init__(
        self,
        topic: PersistentTopic,
        name: str,
        sub_type: int,
        cursor: Cursor,
        *,
        clock: Clock,
        durable: bool = True,
        pending_acks: PendingAckStore | None = None,
    ) -> None:
        self.topic = topic
        self.name = name
        self.sub_type = sub_type
        self.cursor = cursor
        self.clock = clock
        self.durable = durable
        self.ledger: ManagedLedger = topic.ledger
        self.transaction_buffer = topic.transaction_buffer
        factory: Callable[[Subscription], PendingAckStore] | None = getattr(
            topic, "pending_ack_factory", None
        )
        if pending_acks is None and durable and factory is not None:
            pending_acks = factory(self)
        self.pending_acks: PendingAckStore = pending_acks or NoPendingAckStore(
            cursor, durable=durable
        )
        self.topic_name: str = topic.name
        self.partition = _partition_of(topic.name)
        self.dispatcher: Dispatcher = make_dispatcher(self, sub_type)
        self.messages_out = 0
        self.bytes_out = 0
        self._rates = RateWindow(limits.STATS_RATE_WINDOW_MIN_S, clock.monotonic(), (0, 0))
        self._closed = False
        self.last_active_s = clock.monotonic()
        """When a consumer last came, left or acknowledged (subscription expiration)."""
        self.dispatch_throttle: DispatchThrottle | None = None
        """The buckets of the subscription's own dispatch rate (dispatch_throttling.py)."""
        rate: DispatchRate | None = getattr(topic, "subscription_dispatch_rate", None)
        if rate is not None:
            put_in_force(self, rate, clock.monotonic())

    @property
    def consumers(self) -> list[Consumer]:
        return list(self.dispatcher.consumers)

    async def recover(self) -> None:
        """Rebuild the transactional acks still pending (before consumers attach)."""
        recover: Callable[[], Awaitable[None]] | None = getattr(self.pending_acks, "recover", None)
        if recover is not None:
            await recover()

    # --- transaction outcomes of pending acks (the pending-ack store calls these) ---------

    def txn_acks_committed(self, positions: list[Position], upto: Position | None) -> None:
        """A transaction's acks reached the cursor: consumers stop holding those entries."""
        self.dispatcher.settled(positions, upto)
        on_drained = getattr(self.topic, "on_drained", None)
        if on_drained is not None and self.ledger.is_terminated and self.cursor.backlog() == 0:
            on_drained(self.topic_name, self.name)

    def txn_acks_aborted(self, positions: list[Position], upto: Position | None) -> None:
        """A transaction's acks were dropped: its entries are delivered again."""
        self.dispatcher.unsettled(positions, upto)

    # --- consumers ------------------------------------------------------------------------

    async def add_consumer(self, consumer: Consumer, caps: TopicLimits = NO_LIMITS) -> None:
        """Attach ``consumer``; ConsumerBusy/ConsumerAssignError per the type's rules and
        ``caps``. A subscription without consumers takes the type of its next consumer
        (upstream)."""
        if self._closed:  # its topic was unloaded meanwhile: the client retries
            raise Closed(f"subscription {self.name} is closed")
        while consumer.sub_type != self.sub_type:
            if self.dispatcher.consumers:
                raise ConsumerBusy(
                    f"subscription {self.name} is {TYPE_NAMES.get(self.sub_type)}, not "
                    f"{TYPE_NAMES.get(consumer.sub_type)}"
                )
            old = self.dispatcher
            await old.close()
            if self._closed:
                raise Closed(f"subscription {self.name} is closed")
            # A concurrent subscribe of another type may have replaced it meanwhile (and
            # attached its consumer): look again rather than drop that dispatcher.
            if self.dispatcher is old:
                self.sub_type = consumer.sub_type
                self.dispatcher = make_dispatcher(self, consumer.sub_type)
        topic: Any = self.topic
        on_topic = sum(len(s.consumers) for s in topic.subscriptions.values())
        caps.check_consumer(self.name, on_topic=on_topic, on_subscription=len(self.consumers))
        consumer.unacked_gate.cap = caps.consumer_unacked_cap
        self.dispatcher.set_unacked_caps(caps)
        self.dispatcher.add_consumer(consumer)
        consumer.subscription = self
        self.last_active_s = self.clock.monotonic()
        self.dispatcher.start()

    async def remove_consumer(self, consumer: Consumer) -> None:
        """Detach ``consumer``; its unacknowledged entries go to the others (or rewind)."""
        consumer.closed = True
        self.dispatcher.remove_consumer(consumer)
        self.last_active_s = self.clock.monotonic()
        touch = getattr(self.topic, "touch", None)
        if touch is not None:
            touch()

    def notify_new_entries(self) -> None:
        """Called by the topic after each append (and when max_read_position moves)."""
        self.dispatcher.kick()

    def count_out(self, messages: int, size: int) -> None:
        self.messages_out += messages
        self.bytes_out += size
        topic: Any = self.topic
        if hasattr(topic, "msg_out_counter"):
            topic.msg_out_counter += messages
            topic.bytes_out_counter += size
        if self.dispatch_throttle is None and getattr(topic, "dispatch_throttle", None) is None:
            return  # per dispatched entry: no list built when no rate is set
        now = self.clock.monotonic()
        for throttle in self._dispatch_throttles():
            throttle.take(messages=messages, size=size, now=now)

    def dispatch_allowance(self) -> Allowance:
        """What the dispatch rates in force (the topic's, the subscription's) let go now
        (``core/dispatch_rate.py``)."""
        throttles = self._dispatch_throttles()
        if not throttles:
            return UNLIMITED
        now = self.clock.monotonic()
        return combined([throttle.allowance(now) for throttle in throttles])

    def _dispatch_throttles(self) -> list[DispatchThrottle]:
        own = self.dispatch_throttle
        shared: DispatchThrottle | None = getattr(self.topic, "dispatch_throttle", None)
        return [t for t in (shared, own) if t is not None]

    # --- acknowledgements -----------------------------------------------------------------

    async def acknowledge(self, consumer: Consumer, cmd: pb.CommandAck) -> None:
        """Individual or cumulative ack, with batch-index ``ack_set`` and transactions."""
        cumulative = cmd.ack_type == pb.CommandAck.Cumulative
        if len(cmd.message_id) > limits.ACK_MESSAGE_IDS_MAX:
            raise InvalidArgument(
                f"ACK with {len(cmd.message_id)} message ids (at most {limits.ACK_MESSAGE_IDS_MAX})"
            )
        if cumulative and self.sub_type in (SubType.Shared, SubType.Key_Shared):
            raise NotAllowed(f"cumulative ack is not allowed on a {TYPE_NAMES[self.sub_type]}")
        last = self.ledger.last_confirmed
        compaction: Any = getattr(self.topic, "compaction", None)
        if compaction is not None:
            # Ids of a compacted view stay valid once retention deleted their ledgers.
            horizon: Position | None = await compaction.horizon()
            if horizon is not None and horizon > last:
                last = horizon
        for msg_id in cmd.message_id:
            # Only what the topic stored can be acknowledged: a cumulative ack past the end
            # would skip messages not yet written, and ids at the integer extremes could
            # not even be persisted in the cursor.
            pos = position_of(msg_id)
            if pos > last or pos[0] < 0 or pos[1] < 0:
                raise InvalidArgument(f"ack of {pos[0]}:{pos[1]}: no such entry in this topic")
        txn: TxnId | None = None
        if cmd.HasField("txnid_most_bits") or cmd.HasField("txnid_least_bits"):
            txn = TxnId(cmd.txnid_most_bits, cmd.txnid_least_bits)
        if cumulative:
            await self._ack_cumulative(consumer, cmd.message_id, txn)
        else:
            await self._ack_individual(consumer, cmd, txn)
        on_drained = getattr(self.topic, "on_drained", None)
        if on_drained is not None and self.ledger.is_terminated and self.cursor.backlog() == 0:
            on_drained(self.topic_name, self.name)

    async def _ack_individual(
        self, consumer: Consumer, cmd: pb.CommandAck, txn: TxnId | None
    ) -> None:
        if txn is not None and any(m.ack_set for m in cmd.message_id):
            # PendingAckStore has no batch-index state yet: refuse rather than ack whole.
            raise NotAllowed("transactional batch-index acks are not supported")
        full: list[Position] = []
        for msg_id in cmd.message_id:
            pos = position_of(msg_id)
            part = self.dispatcher.part_of(consumer, pos)
            if part is not None:
                if txn is not None:
                    raise NotAllowed(
                        "transactional acks of a split Key_Shared batch are not supported"
                    )
                if await self._ack_part(consumer, pos, msg_id, part):
                    full.append(pos)
                continue
            if not msg_id.ack_set and self.dispatcher.is_split(pos):
                # A whole-entry ack from a consumer holding no part of a split batch (an
                # ack sent after its part moved, e.g. across a reconnect) would acknowledge
                # the other consumers' messages: ignored, its part is redelivered instead.
                continue
            if msg_id.ack_set and txn is None:
                if await self._ack_batch_indexes(consumer, pos, msg_id):
                    full.append(pos)
            else:
                full.append(pos)
        if full:
            role = _txn_role(consumer) if txn is not None else None
            await self.pending_acks.acknowledge(txn, full, cumulative=False, role=role)
            if txn is None:
                self.dispatcher.acked(consumer, full)

    async def _batch_size(self, consumer: Consumer, pos: Position, msg_id: pb.MessageIdData) -> int:
        """The entry's real batch size: what was dispatched, else what is stored. The
        client's ``batch_size`` is only checked against it, never used for sizing."""
        pending = consumer.pending.get(pos)
        if pending is not None:
            size = pending.batch_size
        else:
            info = await read_info(self.ledger, pos)
            if info is None:
                raise InvalidArgument(f"no entry at {pos} to acknowledge batch indexes of")
            size = info.batch_size
        if msg_id.HasField("batch_size") and msg_id.batch_size not in (0, size):
            raise InvalidArgument(
                f"batch size {msg_id.batch_size} does not match the entry at {pos} ({size})"
            )
        return size

    async def _ack_batch_indexes(
        self, consumer: Consumer, pos: Position, msg_id: pb.MessageIdData
    ) -> bool:
        """Merge a partial batch ack; True when every index is now acknowledged."""
        if self.cursor.is_acknowledged(pos):
            return False
        size = await self._batch_size(consumer, pos, msg_id)
        merged = merge_acked(self.cursor.batch_ack_state(pos), wire_to_acked(msg_id.ack_set, size))
        if acked_count(merged, size) >= size:
            return True
        await self.cursor.set_batch_ack_state(pos, merged)
        return False

    async def _ack_part(
        self, consumer: Consumer, pos: Position, msg_id: pb.MessageIdData, part: int
    ) -> bool:
        """An ack from a consumer that was sent only ``part`` (index mask) of a batch
        (Key_Shared's mixed-key batches): it covers those indexes only (an ack without an
        ack set: all of them). True when the whole entry is now acknowledged; the consumer
        stops holding its part once every index of it is."""
        if self.cursor.is_acknowledged(pos):
            self.dispatcher.acked(consumer, [pos])
            return False
        size = await self._batch_size(consumer, pos, msg_id)
        if msg_id.ack_set:
            mine = int.from_bytes(wire_to_acked(msg_id.ack_set, size), "little") & part
        else:
            mine = part
        merged = merge_acked(
            self.cursor.batch_ack_state(pos), mine.to_bytes((size + 7) // 8, "little")
        )
        if acked_count(merged, size) >= size:
            return True
        await self.cursor.set_batch_ack_state(pos, merged)
        if part & ~int.from_bytes(merged, "little") == 0:
            self.dispatcher.acked(consumer, [pos])
        return False

    async def _ack_cumulative(
        self, consumer: Consumer, ids: Sequence[pb.MessageIdData], txn: TxnId | None
    ) -> None:
        if not ids:
            return
        msg_id = max(ids, key=position_of)
        pos = position_of(msg_id)
        target = pos
        # Acked up to an index inside a batch: everything before the entry, plus the
        # entry's acked indexes ((L, -1) sorts before (L, 0), as cursor.reset uses).
        partial = bool(msg_id.ack_set) and txn is None
        if partial and not await self._ack_batch_indexes(consumer, pos, msg_id):
            target = Position(pos[0], pos[1] - 1)
        if target <= self.cursor.mark_delete_position:
            return
        role = _txn_role(consumer) if txn is not None else None
        await self.pending_acks.acknowledge(txn, [target], cumulative=True, role=role)
        if txn is None:
            self.dispatcher.acked_cumulative(consumer, target)

    # --- redelivery and seek ----------------------------------------------------------------

    async def redeliver(
        self, consumer: Consumer, message_ids: list[pb.MessageIdData] | None
    ) -> None:
        """REDELIVER_UNACKNOWLEDGED_MESSAGES: all of ``consumer``'s pending, or those ids."""
        if message_ids is not None and len(message_ids) > limits.REDELIVER_MESSAGE_IDS_MAX:
            # Clamped (DESIGN.md 3.2): the rest stay pending; the client's ack timeout
            # or a later request redelivers them.
            log.info(
                "%s/%s: REDELIVER of %d ids clamped to %d",
                self.topic_name, self.name, len(message_ids), limits.REDELIVER_MESSAGE_IDS_MAX,
            )  # fmt: skip
            message_ids = message_ids[: limits.REDELIVER_MESSAGE_IDS_MAX]
        positions = None if message_ids is None else [position_of(m) for m in message_ids]
        self.dispatcher.redeliver(consumer, positions)

    async def seek(self, position: Position | None = None, timestamp_ms: int | None = None) -> None:
        """Reset the cursor to ``position`` (inclusive) or to the first entry published at or
        after ``timestamp_ms``; connected consumers are disconnected and reconnect, as
        upstream's ``resetCursor`` does."""
        if timestamp_ms is not None:
            position = await find_by_publish_time(self.ledger, timestamp_ms)
        if position is None:
            raise InvalidArgument("seek needs a message id or a publish time")
        if position not in (EARLIEST, LATEST):
            # A client's id may name anything: before the first entry is the earliest,
            # past the last one is the latest (ids at the integer extremes included, which
            # the cursor could not persist).
            if position[0] < 0 or position[1] < 0:
                position = EARLIEST
            elif position > self.ledger.last_confirmed:
                position = LATEST
        for consumer in self.consumers:
            consumer.disconnect()
            _drop_from_session(consumer)
            await self.remove_consumer(consumer)
        await self.cursor.reset(position)
        self.dispatcher.reset()

    # --- lifecycle and stats --------------------------------------------------------------

    async def close(self) -> None:
        """Stop dispatching and disconnect consumers (they reconnect to the new owner)."""
        if self._closed:
            return
        self._closed = True
        for consumer in self.consumers:
            consumer.disconnect()
            _drop_from_session(consumer)
            await self.remove_consumer(consumer)
        await self.dispatcher.close()
        try:
            await self.pending_acks.close()
        except Exception:
            log.exception("%s/%s: closing the pending-ack store failed", self.topic_name, self.name)
        if self.durable:
            try:
                await self.cursor.flush()
            except (MetadataError, LedgerFenced, Closed) as err:
                # Expected when the close is an unload after losing the metadata session
                # (etcd unreachable, or another owner fenced the ledger): at-least-once
                # still holds, the next owner redelivers what was acked since the last
                # persist. One line, not an ERROR with a traceback.
                log.warning(
                    "%s/%s: cursor not persisted on close (%s): acks since the last persist"
                    " are redelivered",
                    self.topic_name,
                    self.name,
                    err,
                )
            except Exception:
                log.exception("%s/%s: cursor flush on close failed", self.topic_name, self.name)

    def stats(self) -> dict[str, Any]:
        """Pulsar-admin-like subscription stats."""
        now = self.clock.monotonic()
        rate_out, throughput_out = self._rates.rates(now, (self.messages_out, self.bytes_out))
        consumers = self.consumers
        out: dict[str, Any] = {
            "type": TYPE_NAMES.get(self.sub_type, str(self.sub_type)),
            "msgBacklog": self.cursor.backlog(),
            "msgRateOut": rate_out,
            "msgThroughputOut": throughput_out,
            "msgOutCounter": self.messages_out,
            "bytesOutCounter": self.bytes_out,
            "unackedMessages": sum(c.unacked_messages for c in consumers),
            "consumers": [c.stats() for c in consumers],
            "isDurable": self.durable,
            "markDeletePosition": "{}:{}".format(*self.cursor.mark_delete_position),
            "readPosition": "{}:{}".format(*self.dispatcher.read_position),
            "blockedSubscriptionOnUnackedMsgs": False,  # a Shared dispatcher's says
        }
        out.update(self.dispatcher.stats())
        return out


def _txn_role(consumer: Consumer) -> str | None:
    """The role a transaction must be owned by for this consumer to ack in it."""
    service = getattr(consumer.session, "service", None)
    if service is None:  # a test's stand-in connection
        return None
    role: str | None = service.authorizer.txn_role(getattr(consumer.session, "role", None))
    return role


def _drop_from_session(consumer: Consumer) -> None:
    """Forget a broker-closed consumer on its connection so the client can resubscribe."""
    registry = getattr(consumer.session, "consumers", None)
    if isinstance(registry, dict) and registry.get(consumer.consumer_id) is consumer:
        del registry[consumer.consumer_id]


def _partition_of(topic: str) -> int:
    try:
        name = TopicName.parse(topic)
    except InvalidArgument:
        return -1
    return name.partition if name.partition is not None else -1

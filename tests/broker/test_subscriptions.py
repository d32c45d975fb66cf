"""Dispatch logic against the memory ledger with a recording session (no sockets)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from anabranch.broker import consumer_commands as cc
from anabranch.broker.consumer import Consumer, FakeWriter
from anabranch.broker.dispatcher_entries import acked_to_wire, hash_slot, wire_to_acked
from anabranch.broker.dispatcher_key_shared import AutoSplitSelector, StickySelector
from anabranch.broker.subscription import Subscription
from anabranch.errors import ConsumerAssignError, ConsumerBusy, NotAllowed
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import encode_entry
from anabranch.storage.api import EARLIEST, ManagedLedger, Position
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.testing.clock import ManualClock
from anabranch.transactions.buffer import NoTransactionBuffer

S = pb.CommandSubscribe


@dataclass
class FakeTopic:
    name: str
    ledger: ManagedLedger
    clock: Any
    transaction_buffer: Any = None
    subscriptions: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.transaction_buffer = NoTransactionBuffer(self.ledger)

    async def append(self, payload: bytes, **meta: Any) -> Position:
        md = pb.MessageMetadata(
            producer_name="p", sequence_id=0, publish_time=meta.pop("publish_time", 1), **meta
        )
        pos = await self.ledger.append(encode_entry(md, payload))
        for sub in self.subscriptions.values():
            sub.notify_new_entries()
        return pos

    async def remove_subscription(self, name: str) -> None:
        sub = self.subscriptions.pop(name)
        await sub.close()
        await self.ledger.delete_cursor(name)


class FakeSession(FakeWriter):
    def __init__(self) -> None:
        super().__init__()
        self.consumers: dict[int, Any] = {}

    def reply_success(self, request_id: int) -> None:
        self.write(commands.success(request_id))

    def messages(self, consumer_id: int | None = None) -> list[pb.CommandMessage]:
        return [
            w.command.message
            for w in self.written
            if w.command.type == pb.BaseCommand.MESSAGE
            and (consumer_id is None or w.command.message.consumer_id == consumer_id)
        ]

    def entries(self, consumer_id: int) -> list[int]:
        return [m.message_id.entryId for m in self.messages(consumer_id)]

    def of_type(self, kind: int) -> list[pb.BaseCommand]:
        return [w.command for w in self.written if w.command.type == kind]


async def settle() -> None:
    for _ in range(60):
        await asyncio.sleep(0)


@pytest.fixture
async def topic() -> Any:
    factory = MemoryManagedLedgerFactory()
    ledger = await factory.open("public/default/persistent/t")
    yield FakeTopic("persistent://public/default/t", ledger, ManualClock())
    await factory.close()


async def subscribe(topic: FakeTopic, sub_type: int, name: str = "s") -> Subscription:
    sub = topic.subscriptions.get(name)
    if sub is None:
        cursor = await topic.ledger.open_cursor(name, EARLIEST)
        sub = Subscription(topic, name, sub_type, cursor, clock=topic.clock)  # type: ignore[arg-type]
        topic.subscriptions[name] = sub
    return sub


async def add(
    sub: Subscription, session: FakeSession, cid: int, *, permits: int = 0, **kw: Any
) -> Consumer:
    consumer = Consumer(session, cid, kw.pop("name", f"c{cid}"), sub.sub_type, **kw)
    session.consumers[cid] = consumer
    await sub.add_consumer(consumer)
    if permits:
        consumer.add_permits(permits)
        sub.dispatcher.kick()
    await settle()
    return consumer


async def close_all(*subs: Subscription) -> None:
    for sub in subs:
        await sub.close()


# --- permits -----------------------------------------------------------------------------


async def test_permits_bound_dispatch_and_a_batch_costs_its_size(topic: FakeTopic) -> None:
    for i in range(5):
        await topic.append(b"x%d" % i)
    await topic.append(b"batch", num_messages_in_batch=3)
    sub = await subscribe(topic, S.Exclusive)
    session = FakeSession()
    c = await add(sub, session, 1, permits=2)
    assert session.entries(1) == [0, 1]
    c.add_permits(4)
    sub.dispatcher.kick()
    await settle()
    assert session.entries(1) == [0, 1, 2, 3, 4, 5]
    assert c.permits == 4 - 3 - 3  # three singles and one batch of three
    assert c.unacked_messages == 8
    await close_all(sub)


# --- Shared ------------------------------------------------------------------------------


async def test_shared_round_robin_and_redelivery_on_close(topic: FakeTopic) -> None:
    for i in range(6):
        await topic.append(b"m%d" % i)
    sub = await subscribe(topic, S.Shared)
    session = FakeSession()
    a = await add(sub, session, 1)
    b = await add(sub, session, 2)
    a.add_permits(10)
    b.add_permits(10)
    sub.dispatcher.kick()
    await settle()
    assert session.entries(1) == [0, 2, 4]
    assert session.entries(2) == [1, 3, 5]
    await sub.remove_consumer(a)
    await settle()
    assert session.entries(2) == [1, 3, 5, 0, 2, 4]
    assert all(m.redelivery_count == 0 for m in session.messages(2))
    await close_all(sub)


async def test_shared_nack_increments_redelivery_count(topic: FakeTopic) -> None:
    await topic.append(b"m")
    sub = await subscribe(topic, S.Shared)
    session = FakeSession()
    c = await add(sub, session, 1, permits=10)
    for expected in (1, 2):
        await cc.handle_redeliver_unacknowledged_messages(
            session, pb.CommandRedeliverUnacknowledgedMessages(consumer_id=1)
        )
        await settle()
        assert session.messages(1)[-1].redelivery_count == expected
    assert len(session.messages(1)) == 3
    assert c.unacked_messages == 1
    await close_all(sub)


async def test_shared_cumulative_ack_is_refused(topic: FakeTopic) -> None:
    await topic.append(b"m")
    sub = await subscribe(topic, S.Shared)
    session = FakeSession()
    c = await add(sub, session, 1, permits=1)
    cmd = commands.ack(1, [commands.message_id(1, 0)], cumulative=True).ack
    with pytest.raises(NotAllowed):
        await sub.acknowledge(c, cmd)
    await close_all(sub)


# --- Exclusive / Failover ------------------------------------------------------------------


async def test_exclusive_second_consumer_is_busy(topic: FakeTopic) -> None:
    sub = await subscribe(topic, S.Exclusive)
    session = FakeSession()
    await add(sub, session, 1)
    with pytest.raises(ConsumerBusy):
        await add(sub, session, 2)
    await close_all(sub)


async def test_failover_picks_by_priority_then_switches_and_notifies(topic: FakeTopic) -> None:
    for i in range(3):
        await topic.append(b"m%d" % i)
    sub = await subscribe(topic, S.Failover)
    session = FakeSession()
    low = await add(sub, session, 1, permits=10, priority=1, name="z")
    high = await add(sub, session, 2, permits=10, priority=0, name="a")
    changes = {
        (c.active_consumer_change.consumer_id, c.active_consumer_change.is_active)
        for c in session.of_type(pb.BaseCommand.ACTIVE_CONSUMER_CHANGE)
    }
    assert (2, True) in changes and (1, False) in changes
    assert session.entries(2) == [0, 1, 2]
    await sub.remove_consumer(high)
    await settle()
    # The unacked entries of the old active consumer are redelivered to the new one.
    assert session.entries(1)[-3:] == [0, 1, 2]
    last = session.of_type(pb.BaseCommand.ACTIVE_CONSUMER_CHANGE)[-1].active_consumer_change
    assert (last.consumer_id, last.is_active) == (1, True)
    assert low.unacked_messages == 3
    await close_all(sub)


async def test_cumulative_ack_moves_mark_delete(topic: FakeTopic) -> None:
    for i in range(4):
        await topic.append(b"m%d" % i)
    sub = await subscribe(topic, S.Exclusive)
    session = FakeSession()
    c = await add(sub, session, 1, permits=10)
    ledger_id = session.messages(1)[0].message_id.ledgerId
    await cc.handle_ack(session, commands.ack(1, [commands.message_id(ledger_id, 2)], True, 7).ack)
    assert sub.cursor.mark_delete_position == Position(ledger_id, 2)
    assert sub.cursor.backlog() == 1 and c.unacked_messages == 1
    [resp] = session.of_type(pb.BaseCommand.ACK_RESPONSE)
    assert resp.ackResponse.request_id == 7 and not resp.ackResponse.HasField("error")
    await close_all(sub)


# --- Key_Shared ----------------------------------------------------------------------------


def test_auto_split_selector_matches_upstream_layout() -> None:
    sel: AutoSplitSelector[str] = AutoSplitSelector()
    sel.add("a")
    sel.add("b")
    sel.add("c")
    assert sel.ranges() == {"c": (0, 16384), "b": (16385, 32768), "a": (32769, 65535)}
    sel.remove("a")  # the top range goes to the consumer just below it
    assert sel.select(65535) == "b" and sel.select(100) == "c"


def test_sticky_selector_refuses_overlaps() -> None:
    sel: StickySelector[str] = StickySelector()
    sel.add("a", [(0, 100)])
    with pytest.raises(ConsumerAssignError):
        sel.add("b", [(100, 200)])
    sel.add("b", [(101, 200)])
    assert sel.select(150) == "b" and sel.select(201) is None


def test_hash_slot_is_upstream_murmur() -> None:
    assert hash_slot(b"hello") == 0x248BFA47 % 65536
    assert 0 <= hash_slot(b"NONE_KEY") < 65536


async def test_key_shared_keeps_keys_on_one_consumer_in_order(topic: FakeTopic) -> None:
    keys = [f"k{i}" for i in range(8)]
    for n in range(40):
        await topic.append(b"%d" % n, partition_key=keys[n % 8])
    sub = await subscribe(topic, S.Key_Shared)
    session = FakeSession()
    await add(sub, session, 1, permits=100)
    await add(sub, session, 2, permits=100)
    await settle()
    owner: dict[str, int] = {}
    for w in session.written:
        if w.command.type == pb.BaseCommand.MESSAGE:
            n = w.command.message.message_id.entryId
            key = keys[n % 8]
            assert owner.setdefault(key, w.command.message.consumer_id) == owner[key]
    assert sorted(session.entries(1) + session.entries(2)) == list(range(40))
    await close_all(sub)


async def test_key_shared_join_never_reorders_a_key(topic: FakeTopic) -> None:
    sub = await subscribe(topic, S.Key_Shared)
    session = FakeSession()
    first = await add(sub, session, 1, permits=100)
    for n in range(20):
        await topic.append(b"%d" % n, partition_key=f"k{n % 4}")
    await settle()
    assert len(session.entries(1)) == 20
    await add(sub, session, 2, permits=100)  # takes over half the hash range
    for n in range(20, 40):
        await topic.append(b"%d" % n, partition_key=f"k{n % 4}")
    await settle()
    moved = {n % 4 for n in session.entries(2)}
    # Keys that moved wait until the first consumer acked its outstanding entries.
    assert all(n < 20 or n % 4 not in moved for n in session.entries(2))
    ledger_id = session.messages(1)[0].message_id.ledgerId
    ack = commands.ack(1, [commands.message_id(ledger_id, e) for e in session.entries(1)])
    await sub.acknowledge(first, ack.ack)
    await settle()
    by_key: dict[int, list[int]] = {}
    for m in session.messages():
        by_key.setdefault(m.message_id.entryId % 4, []).append(m.message_id.entryId)
    for seq in by_key.values():
        assert seq == sorted(seq)
    assert sorted(session.entries(1) + session.entries(2)) == list(range(40))
    await close_all(sub)


# --- batch-index acks ----------------------------------------------------------------------


def test_ack_set_conversions_round_trip() -> None:
    acked = wire_to_acked([0b0110], 4)  # indexes 1, 2 unacked
    assert acked == bytes([0b1001])
    assert acked_to_wire(acked, 4) == ([0b0110], 2)
    assert acked_to_wire(b"", 70)[0] == [-1, 0b111111]


async def test_batch_index_acks_complete_an_entry(topic: FakeTopic) -> None:
    await topic.append(b"batch", num_messages_in_batch=4)
    sub = await subscribe(topic, S.Shared)
    session = FakeSession()
    c = await add(sub, session, 1, permits=10)
    [msg] = session.messages(1)
    pos = Position(msg.message_id.ledgerId, 0)

    def ack_indexes(*unacked: int) -> pb.CommandAck:
        mid = commands.message_id(pos.ledger_id, 0)
        mid.ack_set.append(sum(1 << i for i in unacked))
        return commands.ack(1, [mid]).ack

    await sub.acknowledge(c, ack_indexes(1, 2, 3))  # index 0 acked
    assert not sub.cursor.is_acknowledged(pos)
    assert sub.cursor.batch_ack_state(pos) == bytes([1])
    # A redelivery carries the consumer-side ack set: index 0 is not delivered again.
    await sub.redeliver(c, None)
    await settle()
    assert list(session.messages(1)[-1].ack_set) == [0b1110]
    await sub.acknowledge(c, ack_indexes(2, 3))
    await sub.acknowledge(c, ack_indexes(0, 1, 2))  # 3 acked; 0 and 1 were before
    assert not sub.cursor.is_acknowledged(pos)
    await sub.acknowledge(c, ack_indexes())
    assert sub.cursor.is_acknowledged(pos) and sub.cursor.backlog() == 0
    await close_all(sub)


# --- seek ----------------------------------------------------------------------------------


async def test_seek_by_id_and_by_time_disconnects_and_resets(topic: FakeTopic) -> None:
    for i in range(10):
        await topic.append(b"m%d" % i, publish_time=1000 + 10 * i)
    sub = await subscribe(topic, S.Exclusive)
    session = FakeSession()
    c = await add(sub, session, 1, permits=100)
    ledger_id = session.messages(1)[0].message_id.ledgerId
    await sub.acknowledge(c, commands.ack(1, [commands.message_id(ledger_id, 9)], True).ack)
    assert sub.cursor.backlog() == 0
    await sub.seek(timestamp_ms=1035)
    assert session.of_type(pb.BaseCommand.CLOSE_CONSUMER)
    assert 1 not in session.consumers and sub.consumers == []
    assert sub.cursor.read_position == Position(ledger_id, 4)
    assert sub.cursor.backlog() == 6
    await sub.seek(Position(ledger_id, 7))
    assert sub.cursor.backlog() == 3
    session2 = FakeSession()
    await add(sub, session2, 1, permits=100)
    assert session2.entries(1) == [7, 8, 9]
    await sub.seek(timestamp_ms=99_999)  # after everything
    assert sub.cursor.backlog() == 0
    await close_all(sub)


# --- delayed delivery ----------------------------------------------------------------------


async def test_delayed_delivery_holds_entries_until_due(topic: FakeTopic) -> None:
    clock: ManualClock = topic.clock
    now = clock.wall_ms()
    await topic.append(b"late", deliver_at_time=now + 5000)
    await topic.append(b"now")
    sub = await subscribe(topic, S.Shared)
    session = FakeSession()
    await add(sub, session, 1, permits=10)
    assert session.entries(1) == [1]
    clock.advance(4)
    await settle()
    assert session.entries(1) == [1]
    clock.advance(1)
    await settle()
    assert session.entries(1) == [1, 0]
    await close_all(sub)


# --- end of topic, handlers ----------------------------------------------------------------


async def test_reached_end_of_topic_after_everything_was_delivered(topic: FakeTopic) -> None:
    await topic.append(b"last")
    sub = await subscribe(topic, S.Exclusive)
    session = FakeSession()
    await add(sub, session, 1, permits=10)
    assert not session.of_type(pb.BaseCommand.REACHED_END_OF_TOPIC)
    await topic.ledger.terminate()
    sub.notify_new_entries()
    await settle()
    assert len(session.of_type(pb.BaseCommand.REACHED_END_OF_TOPIC)) == 1
    await close_all(sub)


async def test_unsubscribe_refused_while_others_are_connected(topic: FakeTopic) -> None:
    sub = await subscribe(topic, S.Shared)
    session = FakeSession()
    await add(sub, session, 1)
    await add(sub, session, 2)
    with pytest.raises(ConsumerBusy):
        await cc.handle_unsubscribe(session, pb.CommandUnsubscribe(consumer_id=1, request_id=3))
    await cc.handle_close_consumer(session, pb.CommandCloseConsumer(consumer_id=2, request_id=4))
    await cc.handle_unsubscribe(session, pb.CommandUnsubscribe(consumer_id=1, request_id=5))
    assert "s" not in topic.subscriptions
    assert [c.success.request_id for c in session.of_type(pb.BaseCommand.SUCCESS)] == [4, 5]
    assert topic.ledger.cursors() == []


async def test_session_close_redelivers_to_remaining_consumers(topic: FakeTopic) -> None:
    for i in range(4):
        await topic.append(b"m%d" % i)
    sub = await subscribe(topic, S.Shared)
    gone, stays = FakeSession(), FakeSession()
    await add(sub, gone, 1, permits=10)
    assert gone.entries(1) == [0, 1, 2, 3]
    await add(sub, stays, 2, permits=10)
    await cc.on_session_closed(gone)
    await settle()
    assert stays.entries(2) == [0, 1, 2, 3] and gone.consumers == {}
    await close_all(sub)

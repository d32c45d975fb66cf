"""Key_Shared dispatch of mixed-key batch entries (``core/batch_keys``): one part per
consumer, the same stored entry with an ack set masking the other consumers' messages."""

from __future__ import annotations

from anabranch.broker.dispatcher_entries import hash_slot, wire_to_acked
from anabranch.core.batch_keys import KEY_SLOTS_PROPERTY, encode_key_slots
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import Position
from tests.broker.test_subscriptions import (
    FakeSession,
    FakeTopic,
    S,
    add,
    close_all,
    settle,
    subscribe,
    topic,  # noqa: F401 (the fixture)
)

LOW = next(k for k in (f"low-{i}" for i in range(1000)) if hash_slot(k.encode()) <= 32768)
HIGH = next(k for k in (f"high-{i}" for i in range(1000)) if hash_slot(k.encode()) > 32768)


def unacked(message: pb.CommandMessage, size: int) -> list[int]:
    """The indexes a MESSAGE leaves for its consumer (no ack set: all of them)."""
    if not message.ack_set:
        return list(range(size))
    acked = int.from_bytes(wire_to_acked(list(message.ack_set), size), "little")
    return [i for i in range(size) if not acked >> i & 1]


async def test_a_mixed_batch_is_split_by_key_and_a_departed_part_moves(topic: FakeTopic) -> None:  # noqa: F811
    keys = [LOW, HIGH, HIGH, LOW]
    slots = encode_key_slots(k.encode() for k in keys)
    assert slots is not None
    sub = await subscribe(topic, S.Key_Shared)
    session = FakeSession()
    first = await add(sub, session, 1, permits=100)  # after the second: the high half
    second = await add(sub, session, 2, permits=100)  # the low half
    prop = pb.KeyValue(key=KEY_SLOTS_PROPERTY, value=slots)
    await topic.append(b"batch", num_messages_in_batch=4, properties=[prop])
    await settle()
    (to_first,) = session.messages(1)
    (to_second,) = session.messages(2)
    assert unacked(to_first, 4) == [1, 2] and unacked(to_second, 4) == [0, 3]
    assert first.unacked_messages == 2 and second.unacked_messages == 2
    # Each part costs the whole batch in permits: the client grants back a permit for every
    # index, the skipped ones too, so its receive queue stays bounded.
    assert first.permits == second.permits == 100 - 4

    # The first consumer acks "the entry" (all it was given): its part only.
    ledger_id = to_first.message_id.ledgerId
    await sub.acknowledge(first, commands.ack(1, [commands.message_id(ledger_id, 0)]).ack)
    await settle()
    position = Position(ledger_id, 0)
    assert not sub.cursor.is_acknowledged(position) and first.unacked_messages == 0

    # The second goes away unacknowledged: its part (alone) goes to the first.
    await sub.remove_consumer(second)
    await settle()
    again = session.messages(1)[1]
    assert unacked(again, 4) == [0, 3]
    await sub.acknowledge(first, commands.ack(1, [commands.message_id(ledger_id, 0)]).ack)
    await settle()
    assert sub.cursor.is_acknowledged(position)
    assert sub.dispatcher.stats()["msgInReplay"] == 0
    await close_all(sub)


async def test_a_stale_whole_entry_ack_of_a_split_batch_is_ignored(topic: FakeTopic) -> None:  # noqa: F811
    slots = encode_key_slots([LOW.encode(), HIGH.encode()])
    assert slots is not None
    sub = await subscribe(topic, S.Key_Shared)
    session = FakeSession()
    first = await add(sub, session, 1, permits=100)
    await add(sub, session, 2, permits=100)
    prop = pb.KeyValue(key=KEY_SLOTS_PROPERTY, value=slots)
    await topic.append(b"batch", num_messages_in_batch=2, properties=[prop])
    await settle()
    ledger_id = session.messages(1)[0].message_id.ledgerId
    # A consumer that got its part, reconnected (a new consumer, holding nothing), and
    # then acks "the entry": nobody's messages may be acknowledged by that.
    await sub.remove_consumer(first)
    await settle()
    late = await add(sub, session, 3, permits=100)
    await sub.acknowledge(late, commands.ack(3, [commands.message_id(ledger_id, 0)]).ack)
    await settle()
    assert not sub.cursor.is_acknowledged(Position(ledger_id, 0))
    assert sub.cursor.batch_ack_state(Position(ledger_id, 0)) is None
    await close_all(sub)

"""Key_Shared dispatch of mixed-key batch entries (``core/batch_keys``): one part per
consumer, the same stored entry with an ack set masking the other consumers' messages."""

from __future__ import annotations

import random
from typing import Any

from anabranch.broker.dispatcher_entries import hash_slot, wire_to_acked
from anabranch.core.batch_keys import KEY_SLOTS_PROPERTY, encode_key_slots
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import Position
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.testing.clock import ManualClock
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


async def run_random_schedule(seed: int) -> None:
    """Appends of single messages and mixed batches (some delayed), consumers joining,
    leaving, acknowledging and negatively acknowledging, time passing, at random. Checked
    at every delivery: each message of a key goes out only when every earlier one of that
    key (not delayed) is acknowledged or held by the same consumer; at the end every
    message was acknowledged exactly once."""
    rng = random.Random(seed)
    factory = MemoryManagedLedgerFactory()
    ledger = await factory.open("public/default/persistent/r")
    clock = ManualClock()
    fake = FakeTopic("persistent://public/default/r", ledger, clock)
    delayed: set[int] = set()  # entries sent with a delivery time
    sub = await subscribe(fake, S.Key_Shared)
    session = FakeSession()
    keys = [f"k{i}" for i in range(6)]
    entries: dict[int, list[tuple[str, int]]] = {}  # entry id -> (key, seq) per index
    next_seq = dict.fromkeys(keys, 0)
    consumers: dict[int, Any] = {}
    held: dict[int, set[tuple[int, int]]] = {}  # consumer id -> (entry, index) held
    acked: set[tuple[int, int]] = set()
    seen_messages = 0
    ids = iter(range(1, 1000))

    def check_new_deliveries() -> None:
        nonlocal seen_messages
        written = session.messages()
        for message in written[seen_messages:]:
            cid, entry = message.consumer_id, message.message_id.entryId
            for index in unacked(message, len(entries[entry])):
                key, seq = entries[entry][index]
                assert (entry, index) not in acked, "an acknowledged message came again"
                for other_entry, batch in entries.items():
                    for other_index, (k, s) in enumerate(batch):
                        if (
                            k == key
                            and s < seq
                            and (other_entry, other_index) not in acked
                            and other_entry not in delayed  # may come after later ones
                        ):
                            assert (other_entry, other_index) in held.get(cid, set()), (
                                f"seed {seed}: {key}:{seq} (entry {entry}) to c{cid} before "
                                f"{key}:{s} was done; entries {entries}; held {held}"
                            )
                held.setdefault(cid, set()).add((entry, index))
        seen_messages = len(written)

    async def ack_entry(cid: int, entry: int) -> None:
        mine = {(e, i) for e, i in held[cid] if e == entry}
        ack = commands.ack(cid, [commands.message_id(ledger_id, entry)])
        await sub.acknowledge(consumers[cid], ack.ack)
        held[cid] -= mine
        for item in mine:
            assert item not in acked, "acknowledged twice"
            acked.add(item)

    ledger_id = -1
    for _ in range(80):
        action = rng.random()
        if action < 0.45:
            batch = [rng.choice(keys) for _ in range(rng.choice([1, 1, 2, 3, 5]))]
            records = []
            for key in batch:
                records.append((key, next_seq[key]))
                next_seq[key] += 1
            meta: dict[str, Any] = {}
            if rng.random() < 0.2:
                meta["deliver_at_time"] = clock.wall_ms() + rng.choice([1000, 5000])
            if len(batch) == 1:
                meta["partition_key"] = batch[0]
            else:
                meta["num_messages_in_batch"] = len(batch)
                slots = encode_key_slots(k.encode() for k in batch)
                if slots is not None:
                    meta["properties"] = [pb.KeyValue(key=KEY_SLOTS_PROPERTY, value=slots)]
                else:
                    meta["partition_key"] = batch[0]
            position = await fake.append(b"m", **meta)
            ledger_id = position[0]
            entries[position[1]] = records
            if "deliver_at_time" in meta:
                delayed.add(position[1])
        elif action < 0.5:
            clock.advance(rng.choice([0.5, 2.0]))
            sub.dispatcher.kick()
        elif action < 0.6 and len(consumers) < 4:
            cid = next(ids)
            consumers[cid] = await add(sub, session, cid, permits=rng.choice([3, 50]))
        elif action < 0.7 and consumers:
            cid = rng.choice(sorted(consumers))
            await sub.remove_consumer(consumers.pop(cid))
            held.pop(cid, None)
        elif action < 0.76 and consumers:  # a negative ack: the entry goes back
            cid = rng.choice(sorted(consumers))
            entries_held = sorted({e for e, _ in held.get(cid, set())})
            if entries_held:
                entry = rng.choice(entries_held)
                await sub.redeliver(consumers[cid], [commands.message_id(ledger_id, entry)])
                held[cid] = {(e, i) for e, i in held[cid] if e != entry}
        elif consumers:
            cid = rng.choice(sorted(consumers))
            entries_held = sorted({e for e, _ in held.get(cid, set())})
            if entries_held:
                await ack_entry(cid, rng.choice(entries_held))
            consumers[cid].add_permits(rng.choice([1, 5]))
            sub.dispatcher.kick()
        await settle()
        check_new_deliveries()
    if not consumers:
        consumers[999] = await add(sub, session, 999, permits=1000)
    clock.advance(10.0)  # every delayed message is due
    sub.dispatcher.kick()
    for _ in range(200):  # drain: ack whatever is held until everything is
        await settle()
        check_new_deliveries()
        busy = [(cid, e) for cid in consumers for e, _ in sorted(held.get(cid, set()))]
        if not busy:
            if len(acked) == sum(len(b) for b in entries.values()):
                break
            for consumer in consumers.values():
                consumer.add_permits(100)
            sub.dispatcher.kick()
            continue
        cid, entry = busy[0]
        await ack_entry(cid, entry)
    assert acked == {(e, i) for e, batch in entries.items() for i in range(len(batch))}
    await close_all(sub)
    await factory.close()


async def test_random_schedules_keep_key_order_and_ack_everything_once() -> None:
    for seed in range(40):
        await run_random_schedule(seed)


async def test_a_part_whose_consumer_has_no_room_waits_alone(topic: FakeTopic) -> None:  # noqa: F811
    slots = encode_key_slots([LOW.encode(), HIGH.encode()])
    assert slots is not None
    sub = await subscribe(topic, S.Key_Shared)
    session = FakeSession()
    high = await add(sub, session, 1, permits=0)  # the high half, no room yet
    await add(sub, session, 2, permits=100)  # the low half
    prop = pb.KeyValue(key=KEY_SLOTS_PROPERTY, value=slots)
    await topic.append(b"batch", num_messages_in_batch=2, properties=[prop])
    await topic.append(b"low", partition_key=LOW)
    await topic.append(b"high", partition_key=HIGH)
    await settle()
    # The low part and the later low message went; the high ones wait, in order.
    assert [(m.message_id.entryId, unacked(m, 2)[:1]) for m in session.messages(2)] == [
        (0, [0]),
        (1, [0]),
    ]
    assert session.messages(1) == []
    high.add_permits(10)
    sub.dispatcher.kick()
    await settle()
    assert [m.message_id.entryId for m in session.messages(1)] == [0, 2]
    assert unacked(session.messages(1)[0], 2) == [1]
    await close_all(sub)

"""The non-persistent subscription's dispatch decisions, as properties.

``NonPersistentSubscription`` knows no sockets: its consumers write to ``FakeWriter``s, so
any interleaving of subscribes, permits, publishes and departures can be replayed and the
at-most-once rules checked after every step: each published message is either sent to
exactly one consumer of the subscription or counted as dropped; only consumers with
permits receive; Exclusive/Failover send only to the active consumer; Key_Shared sends a
key to one consumer while the consumer set stays the same; nothing stays pending.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.broker.consumer import Consumer, FakeWriter
from anabranch.broker.dispatcher_entries import EntryInfo
from anabranch.broker.nonpersistent_subscription import NonPersistentSubscription
from anabranch.errors import ConsumerBusy
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import Position

Sub = pb.CommandSubscribe
TYPES = [Sub.Exclusive, Sub.Shared, Sub.Failover, Sub.Key_Shared]

steps = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 2)),  # priority
        st.tuples(st.just("permits"), st.integers(0, 7), st.integers(0, 5)),
        st.tuples(st.just("publish"), st.integers(0, 9), st.integers(1, 4)),  # key, batch
        st.tuples(st.just("leave"), st.integers(0, 7)),
    ),
    max_size=80,
)


def received(consumer: Consumer) -> list[int]:
    writer = consumer.session
    assert isinstance(writer, FakeWriter)
    return [w.message.message_id.entryId for w in writer.written if w.entry is not None]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TYPES), steps)
def test_every_message_is_sent_once_or_dropped(
    sub_type: int, script: list[tuple[Any, ...]]
) -> None:
    sub = NonPersistentSubscription(None, "s", sub_type, "non-persistent://t/ns/x", -1)
    consumers: list[Consumer] = []
    everyone: list[Consumer] = []
    published = 0
    messages = 0
    next_id = 0
    key_owner: dict[int, Consumer] = {}
    for step in script:
        kind = step[0]
        if kind == "join":
            consumer = Consumer(FakeWriter(), next_id, f"c{next_id}", sub_type, priority=step[1])
            next_id += 1
            try:
                sub.attach(consumer)
            except ConsumerBusy:
                assert sub_type == Sub.Exclusive and consumers
                continue
            consumers.append(consumer)
            everyone.append(consumer)
            key_owner.clear()  # Key_Shared ranges move when consumers come and go
        elif kind == "permits" and consumers:
            consumers[step[1] % len(consumers)].add_permits(step[2])
        elif kind == "leave" and consumers:
            gone = consumers.pop(step[1] % len(consumers))
            sub.detach(gone)
            key_owner.clear()
        elif kind == "publish":
            key, batch = step[1], step[2]
            before = {c.consumer_id: (c.permits, len(received(c))) for c in consumers}
            position = Position(1, published)
            sent = sub.dispatch(position, b"entry", EntryInfo(batch, b"k%d" % key, None, 0))
            published += 1
            messages += batch
            takers = [c for c in consumers if len(received(c)) > before[c.consumer_id][1]]
            assert len(takers) == (1 if sent else 0)
            if sent:
                taker = takers[0]
                assert before[taker.consumer_id][0] > 0, "a consumer without permits got it"
                assert taker.permits == before[taker.consumer_id][0] - batch
                if sub_type in (Sub.Exclusive, Sub.Failover):
                    assert taker is sub.active
                if sub_type == Sub.Key_Shared:
                    assert key_owner.setdefault(key, taker) is taker
        for consumer in consumers:
            assert not consumer.pending and consumer.unacked_messages == 0
    delivered = sum(len(received(c)) for c in everyone)
    assert delivered <= published
    assert sub.messages_dropped + sub.messages_out == messages  # a batch counts its messages
    by_position: dict[int, int] = defaultdict(int)
    for consumer in everyone:
        for entry_id in received(consumer):
            by_position[entry_id] += 1
    assert all(count == 1 for count in by_position.values()), "a message went out twice"


def test_shared_skips_consumers_without_permits_and_drops_when_none_has() -> None:
    sub = NonPersistentSubscription(None, "s", Sub.Shared, "non-persistent://t/ns/x", -1)
    a = Consumer(FakeWriter(), 1, "a", Sub.Shared)
    b = Consumer(FakeWriter(), 2, "b", Sub.Shared)
    sub.attach(a)
    sub.attach(b)
    a.add_permits(2)
    info = EntryInfo(1, b"k", None, 0)
    results = [sub.dispatch(Position(1, i), b"e", info) for i in range(4)]
    assert results == [True, True, False, False]
    assert received(a) == [0, 1] and received(b) == []
    assert (sub.messages_out, sub.messages_dropped) == (2, 2)


def test_failover_moves_to_the_next_consumer_when_the_active_one_leaves() -> None:
    sub = NonPersistentSubscription(None, "s", Sub.Failover, "non-persistent://t/ns/x", 0)
    a = Consumer(FakeWriter(), 1, "a", Sub.Failover)
    b = Consumer(FakeWriter(), 2, "b", Sub.Failover)
    sub.attach(a)
    sub.attach(b)
    for c in (a, b):
        c.add_permits(10)
    assert sub.active is a  # partition 0: the first by name
    sub.dispatch(Position(1, 0), b"e", EntryInfo(1, b"k", None, 0))
    sub.detach(a)
    assert sub.active is b
    sub.dispatch(Position(1, 1), b"e", EntryInfo(1, b"k", None, 0))
    assert (received(a), received(b)) == ([0], [1])
    writer = b.session
    assert isinstance(writer, FakeWriter)
    changes = [w.command.active_consumer_change.is_active for w in writer.written
               if w.command.type == pb.BaseCommand.ACTIVE_CONSUMER_CHANGE]  # fmt: skip
    assert changes[-1] is True


def test_a_backed_up_connection_gets_nothing() -> None:
    class Backed(FakeWriter):
        write_paused = True

    sub = NonPersistentSubscription(None, "s", Sub.Exclusive, "non-persistent://t/ns/x", -1)
    c = Consumer(Backed(), 1, "c", Sub.Exclusive)
    sub.attach(c)
    c.add_permits(5)
    assert sub.dispatch(Position(1, 0), b"e", EntryInfo(1, b"k", None, 0)) is False
    assert (sub.messages_dropped, c.permits) == (1, 5)

"""Stream consumer and DAG session: pure parts (assignment diffs, the cumulative-ack position
vector, redirect parsing) and the reconnect/redirect paths against a real broker (plus a
scripted non-leader that redirects)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.aio import Client, MessageId
from anabranch.client.dag_session import DagSession, scalable_topic_name
from anabranch.client.stream_consumer import (
    DeliveryLog,
    StreamConsumer,
    StreamConsumerOptions,
    diff_assignment,
    leader_url,
)
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame
from anabranch.testing.broker import InProcessBroker
from tests.client.fake_broker import FakeBroker, Session

T = pb.BaseCommand
EVENTUALLY_ROUNDS = 1_000

# --- pure ----------------------------------------------------------------------------------------

assignments = st.dictionaries(st.integers(0, 8), st.sampled_from(["a", "b"]), max_size=6)


@given(assignments, assignments)
def test_applying_the_diff_gives_the_new_assignment(
    current: dict[int, str], new: dict[int, str]
) -> None:
    joined, left = diff_assignment(current, new)
    after = {k: v for k, v in current.items() if k not in left} | joined
    assert after == new
    assert not set(joined) & (set(current) - set(left)), "joined a segment already held"


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=30),
    st.lists(st.integers(0, 29), max_size=8),
)
def test_a_cumulative_ack_covers_every_earlier_delivery_once(
    segments: list[int], acks: list[int]
) -> None:
    log = DeliveryLog()
    deliveries = [(seg, MessageId(seg, i)) for i, seg in enumerate(segments)]
    for seg, mid in deliveries:
        log.record((seg, mid))
    covered = -1  # every delivery up to this index is acknowledged
    for ack in acks:
        index = ack % len(deliveries)
        seg, mid = deliveries[index]
        result = log.ack_upto(seg, mid)
        if index <= covered:
            assert result == {seg: mid}  # already covered: only its own segment, harmless
            continue
        expected: dict[int, MessageId] = {}
        for s, m in deliveries[covered + 1 : index + 1]:
            expected[s] = m  # the latest delivered per segment
        assert result == expected
        covered = index
    assert log.pending() == len(deliveries) - covered - 1


def test_a_redelivered_message_counts_from_its_latest_delivery() -> None:
    log = DeliveryLog()
    log.record((0, MessageId(1, 1)))
    log.record((1, MessageId(2, 1)))
    log.record((0, MessageId(1, 1)))  # the segment's consumer reconnected: redelivered
    assert log.ack_upto(1, MessageId(2, 1)) == {0: MessageId(1, 1), 1: MessageId(2, 1)}
    assert log.pending() == 1
    assert log.ack_upto(0, MessageId(1, 1)) == {0: MessageId(1, 1)}
    assert log.pending() == 0


def test_a_segment_that_left_is_forgotten() -> None:
    log = DeliveryLog()
    log.record((0, MessageId(1, 1)))
    log.record((1, MessageId(2, 1)))
    log.forget(0)
    assert log.ack_upto(1, MessageId(2, 1)) == {1: MessageId(2, 1)}
    assert log.pending() == 0


def test_leader_url_parsing() -> None:
    message = "this broker is not the controller of topic://t/n/x: the leader is pulsar://h:1"
    assert leader_url(message) == "pulsar://h:1"
    assert leader_url("this broker is not the controller of x: no leader is elected") is None
    assert leader_url("the leader is ") is None


def test_options_are_checked() -> None:
    with pytest.raises(Exception, match="receiver_queue_size"):
        StreamConsumerOptions(receiver_queue_size=0)
    with pytest.raises(Exception, match="bad stream consumer option"):
        StreamConsumerOptions.from_kwargs({"colour": "red"})


# --- against a real broker -----------------------------------------------------------------------


@dataclass
class World:
    broker: InProcessBroker
    client: Client


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with (
        InProcessBroker(tmp_path, ledgers="memory", consumer_grace_period_s=30.0) as broker,
        Client(broker.service_url) as client,
    ):
        yield World(broker, client)


async def eventually(condition: Callable[[], bool], what: str) -> None:
    for _ in range(EVENTUALLY_ROUNDS):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_a_dag_session_opens_a_new_session_after_its_connection_drops(world: World) -> None:
    topic = "topic://public/default/watched"
    await world.broker.service.scalable.create(topic, 1)
    pool = world.client._pool
    session = await DagSession.open(pool, scalable_topic_name(topic))
    first_id = session._session_id
    await (await pool.get()).close()
    await eventually(lambda: session._conn is not None and session._conn.is_open, "reconnected")
    assert session._session_id != first_id
    await world.broker.service.scalable.split(topic, 0)
    layout = await asyncio.wait_for(session.wait_for_change(0), 10)
    assert [s.segment_id for s in layout.active_segments()] == [1, 2]
    await session.close()
    with pytest.raises(Exception, match="closed"):
        await session.wait_for_change(layout.epoch)


async def test_a_dropped_controller_connection_re_registers_without_a_rebalance(
    world: World,
) -> None:
    topic = "topic://public/default/rereg"
    await world.broker.service.scalable.create(topic, 2)
    first = await world.client.subscribe_stream(topic, "s", consumer_name="one")
    second = await world.client.subscribe_stream(topic, "s", consumer_name="two")
    await eventually(lambda: len(first.segment_ids) == 1, "one segment each")
    mine, theirs, updates = first.segment_ids, second.segment_ids, second.assignment_updates
    old = first._registration.connection
    assert old is not None
    await old.close()
    await eventually(lambda: first._registration.connection not in (None, old), "re-registered")
    assert first.segment_ids == mine
    assert (second.segment_ids, second.assignment_updates) == (theirs, updates)
    await first.close()
    await second.close()


class RedirectingBroker(FakeBroker):
    """A broker that is not the controller: every SUBSCRIBE names the leader."""

    leader: str = ""

    def _answer(self, s: Session, frame: Frame) -> None:
        if frame.type != T.SCALABLE_TOPIC_SUBSCRIBE:
            super()._answer(s, frame)
            return
        body = frame.command.scalableTopicSubscribe
        resp = pb.CommandScalableTopicSubscribeResponse(
            request_id=body.request_id,
            error=pb.ServiceNotReady,
            message=f"this broker is not the controller of {body.topic}: the leader is "
            + self.leader,
        )
        s.write(
            s.conn.send(
                pb.BaseCommand(
                    type=T.SCALABLE_TOPIC_SUBSCRIBE_RESPONSE, scalableTopicSubscribeResponse=resp
                )
            )
        )


async def test_subscribe_follows_a_non_leader_redirect(world: World) -> None:
    topic = "topic://public/default/redirected"
    await world.broker.service.scalable.create(topic, 2)
    fake = RedirectingBroker()
    fake.leader = world.broker.service_url
    await fake.start()
    try:
        pool = world.client._pool
        session = await DagSession.open(pool, scalable_topic_name(topic))
        session.controller_url = fake.url  # as if the DAG named a broker that lost the lead
        stream = StreamConsumer(pool, session, "s", StreamConsumerOptions(consumer_name="r"))
        await stream._start()
        assert len(fake.of_type(T.SCALABLE_TOPIC_SUBSCRIBE)) == 1
        assert stream.segment_ids == [0, 1]
        await eventually(lambda: stream.connected_segment_ids == [0, 1], "subscribed")
        await stream.close()
    finally:
        await fake.stop()


def test_a_stream_segment_consumer_stamps_its_segment_and_the_topic_name() -> None:
    import random
    from types import SimpleNamespace

    from anabranch.client.consumer import Consumer, ConsumerOptions
    from anabranch.protocol.batch import join_batch, single_metadata

    pool = SimpleNamespace(new_handler_id=lambda: 9, random=random.Random(1))
    consumer = Consumer(pool, "segment://t/n/x/0000-ffff-3", "s", ConsumerOptions())  # type: ignore[arg-type]
    consumer._segment_stamp = 3
    consumer._display_topic = "topic://t/n/x"
    body = pb.CommandMessage(consumer_id=9, message_id=pb.MessageIdData(ledgerId=4, entryId=5))
    single = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=7)
    batched = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=7)
    batched.num_messages_in_batch = 2
    payload = join_batch(
        (single_metadata(1, i, "k", None, ()), v) for i, v in enumerate([b"a", b"b"])
    )
    for md, data, want in ((single, b"v", [(-1, 0)]), (batched, payload, [(0, 2), (1, 2)])):
        out = consumer._unpack(body, md, data)
        assert [(m.message_id.batch_index, m.message_id.batch_size) for m in out] == want
        assert all(m.message_id.segment_id == 3 for m in out)
        assert all(m.topic == "topic://t/n/x" and m._consumer_id == 9 for m in out)
    # Its own bookkeeping keys carry the segment too: a cumulative ack by such an id
    # clears what it covers.
    for m in consumer._unpack(body, batched, payload):
        consumer._on_dequeued(m)
    assert all(k.segment_id == 3 for k in consumer._batches)

"""The scalable-topic producer: pure routing and re-route state, then against a real
in-process broker (routing by key, auto-creation, transparent re-routing across splits
and merges, with and without deduplication, and the blocking facade)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import anabranch
from anabranch.admin.client import AdminClient
from anabranch.aio import Client, MessageId
from anabranch.client.dag_session import DagSession, scalable_topic_name
from anabranch.client.scalable_producer import Hold, RerouteState, ScalableProducer, SegmentRouter
from anabranch.core.hash_range import segment_hash
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import SegmentLayout, segment_name
from anabranch.errors import InvalidArgument, NotFound, TopicTerminated
from anabranch.testing.broker import InProcessBroker

KEYS = [f"key-{i}" for i in range(16)]

# --- pure: routing -----------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> SegmentLayout:
    """A layout after random splits and merges of adjacent active segments."""
    layout = SegmentLayout.initial(draw(st.integers(1, 4)), now_ms=0)
    for _ in range(draw(st.integers(0, 6))):
        active = layout.active_segments()
        if draw(st.booleans()) or len(active) < 2:
            target = draw(st.sampled_from(active))
            if target.hash_range.end > target.hash_range.start:
                layout = layout.split(target.segment_id, now_ms=0)
        else:
            i = draw(st.integers(0, len(active) - 2))
            layout = layout.merge(active[i].segment_id, active[i + 1].segment_id, now_ms=0)
    return layout


@given(layouts(), st.lists(st.text(max_size=8), max_size=20))
def test_keyed_messages_go_to_the_active_segment_holding_their_hash(
    layout: SegmentLayout, keys: list[str]
) -> None:
    router = SegmentRouter()
    for key in keys:
        segment = router.route(layout, key)
        assert segment.is_active
        assert segment.hash_range.contains(segment_hash(key))


@given(layouts())
def test_keyless_messages_cycle_over_every_active_segment(layout: SegmentLayout) -> None:
    router = SegmentRouter()
    active = layout.active_segments()
    picks = [router.route(layout, None).segment_id for _ in range(2 * len(active))]
    assert picks == [s.segment_id for s in active] * 2


# --- pure: re-route state ---------------------------------------------------------------------


def test_reroute_waits_for_every_answer_then_for_the_dag() -> None:
    state: RerouteState[str] = RerouteState()
    for serial, (segment, item) in enumerate([(0, "a1"), (1, "b1"), (0, "a2"), (0, "a3")]):
        state.sent(segment, serial, item)
    assert state.hold({0, 1}) is Hold.NONE
    state.answered(0, 0)  # a1 stored before the seal
    state.refused(0, 2)
    assert state.hold({0, 1}) is Hold.SETTLING  # a3 has no answer yet
    state.refused(0, 3)
    assert state.hold({0, 1}) is Hold.AWAIT_DAG  # the DAG still shows 0 active
    assert state.hold({1, 2, 3}) is Hold.RESEND
    assert state.release({1, 2, 3}) == ["a2", "a3"]
    assert state.hold({1, 2, 3}) is Hold.NONE
    assert state.in_flight(1) == 1  # b1 was never held up


def test_a_dag_that_moved_on_holds_sends_still_in_flight_on_the_old_segment() -> None:
    # The DAG can show the seal before the refusals arrive: nothing may overtake them.
    state: RerouteState[str] = RerouteState()
    state.sent(0, 0, "a1")
    assert state.hold({1, 2}) is Hold.SETTLING
    state.answered(0, 0)
    assert state.hold({1, 2}) is Hold.NONE


def test_a_refused_producer_creation_waits_for_the_dag() -> None:
    state: RerouteState[str] = RerouteState()
    state.segment_refused(0)
    assert state.hold({0, 1}) is Hold.AWAIT_DAG
    assert state.hold({1, 2, 3}) is Hold.NONE
    assert state.release({1, 2, 3}) == []
    assert state.sealed == set()


def test_giving_up_returns_the_held_items_and_forgets_the_seals() -> None:
    state: RerouteState[str] = RerouteState()
    state.sent(0, 5, "x")
    state.refused(0, 5)
    assert state.give_up() == ["x"]
    assert state.hold({0}) is Hold.NONE


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(["stored", "refused", "open"])),
        max_size=40,
    ),
    st.sets(st.integers(0, 6)),
)
def test_release_is_in_call_order_and_holds_match_their_causes(
    sends: list[tuple[int, str]], active: set[int]
) -> None:
    state: RerouteState[int] = RerouteState()
    for serial, (segment, _) in enumerate(sends):
        state.sent(segment, serial, serial)
    for serial, (segment, outcome) in enumerate(sends):
        if outcome == "stored":
            state.answered(segment, serial)
        elif outcome == "refused":
            state.refused(segment, serial)
    refused = [i for i, (_, outcome) in enumerate(sends) if outcome == "refused"]
    refused_segments = {sends[i][0] for i in refused}
    open_segments = {segment for segment, outcome in sends if outcome == "open"}
    stale = refused_segments | {s for s in open_segments if s not in active}
    hold = state.hold(active)
    if stale & open_segments:
        assert hold is Hold.SETTLING
    elif refused_segments & active:
        assert hold is Hold.AWAIT_DAG
    elif refused:
        assert hold is Hold.RESEND
        assert state.release(active) == refused
        assert state.hold(active) is Hold.NONE
    else:
        assert hold is Hold.NONE


def test_scalable_names() -> None:
    assert str(scalable_topic_name("topic://orders")) == "topic://public/default/orders"
    assert str(scalable_topic_name("orders")) == "topic://public/default/orders"
    with pytest.raises(InvalidArgument):
        scalable_topic_name("segment://public/default/o/0000-ffff-0")


# --- against a real broker ----------------------------------------------------------------------


@dataclass
class World:
    broker: InProcessBroker
    admin: AdminClient
    client: Client

    async def layout(self, topic: str) -> SegmentLayout:
        return SegmentLayout.from_dict(await self.admin.get_scalable_topic(topic))

    async def segment_contents(self, topic: str) -> dict[int, list[tuple[str, int]]]:
        """(key, seq) of every message stored in each segment, in storage order."""
        layout = await self.layout(topic)
        name = TopicName.parse(topic)
        out: dict[int, list[tuple[str, int]]] = {}
        for segment in layout:
            reader = await self.client.create_reader(str(segment_name(name, segment)))
            found: list[tuple[str, int]] = []
            while await reader.has_message_available():
                msg = await reader.read_next(timeout=5.0)
                assert msg is not None
                key, seq = msg.value.decode().split(":")
                assert key == msg.key
                found.append((key, int(seq)))
            await reader.close()
            out[segment.segment_id] = found
        return out


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            yield World(broker, admin, client)


async def _producer(world: World, topic: str, **options: object) -> ScalableProducer:
    producer = await world.client.create_producer(topic, **options)
    assert isinstance(producer, ScalableProducer)
    return producer


def _assert_each_key_in_order_once(
    contents: dict[int, list[tuple[str, int]]], layout: SegmentLayout, sent: dict[str, int]
) -> None:
    """Every (key, seq) stored exactly once; along the DAG (parents first), in order."""
    by_key: dict[str, list[int]] = defaultdict(list)
    order = sorted(layout, key=lambda s: (s.created_at_epoch, s.segment_id))
    for segment in order:
        for key, seq in contents[segment.segment_id]:
            by_key[key].append(seq)
    assert dict(by_key) == {k: list(range(n)) for k, n in sent.items() if n}


async def test_keyed_messages_land_on_the_segment_owning_their_hash(world: World) -> None:
    topic = "topic://public/default/routed"
    await world.admin.create_scalable_topic(topic, 2)
    producer = await _producer(world, topic, batching=False)
    layout = await world.layout(topic)
    for round_ in range(3):
        for key in KEYS:
            mid = await producer.send(f"{key}:{round_}".encode(), key=key)
            assert mid.segment_id == layout.find_active(segment_hash(key)).segment_id
    contents = await world.segment_contents(topic)
    for segment_id, stored in contents.items():
        segment = layout.segments[segment_id]
        assert stored, f"segment {segment_id} got nothing"
        assert all(segment.hash_range.contains(segment_hash(k)) for k, _ in stored)
    assert sorted(x for v in contents.values() for x in v) == sorted(
        (k, r) for k in KEYS for r in range(3)
    )
    assert producer.segment_ids == [0, 1]
    await producer.close()


async def test_a_full_bound_sends_the_open_batches_instead_of_waiting_out_their_delay(
    world: World,
) -> None:
    # The bound (10) fills long before any segment's batch (1000 messages) does: waiting
    # for room must send the open batches, or nothing is answered for the batch delay (an
    # hour here: the send loop below would hang until the test's own timeout).
    topic = "topic://public/default/bounded"
    await world.admin.create_scalable_topic(topic, 4)
    producer = await _producer(world, topic, pending_messages_max=10, batch_delay_s=3600.0)
    plain = await world.client.create_producer(
        "persistent://public/default/bounded", pending_messages_max=10, batch_delay_s=3600.0
    )
    for sender in (producer, plain):
        futures = [await sender.send_async(b"x", key=KEYS[i % 16]) for i in range(200)]
        assert sum(f.done() for f in futures) >= 190  # all but the last open batches
        await sender.flush()
        ids = await asyncio.gather(*futures)
        assert len(set(ids)) == 200
    assert {mid.segment_id for mid in ids} == {None}
    await producer.close()
    await plain.close()


async def test_an_awaited_send_does_not_wait_for_its_segment_s_batch_delay(
    world: World,
) -> None:
    topic = "topic://public/default/awaited"
    await world.admin.create_scalable_topic(topic, 2)
    producer = await _producer(world, topic, batch_delay_s=3600.0)  # never, in a test
    layout = await world.layout(topic)
    for key in KEYS[:4]:  # one at a time, to whichever segment holds the key
        mid = await producer.send(f"{key}:0".encode(), key=key)
        assert mid.segment_id == layout.find_active(segment_hash(key)).segment_id
    sent = await asyncio.gather(*(producer.send(f"{k}:1".encode(), key=k) for k in KEYS))
    # Sent in one loop turn: one batch per segment.
    assert len({(m.segment_id, m.ledger_id, m.entry_id) for m in sent}) == 2
    await producer.close()


async def test_keyless_messages_spread_over_the_active_segments(world: World) -> None:
    topic = "topic://public/default/keyless"
    await world.admin.create_scalable_topic(topic, 3)
    producer = await _producer(world, topic)
    futures = [await producer.send_async(b"x") for _ in range(30)]
    ids = await asyncio.gather(*futures)
    assert {mid.segment_id for mid in ids} == {0, 1, 2}
    await producer.close()


async def test_first_use_creates_the_topic_with_one_segment(world: World) -> None:
    topic = "topic://public/default/fresh"
    producer = await _producer(world, "topic://fresh")  # short form
    assert producer.topic == topic
    mid = await producer.send(b"first:0", key="first")
    assert mid.segment_id == 0
    layout = await world.layout(topic)
    assert [s.segment_id for s in layout.active_segments()] == [0]
    assert layout.segments[0].hash_range.start == 0 and layout.segments[0].hash_range.end == 0xFFFF
    await producer.close()


async def test_a_missing_topic_is_not_created_when_not_asked(world: World) -> None:
    with pytest.raises(NotFound):
        await DagSession.open(
            world.client._pool, scalable_topic_name("topic://absent"), create_if_missing=False
        )


async def test_sends_right_after_a_split_are_rerouted_transparently(world: World) -> None:
    topic = "topic://public/default/resplit"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await _producer(world, topic)
    sent: dict[str, int] = defaultdict(int)

    async def burst(rounds: int) -> list[MessageId]:
        futures = []
        for _ in range(rounds):
            for key in KEYS:
                futures.append(await producer.send_async(f"{key}:{sent[key]}".encode(), key=key))
                sent[key] += 1
        return list(await asyncio.gather(*futures))  # raises if any send failed

    await burst(5)
    # The DAG push may not have reached the producer yet: these sends can meet the seal.
    await world.broker.service.scalable.split(topic, 0)
    after = await burst(5)
    assert {mid.segment_id for mid in after} <= {1, 2}
    assert {mid.segment_id for mid in after} == {1, 2}
    layout = await world.layout(topic)
    _assert_each_key_in_order_once(await world.segment_contents(topic), layout, sent)
    await producer.close()


@pytest.mark.parametrize("dedup", [False, True])
async def test_splits_and_a_merge_while_producing_lose_and_reorder_nothing(
    world: World, dedup: bool
) -> None:
    topic = f"topic://public/default/churn-{int(dedup)}"
    if dedup:
        await world.admin.set_deduplication("public/default", True)
    await world.admin.create_scalable_topic(topic, 2)
    producer = await _producer(world, topic, batch_delay_s=0.002)
    sent: dict[str, int] = defaultdict(int)
    futures = []
    scalable = world.broker.service.scalable
    changes: dict[int, Callable[[], Awaitable[object]]] = {
        150: lambda: world.admin.split_segment(topic, 0),
        300: lambda: world.admin.split_segment(topic, 1),
        450: lambda: scalable.merge(topic, 3, 4),
    }
    change: asyncio.Task[object] | None = None
    for i in range(600):
        key = KEYS[i % len(KEYS)]
        futures.append(await producer.send_async(f"{key}:{sent[key]}".encode(), key=key))
        sent[key] += 1
        if i in changes:
            if change is not None:
                await change
            # The change runs while sends go on: some meet the seal in flight.
            change = asyncio.ensure_future(changes[i]())
        if i % 10 == 0:
            await asyncio.sleep(0.001)
    assert change is not None
    await change
    ids = await asyncio.gather(*futures)
    assert all(mid.segment_id is not None for mid in ids)
    layout = await world.layout(topic)
    assert layout.epoch == 3
    _assert_each_key_in_order_once(await world.segment_contents(topic), layout, sent)
    await producer.close()


async def test_the_blocking_client_produces_to_a_scalable_topic(world: World) -> None:
    topic = "topic://public/default/blocking"
    await world.admin.create_scalable_topic(topic, 2)
    url = world.broker.service_url

    def produce() -> list[MessageId]:
        with anabranch.Client(url) as client:
            producer = client.create_producer(topic)
            ids = [producer.send(f"{k}:0".encode(), key=k) for k in KEYS]
            future = producer.send_async(b"late:0", key="late")
            producer.flush()
            ids.append(future.result())
            producer.close()
            return ids

    ids = await asyncio.to_thread(produce)
    layout = await world.layout(topic)
    keys = [*KEYS, "late"]
    assert [m.segment_id for m in ids] == [
        layout.find_active(segment_hash(k)).segment_id for k in keys
    ]


async def test_a_seal_the_dag_never_shows_fails_the_held_sends_after_the_bound(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    from anabranch.client import scalable_producer

    monkeypatch.setattr(scalable_producer, "SCALABLE_PRODUCER_REROUTE_WAIT_S", 0.3)
    topic = "topic://public/default/stuck"
    await world.admin.create_scalable_topic(topic, 2)
    producer = await _producer(world, topic, batching=False)
    layout = await world.layout(topic)
    key = "a"  # segment_hash("a") == 0x3c25: segment 0
    assert layout.find_active(segment_hash(key)).segment_id == 0
    await producer.send(b"a:0", key=key)
    # Terminated behind the controller's back: no split, so no DAG will ever show a seal.
    await world.admin.terminate_segment(
        str(segment_name(TopicName.parse(topic), layout.segments[0]))
    )
    with pytest.raises(TopicTerminated, match="no DAG showing"):
        await producer.send(b"a:1", key=key)
    # The producer keeps working on the other segment.
    other = await producer.send(b"key-0:0", key="key-0")  # 0xe337: segment 1
    assert other.segment_id == 1
    await producer.close()

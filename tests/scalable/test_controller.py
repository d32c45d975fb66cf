"""ScalableTopicController over memory, SQLite and a real etcd: layouts, segment topics,
leader election and fencing, and recovery of a half-done split."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from anabranch.clock import SystemClock
from anabranch.core.names import SegmentName, TopicName
from anabranch.core.segment_layout import SegmentLayout, SegmentState, segment_name
from anabranch.errors import (
    AlreadyExists,
    LedgerSealed,
    MetadataUnavailable,
    NotFound,
    NotLeader,
    SegmentSealed,
    SegmentsNotAdjacent,
    UnknownSegment,
)
from anabranch.metadata.api import MetadataStore, Session
from anabranch.scalable.controller import ScalableTopicController
from anabranch.scalable.paths import LeaderAddress, TopicPaths
from anabranch.scalable.segment_ops import (
    StorageSegmentOps,
    decode_dedup_snapshot,
    segment_ledger_name,
)
from anabranch.storage.api import EARLIEST
from anabranch.storage.memory import MemoryManagedLedgerFactory
from tests.scalable.conftest import eventually

TOPIC = TopicName.parse("topic://public/default/orders")
PATHS = TopicPaths(TOPIC)


class Crash(Exception):
    """A simulated broker crash between two steps of a split."""


class FaultyOps(StorageSegmentOps):
    """StorageSegmentOps with a hook run before (or after) terminating a segment."""

    def __init__(self, ledgers: MemoryManagedLedgerFactory) -> None:
        super().__init__(ledgers)
        self.before_terminate: Callable[[], Awaitable[None]] | None = None
        self.after_terminate: Callable[[], Awaitable[None]] | None = None

    async def terminate_segment(self, segment: SegmentName) -> bytes:
        if self.before_terminate is not None:
            await self.before_terminate()
        snapshot = await super().terminate_segment(segment)
        if self.after_terminate is not None:
            await self.after_terminate()
        return snapshot


class Cluster:
    """Several brokers' controllers of one topic on one metadata store."""

    def __init__(self, store: MetadataStore, ops: StorageSegmentOps) -> None:
        self.store = store
        self.ops = ops
        self.sessions: list[Session] = []
        self.controllers: list[ScalableTopicController] = []

    async def controller(self, url: str, *, start: bool = True) -> ScalableTopicController:
        session = await self.store.open_session(30.0)
        self.sessions.append(session)
        controller = ScalableTopicController(
            self.store, TOPIC, self.ops, SystemClock(), session, broker_url=url
        )
        self.controllers.append(controller)
        if start:
            await controller.start()
        return controller

    async def close(self) -> None:
        for controller in self.controllers:
            await controller.close()
        for session in self.sessions:
            await session.close()


@pytest.fixture
async def cluster(store: MetadataStore, ops: StorageSegmentOps) -> AsyncIterator[Cluster]:
    c = Cluster(store, ops)
    try:
        yield c
    finally:
        await c.close()


def seg(layout: SegmentLayout, segment_id: int) -> SegmentName:
    return segment_name(TOPIC, layout.segment(segment_id))


async def test_create_then_split_and_merge_give_exact_layouts(
    cluster: Cluster, ledgers: MemoryManagedLedgerFactory
) -> None:
    leader = await cluster.controller("pulsar://b1:6650")
    assert leader.is_leader and leader.leader_url == "pulsar://b1:6650"
    layout = await leader.create(2)
    assert [s.hash_range.to_hex() for s in layout.active_segments()] == ["0000-7fff", "8000-ffff"]
    with pytest.raises(AlreadyExists):
        await leader.create(2)
    await leader.create_subscription("billing")
    # A message in the parent before the split stays readable after it.
    parent = await ledgers.open(segment_ledger_name(seg(layout, 0)))
    await parent.append(b"before-split")
    await parent.close()

    layout = await leader.split(0)
    assert layout.epoch == 1 and layout.next_segment_id == 4
    assert [(s.segment_id, s.hash_range.to_hex()) for s in layout.active_segments()] == [
        (2, "0000-3fff"),
        (3, "4000-7fff"),
        (1, "8000-ffff"),
    ]
    assert layout.segment(0).state is SegmentState.SEALED
    assert layout.segment(0).child_ids == (2, 3)
    stored = SegmentLayout.from_json((await cluster.store.get(PATHS.layout)).value)  # type: ignore[union-attr]
    assert stored.to_dict() == layout.to_dict()
    assert await cluster.store.get(PATHS.pending_op) is None
    assert await cluster.store.get(PATHS.sealed(0)) is not None

    sealed = await ledgers.open(segment_ledger_name(seg(layout, 0)))
    try:
        with pytest.raises(LedgerSealed):
            await sealed.append(b"after-split")
        assert [e.data for e in await sealed.read(EARLIEST)] == [b"before-split"]
    finally:
        await sealed.close()
    for child in (2, 3):
        ml = await ledgers.open(segment_ledger_name(seg(layout, child)))
        try:
            assert {c.name: c.mark_delete_position for c in ml.cursors()} == {"billing": EARLIEST}
            assert not ml.is_terminated
        finally:
            await ml.close()

    layout = await leader.merge(3, 2)
    assert layout.epoch == 2 and layout.next_segment_id == 5
    assert [(s.segment_id, s.hash_range.to_hex()) for s in layout.active_segments()] == [
        (4, "0000-7fff"),
        (1, "8000-ffff"),
    ]
    assert layout.segment(4).parent_ids == (3, 2)
    assert await cluster.ops.segment_subscriptions(seg(layout, 4)) == ["billing"]


async def test_illegal_merge_or_split_is_rejected_with_nothing_written(cluster: Cluster) -> None:
    leader = await cluster.controller("pulsar://b1:6650")
    await leader.create(3)
    await leader.split(1)  # 1 sealed; active: 0, 3, 4, 2
    before = await cluster.store.current_revision()
    with pytest.raises(SegmentsNotAdjacent) as not_adjacent:
        await leader.merge(0, 2)
    assert (not_adjacent.value.first_id, not_adjacent.value.second_id) == (0, 2)
    with pytest.raises(SegmentSealed) as sealed:
        await leader.merge(1, 2)
    assert sealed.value.segment_id == 1
    with pytest.raises(SegmentSealed):
        await leader.split(1)
    with pytest.raises(UnknownSegment):
        await leader.merge(0, 99)
    assert await cluster.store.current_revision() == before
    assert await cluster.store.get(PATHS.pending_op) is None
    assert (await leader.get_layout()).epoch == 1


async def test_one_leader_others_redirect_and_failover(cluster: Cluster) -> None:
    first = await cluster.controller("pulsar://b1:6650")
    second = await cluster.controller("pulsar://b2:6650")
    third = await cluster.controller("pulsar://b3:6650")
    assert [c.is_leader for c in (first, second, third)] == [True, False, False]
    assert second.leader_url == third.leader_url == "pulsar://b1:6650"
    await first.create(1)
    with pytest.raises(NotLeader) as redirect:
        await second.split(0)
    assert redirect.value.leader_url == "pulsar://b1:6650"
    assert redirect.value.http_status == 307

    # The leader's broker dies: its session ends, its key goes, one of the others wins.
    await cluster.sessions[0].close()
    await eventually(lambda: second.is_leader or third.is_leader, "a new leader")
    await asyncio.sleep(0.05)
    new, other = (second, third) if second.is_leader else (third, second)
    assert not other.is_leader and not first.is_leader
    await eventually(lambda: other.leader_url == new.broker_url, "followers learn the leader")
    layout = await new.split(0)
    assert layout.epoch == 1
    record = await cluster.store.get(PATHS.controller)
    assert record is not None and LeaderAddress.decode(record.value).http == new.broker_url


async def test_deposed_leader_cannot_write(cluster: Cluster) -> None:
    # The old leader runs no campaign loop, so it does not notice it lost the key: only
    # the fencing token stops it (a paused broker waking up after its session expired).
    old = await cluster.controller("pulsar://b1:6650", start=False)
    await old._try_acquire(first=True)
    assert old.is_leader
    await old.create(2)
    await cluster.store.delete(PATHS.controller)
    new = await cluster.controller("pulsar://b2:6650")
    assert new.is_leader and old.is_leader  # old still believes it
    before = await cluster.store.current_revision()
    with pytest.raises(NotLeader) as err:
        await old.split(0)
    assert err.value.leader_url == "pulsar://b2:6650"
    assert not old.is_leader
    assert await cluster.store.current_revision() == before
    layout = await new.get_layout()
    assert layout.epoch == 0
    assert await cluster.store.get(PATHS.pending_op) is None


async def test_leader_deposed_mid_split_fails_its_layout_cas(
    store: MetadataStore, ledgers: MemoryManagedLedgerFactory
) -> None:
    ops = FaultyOps(ledgers)
    cluster = Cluster(store, ops)
    try:
        old = await cluster.controller("pulsar://b1:6650", start=False)
        await old._try_acquire(first=True)
        await old.create(2)
        new_holder = await store.open_session(30.0)
        cluster.sessions.append(new_holder)

        async def depose() -> None:
            await store.delete(PATHS.controller)
            await store.put(PATHS.controller, b"pulsar://b2:6650", 0, session=new_holder)

        ops.after_terminate = depose
        with pytest.raises(NotLeader):
            await old.split(0)
        layout = SegmentLayout.from_json((await store.get(PATHS.layout)).value)  # type: ignore[union-attr]
        assert layout.epoch == 0, "a deposed leader's layout write must not land"
        assert await store.get(PATHS.pending_op) is not None
    finally:
        await cluster.close()
        await ops.close()


@pytest.mark.parametrize("crash_point", ["before_terminate", "after_terminate"])
async def test_new_leader_completes_a_half_done_split(
    store: MetadataStore, ledgers: MemoryManagedLedgerFactory, crash_point: str
) -> None:
    ops = FaultyOps(ledgers)
    cluster = Cluster(store, ops)
    try:
        first = await cluster.controller("pulsar://b1:6650")
        await first.create(2)
        await first.create_subscription("billing")

        async def crash() -> None:
            raise Crash

        setattr(ops, crash_point, crash)
        with pytest.raises(Crash):
            await first.split(1)
        setattr(ops, crash_point, None)
        assert await store.get(PATHS.pending_op) is not None
        assert (await first.get_layout()).epoch == 0
        await first.close()  # the crashed broker's key goes away

        second = await cluster.controller("pulsar://b2:6650")
        assert second.is_leader
        layout = await second.get_layout()
        assert layout.epoch == 1
        assert [s.segment_id for s in layout.active_segments()] == [0, 2, 3]
        assert await store.get(PATHS.pending_op) is None
        assert await store.get(PATHS.sealed(1)) is not None
        assert decode_dedup_snapshot((await store.get(PATHS.sealed(1))).value) == {}  # type: ignore[union-attr]
        for child in (2, 3):
            assert await ops.segment_subscriptions(seg(layout, child)) == ["billing"]
        sealed = await ledgers.open(segment_ledger_name(seg(layout, 1)))
        try:
            assert sealed.is_terminated
        finally:
            await sealed.close()
    finally:
        await cluster.close()
        await ops.close()


async def test_a_split_whose_seal_failed_is_finished_by_its_leader_without_a_request(
    store: MetadataStore, ledgers: MemoryManagedLedgerFactory
) -> None:
    """A segment operation fails (its owner just died): the request fails with the retriable
    error, and the leader finishes the recorded change in the background, so the topic is
    not "in progress" until the next leadership change (issue 19, item 3)."""
    ops = FaultyOps(ledgers)
    cluster = Cluster(store, ops)
    try:
        leader = await cluster.controller("pulsar://b1:6650")
        await leader.create(2)
        failures = [MetadataUnavailable("segment operation failed: Cannot connect")]

        async def owner_unreachable_once() -> None:
            if failures:
                raise failures.pop()

        ops.before_terminate = owner_unreachable_once
        with pytest.raises(MetadataUnavailable):
            await leader.split(1)
        assert await store.get(PATHS.pending_op) is not None
        done: list[SegmentLayout] = []

        async def finished() -> None:
            layout = await leader.get_layout()
            if layout.epoch == 1 and await store.get(PATHS.pending_op) is None:
                done.append(layout)

        for _ in range(500):
            await finished()
            if done:
                break
            await asyncio.sleep(0.02)
        assert done, "the pending split was never finished"
        assert [s.segment_id for s in done[0].active_segments()] == [0, 2, 3]
        assert (await leader.split(0)).epoch == 2  # and the topic takes later changes
    finally:
        await cluster.close()
        await ops.close()


async def test_subscriptions_follow_records_and_parent_cursors(cluster: Cluster) -> None:
    leader = await cluster.controller("pulsar://b1:6650")
    layout = await leader.create(1)
    await leader.create_subscription("billing")
    with pytest.raises(AlreadyExists):
        await leader.create_subscription("billing")
    # A cursor that exists only on the parent segment (no record) is carried over too.
    await cluster.ops.create_segment(seg(layout, 0), ["legacy"])
    layout = await leader.split(0)
    for child in (1, 2):
        assert await cluster.ops.segment_subscriptions(seg(layout, child)) == ["billing", "legacy"]
    await leader.delete_subscription("billing")
    with pytest.raises(NotFound):
        await leader.delete_subscription("billing")
    assert await cluster.store.get(PATHS.subscription("billing")) is None
    for segment in layout:
        names = await cluster.ops.segment_subscriptions(seg(layout, segment.segment_id))
        assert "billing" not in names


async def test_followers_retire_when_the_leader_deletes_the_topic(cluster: Cluster) -> None:
    """A follower racing for the key of a deleted topic would lead it, and list it again,
    once the deleting leader stepped down."""
    leader = await cluster.controller("pulsar://b1:6650")
    await leader.create(2)
    followers = [await cluster.controller(f"pulsar://b{i}:6650") for i in (2, 3)]
    assert not any(f.is_leader for f in followers)
    await leader.delete()
    await eventually(lambda: all(f.retired for f in followers), "followers retire")
    assert await cluster.store.get(PATHS.controller) is None
    assert not any(f.is_leader for f in followers)
    # A new create (on any broker) gets a fresh controller and works as before.
    again = await cluster.controller("pulsar://b2:6650")
    assert again.is_leader and len(list(await again.create(1))) == 1


async def test_delete_topic_removes_segments_and_metadata(cluster: Cluster) -> None:
    leader = await cluster.controller("pulsar://b1:6650")
    layout = await leader.create(2)
    await leader.create_subscription("billing")
    layout = await leader.split(0)
    await leader.delete()
    assert await cluster.store.get(PATHS.layout) is None
    page = await cluster.store.list_prefix(PATHS.layout + "/")
    assert page.records == []
    for segment in layout:
        assert await cluster.ops.segment_subscriptions(seg(layout, segment.segment_id)) == []

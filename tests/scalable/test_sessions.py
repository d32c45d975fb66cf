"""Consumer sessions on the controller leader: grace period keep/expire with a manual
clock, restore by a new leader with a fresh grace period, children after a drain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from anabranch.core.assignment import PushAssignment
from anabranch.core.names import TopicName
from anabranch.metadata.api import MetadataStore, Session
from anabranch.scalable.controller import ScalableTopicController
from anabranch.scalable.paths import TopicPaths
from anabranch.scalable.segment_ops import StorageSegmentOps
from anabranch.testing.clock import ManualClock

TOPIC = TopicName.parse("topic://public/default/orders")
PATHS = TopicPaths(TOPIC)
GRACE_MS = 60_000


class Broker:
    def __init__(self, store: MetadataStore, ops: StorageSegmentOps, clock: ManualClock) -> None:
        self.store, self.ops, self.clock = store, ops, clock
        self.pushes: list[tuple[str, PushAssignment]] = []
        self.session: Session | None = None
        self.controller: ScalableTopicController | None = None

    async def start(self, url: str) -> ScalableTopicController:
        self.session = await self.store.open_session(30.0)
        self.controller = ScalableTopicController(
            self.store,
            TOPIC,
            self.ops,
            self.clock,
            self.session,
            broker_url=url,
            grace_period_ms=GRACE_MS,
            on_assignment=lambda sub, push: self.pushes.append((sub, push)),
        )
        await self.controller.start()
        return self.controller

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.close()
        if self.session is not None:
            await self.session.close()


@pytest.fixture
async def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def brokers(
    memory_store: MetadataStore, ops: StorageSegmentOps, clock: ManualClock
) -> AsyncIterator[list[Broker]]:
    made = [Broker(memory_store, ops, clock) for _ in range(2)]
    try:
        yield made
    finally:
        for broker in made:
            await broker.stop()


async def advance(clock: ManualClock, seconds: float) -> None:
    clock.advance(seconds)
    await clock.settle(200)


async def test_grace_period_keeps_then_expires(brokers: list[Broker], clock: ManualClock) -> None:
    broker = brokers[0]
    leader = await broker.start("pulsar://b1:6650")
    await leader.create(2)
    assert await leader.register_consumer("billing", "w1", consumer_id=1) == (0, 1)
    assert await leader.register_consumer("billing", "w2", consumer_id=2) == (1,)
    assert await leader.store.list_children(PATHS.consumers("billing")) == ["w1", "w2"]
    assert broker.pushes[-2:] == [
        ("billing", PushAssignment("w1", 1, (0,), 0)),
        ("billing", PushAssignment("w2", 2, (1,), 0)),
    ]

    # Within the grace period a dropped consumer keeps its share and gets it back.
    await leader.disconnect_consumer("billing", "w1", consumer_id=1)
    await advance(clock, 59)
    state = leader.assignment("billing")
    assert state is not None and dict(state.assignment) == {"w1": (0,), "w2": (1,)}
    pushes = len(broker.pushes)
    assert await leader.register_consumer("billing", "w1", consumer_id=3) == (0,)
    assert broker.pushes[pushes:] == [("billing", PushAssignment("w1", 3, (0,), 0))]

    # Past the grace period it is evicted: session node deleted, share dealt to w2.
    await leader.disconnect_consumer("billing", "w1", consumer_id=3)
    await advance(clock, 60.5)
    state = leader.assignment("billing")
    assert state is not None and dict(state.assignment) == {"w2": (0, 1)}
    assert await leader.store.list_children(PATHS.consumers("billing")) == ["w2"]
    assert broker.pushes[-1] == ("billing", PushAssignment("w2", 2, (0, 1), 0))


async def test_new_leader_restores_sessions_with_a_fresh_grace_period(
    brokers: list[Broker], clock: ManualClock
) -> None:
    first, second = brokers
    leader = await first.start("pulsar://b1:6650")
    await leader.create(2)
    await leader.register_consumer("billing", "w1", consumer_id=1)
    await leader.register_consumer("billing", "w2", consumer_id=2)
    await advance(clock, 50)
    await first.stop()  # the leader's broker goes away; sessions stay in the store

    new = await second.start("pulsar://b2:6650")
    assert new.is_leader
    state = new.assignment("billing")
    assert state is not None and dict(state.assignment) == {"w1": (0,), "w2": (1,)}
    assert all(not s.connected for s in state.sessions.values())
    # w2 finds the new leader in time; w1 never does.
    assert await new.register_consumer("billing", "w2", consumer_id=7) == (1,)
    await advance(clock, 59)  # 109 s after w1 registered: its fresh deadline has not passed
    state = new.assignment("billing")
    assert state is not None and "w1" in state.sessions
    await advance(clock, 2)
    state = new.assignment("billing")
    assert state is not None and dict(state.assignment) == {"w2": (0, 1)}
    assert await new.store.list_children(PATHS.consumers("billing")) == ["w2"]


async def test_children_are_assigned_once_the_parent_drains(
    brokers: list[Broker], clock: ManualClock
) -> None:
    broker = brokers[0]
    leader = await broker.start("pulsar://b1:6650")
    await leader.create(1)
    assert await leader.register_consumer("billing", "w1", consumer_id=1) == (0,)
    await leader.split(0)
    # The parent is empty, so the first drain poll retires it and the children follow.
    for _ in range(100):
        state = leader.assignment("billing")
        if state is not None and state.assignment["w1"] == (1, 2):
            break
        await asyncio.sleep(0)
    assert broker.pushes[-1] == ("billing", PushAssignment("w1", 1, (1, 2), 1))

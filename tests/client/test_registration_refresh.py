"""A consumer's controller registration follows the controller (issue 19, item 2).

Pure parts (when a registration is due for renewal) and, against a real broker in this
process, the three ways a registration learns that its controller stopped serving it: the
controller says so (CLOSE_CONSUMER when it loses the leadership), the DAG shows layout
epochs that no assignment update catches up with, and the failpoint that turns both off.
A three-broker run with a paused leader is in ``tests/cluster/test_fault_assignment.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from anabranch import failpoints
from anabranch.aio import Client
from anabranch.client import controller_registration
from anabranch.client.controller_registration import (
    AssignmentFreshness,
    ControllerRegistration,
    controller_moved,
)
from anabranch.client.dag_session import scalable_topic_name
from anabranch.client.stream_consumer import StreamConsumer
from anabranch.clock import SystemClock
from anabranch.core.assignment import PushAssignment
from anabranch.core.names import TopicName
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.scalable.controller import ScalableTopicController
from anabranch.scalable.paths import TopicPaths
from anabranch.scalable.segment_ops import StorageSegmentOps
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.testing.broker import InProcessBroker

EVENTUALLY_S = 60.0
"""Generous bound on a background condition (a loaded 2-core machine)."""

REFRESH_S = 0.3
"""The refresh bound these tests run with (the shipped one is 5 s)."""

# --- pure ----------------------------------------------------------------------------------


def test_an_assignment_behind_the_dag_is_overdue_after_the_bound() -> None:
    f = AssignmentFreshness(5.0)
    f.assigned(0, now=0.0)
    f.observed(0, now=1.0)
    assert f.deadline() is None and not f.overdue(100.0)
    f.observed(2, now=2.0)
    assert f.deadline() == 7.0
    assert (f.overdue(6.9), f.overdue(7.0)) == (False, True)
    f.observed(3, now=4.0)
    assert f.deadline() == 7.0, "the first sight of the lag counts, not the latest epoch"


def test_any_assignment_restarts_the_clock_and_a_current_one_stops_it() -> None:
    f = AssignmentFreshness(5.0)
    f.assigned(0, now=0.0)
    f.observed(3, now=1.0)
    f.assigned(1, now=4.0)  # a live controller working through the epochs
    assert f.deadline() == 9.0
    f.assigned(3, now=5.0)
    assert f.deadline() is None
    f.observed(1, now=6.0)  # an older DAG (a reconnect raced a push) changes nothing
    assert (f.dag_epoch, f.deadline()) == (3, None)


def test_an_assignment_older_than_the_dag_it_answers_starts_the_clock() -> None:
    f = AssignmentFreshness(5.0)
    f.observed(4, now=0.0)  # the DAG came first; the registration's answer is older
    f.assigned(2, now=1.0)
    assert f.deadline() == 6.0
    f.restart(3.0)  # a renewal is under way: its answer gets a full bound
    assert f.deadline() == 8.0


def test_controller_moved_compares_addresses() -> None:
    assert controller_moved(("b1", 6650), "pulsar://b2:6650")
    assert controller_moved(("b1", 6650), "pulsar://b1:6651")
    assert not controller_moved(("b1", 6650), "pulsar://b1:6650")
    assert not controller_moved(("b1", 6650), "pulsar://b1")  # the default port
    assert not controller_moved(("b1", 6650), None)
    assert not controller_moved(None, "pulsar://b2:6650")
    assert not controller_moved(("b1", 6650), "http://b2:8080")  # unusable: no news


def registration_at(
    service: list[tuple[str, int]], controller: str | None, segment_brokers: dict[int, str]
) -> ControllerRegistration:
    """A registration over stand-ins of a pool and a DAG session (no I/O: for
    ``_first_address``)."""
    pool = SimpleNamespace(
        random=lambda: 0.0, service_addresses=tuple(service), service_address=service[0]
    )
    session = SimpleNamespace(
        topic="topic://t/n/x", controller_url=controller, segment_brokers=segment_brokers
    )
    return ControllerRegistration(cast(Any, pool), cast(Any, session), "s", "c", pb.STREAM, print)


def test_a_renewal_starts_away_from_the_broker_it_left() -> None:
    left = ("b1", 6650)
    b2, b3 = ("b2", 6650), ("b3", 6650)
    reg = registration_at([left, b2, b3], "pulsar://b1:6650", {0: "pulsar://b3:6650"})
    assert reg._first_address(None) == left  # the DAG's controller, when nothing is left
    assert [reg._first_address(left) for _ in range(3)] == [b2, b3, b2]
    reg = registration_at([left, b2, b3], "pulsar://b2:6650", {})
    assert reg._first_address(left) == b2  # the DAG already names another controller
    # One bootstrap broker, and it is the one left: a broker the DAG names still redirects.
    reg = registration_at([left], "pulsar://b1:6650", {0: "pulsar://b3:6650", 1: "pulsar://b1"})
    assert reg._first_address(left) == b3
    reg = registration_at([left], "pulsar://b1:6650", {})
    assert reg._first_address(left) == left  # nowhere else to go


# --- the controller tells its broker -------------------------------------------------------


async def test_a_controller_that_stops_leading_tells_its_listeners() -> None:
    store = MemoryMetadataStore()
    topic = TopicName.parse("topic://public/default/told")
    ops = StorageSegmentOps(MemoryManagedLedgerFactory())
    session = await store.open_session(30.0)
    controller = ScalableTopicController(
        store, topic, ops, SystemClock(), session, broker_url="http://b1:8080"
    )
    told: list[TopicName] = []
    try:
        await controller.start()
        await controller.create(1)
        controller.add_leadership_listener(told.append)
        controller.add_leadership_listener(told.append)  # once per listener
        assert controller.is_leader and told == []
        # The key goes (as when the session expired): leadership ends, whatever comes next.
        await store.delete(TopicPaths(topic).controller)
        await wait_for(lambda: told == [topic], "the listener was told")
    finally:
        await controller.close()
        await session.close()


# --- against a real broker -----------------------------------------------------------------


@dataclass
class World:
    broker: InProcessBroker
    client: Client


@pytest.fixture
async def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[World]:
    monkeypatch.setattr(controller_registration, "SCALABLE_ASSIGNMENT_REFRESH_S", REFRESH_S)
    async with (
        InProcessBroker(tmp_path, ledgers="memory", consumer_grace_period_s=30.0) as broker,
        Client(broker.service_url) as client,
    ):
        yield World(broker, client)


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + EVENTUALLY_S
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


async def stream_of(world: World, topic: str, segments: int) -> StreamConsumer:
    await world.broker.service.scalable.create(topic, segments)
    stream = await world.client.subscribe_stream(topic, "s", consumer_name="one")
    await wait_for(lambda: len(stream.connected_segment_ids) == segments, "subscribed")
    return stream


def mute_pushes(world: World) -> Callable[[], None]:
    """From now on, no assignment push reaches any consumer, as from a leader that paused
    or was deposed with its connections open; returns the undo."""
    service = world.broker.service.scalable
    original = service._on_assignment

    def drop(topic: TopicName, subscription: str, push: PushAssignment) -> None:
        pass

    service._on_assignment = drop

    def undo() -> None:
        service._on_assignment = original

    return undo


async def test_a_controller_losing_the_lead_sends_its_consumers_to_register_again(
    world: World,
) -> None:
    topic = "topic://public/default/deposed"
    stream = await stream_of(world, topic, 2)
    registration = stream._registration
    old = registration.connection
    endpoint = world.broker.service.scalable_endpoint
    endpoint.controller_lost(scalable_topic_name(topic))  # CLOSE_CONSUMER to the client
    await wait_for(lambda: registration.connection not in (None, old), "registered again")
    assert old is not None and not old.is_open, "the old controller connection was left"
    assert registration.renewals == 1
    assert stream.segment_ids == [0, 1]
    assert endpoint.consumer_count() == 1
    await stream.close()


async def test_an_assignment_left_behind_by_the_dag_makes_the_consumer_register_again(
    world: World,
) -> None:
    topic = "topic://public/default/zombie"
    stream = await stream_of(world, topic, 1)
    registration = stream._registration
    assert stream.layout_epoch == 0
    undo = mute_pushes(world)
    await world.broker.service.scalable.split(topic, 0)
    # The DAG watch shows epoch 1; no update follows, so the consumer registers again, and
    # the answer carries the leader's epoch.
    await wait_for(lambda: stream.layout_epoch == 1, "an assignment of epoch 1")
    assert registration.renewals >= 1
    undo()
    # The empty parent drains; the children come with the answer or a later push.
    await wait_for(lambda: stream.segment_ids == [1, 2], "the children")
    renewals = registration.renewals
    await world.broker.service.scalable.split(topic, 1)
    await wait_for(lambda: stream.layout_epoch == 2, "the live leader's push of epoch 2")
    assert registration.renewals == renewals, "a live leader's push needs no renewal"
    await stream.close()


async def test_failpoint_no_assignment_refresh_keeps_the_old_behaviour(world: World) -> None:
    failpoints.activate({failpoints.NO_ASSIGNMENT_REFRESH})
    try:
        topic = "topic://public/default/stuck"
        stream = await stream_of(world, topic, 1)
        registration = stream._registration
        old = registration.connection
        world.broker.service.scalable_endpoint.controller_lost(scalable_topic_name(topic))
        mute_pushes(world)
        await world.broker.service.scalable.split(topic, 0)
        await asyncio.sleep(REFRESH_S * 10)
        assert (stream.layout_epoch, registration.renewals) == (0, 0)
        assert registration.connection is old
        # Only a dropped connection makes it register again.
        assert old is not None
        await old.close()
        await wait_for(lambda: stream.layout_epoch == 1, "registered again after the drop")
        await stream.close()
    finally:
        failpoints.activate(())

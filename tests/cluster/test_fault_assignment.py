"""A stream consumer keeps getting assignments when the controller leader is paused past
its session TTL and the layout keeps changing under the new leader (issue 19, item 2).

A paused leader keeps its TCP connections open and says nothing, so a consumer that
registered with it used to wait there until its connection dropped: it kept its sealed
segments, never got the children, and missed every message written after the split. Here
the leader stays paused while another broker leads and splits; the consumer must register
with the new leader, get the children, and receive every acknowledged message with each
key's messages in order.

The cluster (three brokers, session TTL ``SESSION_TTL_S``) starts once for the module; the
test resumes the broker it paused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from anabranch.aio import Client
from anabranch.client.stream_consumer import StreamConsumer
from anabranch.errors import Closed
from anabranch.testing.cluster import ClusterBroker, LocalCluster
from tests.cluster.local_cluster import SESSION_TTL_S, TAKEOVER_SLACK_S, others
from tests.cluster.test_cluster_scalable import (
    create_topic,
    layout_of,
    move_segment,
    segment_names,
)

KEYS = [f"key-{i}" for i in range(12)]

SPLITS_UNDER_THE_NEW_LEADER = 3

ASSIGNMENT_WAIT_S = 45.0
"""How long the consumer may take to hold an assignment of the newest layout epoch after
the last split (generous; the fix needs about a second once the DAG names the new
leader, and the old behaviour never gets there while the old leader sleeps)."""

DELIVERY_WAIT_S = 90.0
"""How long every acknowledged message may take to reach the consumer after sends stop."""


class Sender:
    """Sends numbered messages round-robin over ``KEYS`` (each ``send`` awaited, so a
    key's acknowledged messages are in send order) and records the acknowledged ones."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.acked: dict[str, list[int]] = collections.defaultdict(list)
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        for i in itertools.count():
            if self._stop.is_set():
                return
            key = KEYS[i % len(KEYS)]
            await self.producer.send(f"{key}:{i:07d}".encode(), key=key)
            self.acked[key].append(i)
            await asyncio.sleep(0.01)

    def count(self) -> int:
        return sum(len(v) for v in self.acked.values())

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(self._task, 60)


class Receiver:
    """Receives and acknowledges (cumulatively, each message) and records, per key, the
    sequence numbers in the order they first arrived."""

    def __init__(self, stream: StreamConsumer) -> None:
        self.stream = stream
        self.first_seen: dict[str, list[int]] = collections.defaultdict(list)
        self.seen: set[tuple[str, int]] = set()
        self.segments: set[int] = set()
        """Segments a message came from."""
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                msg = await self.stream.receive(timeout=0.5)
            except Closed:
                return
            if msg is None:
                continue
            assert msg.message_id.segment_id is not None
            self.segments.add(msg.message_id.segment_id)
            key, _, seq = msg.value.decode().partition(":")
            if msg.key == key and seq.isdigit() and (key, int(seq)) not in self.seen:
                self.seen.add((key, int(seq)))
                self.first_seen[key].append(int(seq))
            await self.stream.acknowledge_cumulative(msg)

    def count(self) -> int:
        return len(self.seen)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]], what: str, within: float
) -> None:
    """Wait until ``condition`` (a plain or async predicate) holds; fail after ``within``."""
    deadline = time.monotonic() + within
    while True:
        value = condition()
        if await value if inspect.isawaitable(value) else value:
            return
        assert time.monotonic() < deadline, f"never happened within {within}s: {what}"
        await asyncio.sleep(0.2)


async def split_at_the_leader(cluster: LocalCluster, topic: str, live: list[ClusterBroker]) -> int:
    """Split the widest active segment at whichever live broker leads (no redirect to the
    paused one is followed); returns the new epoch."""
    short = topic.split("://", 1)[1]
    deadline = time.monotonic() + SESSION_TTL_S + 10 * TAKEOVER_SLACK_S
    while True:
        layout = await layout_of(cluster, topic, live[0])
        active = [
            (s["hashRange"]["end"] - s["hashRange"]["start"], int(i))
            for i, s in layout["segments"].items()
            if s["state"] == "ACTIVE"
        ]
        widest = max(active)[1]
        for broker in live:
            status, body = await cluster.http(
                "POST", f"/admin/v2/scalable/{short}/split/{widest}", via=broker
            )
            if status == 200:
                return int(body["epoch"])
        assert time.monotonic() < deadline, f"no live broker split: {status} {body}"
        await asyncio.sleep(0.3)


async def test_a_stream_consumer_follows_a_paused_leader_s_successor(
    three_brokers: LocalCluster,
) -> None:
    cluster = three_brokers
    topic, leader = await create_topic(cluster, 2)
    live = others(cluster, leader)
    # No segment on the broker about to sleep: this test is about the controller only.
    names = segment_names(topic, await layout_of(cluster, topic, leader))
    for name in names.values():
        if await cluster.segment_owner(name) is leader:
            await move_segment(cluster, name, leader, live[0])

    async with Client(live[0].service_url) as client:
        stream = await client.subscribe_stream(topic, subscription="billing", consumer_name="w1")
        registration = stream._registration
        conn = registration.connection
        assert conn is not None and conn.address == (leader.host, leader.port)
        producer = await client.create_producer(topic)
        sender, receiver = Sender(producer), Receiver(stream)
        try:
            await eventually(lambda: receiver.count() >= 50, "first messages", 60)

            leader.pause()
            paused_at = time.monotonic()
            await eventually(
                lambda: _not_registered(cluster, leader, live[0]), "the registry drops it", 30
            )
            epoch = 0
            for _ in range(SPLITS_UNDER_THE_NEW_LEADER):
                epoch = await split_at_the_leader(cluster, topic, live)
                await asyncio.sleep(1.0)
            assert epoch == SPLITS_UNDER_THE_NEW_LEADER

            # Still paused: the consumer must have found the new leader on its own.
            await eventually(
                lambda: stream.layout_epoch == epoch,
                f"an assignment of epoch {epoch}",
                ASSIGNMENT_WAIT_S,
            )
            conn = registration.connection
            assert conn is not None and conn.address != (leader.host, leader.port)
            await eventually(
                lambda: bool(set(stream.segment_ids) - set(names)),
                "segments created under the new leader",
                ASSIGNMENT_WAIT_S,
            )
            children = set(stream.segment_ids) - set(names)
            await eventually(
                lambda: bool(receiver.segments & children),
                "messages from segments created under the new leader",
                ASSIGNMENT_WAIT_S,
            )
            assert time.monotonic() - paused_at > SESSION_TTL_S
            await sender.stop()
        finally:
            leader.resume()

        acked = {(k, i) for k, seqs in sender.acked.items() for i in seqs}
        await eventually(
            lambda: acked <= receiver.seen,
            f"all {len(acked)} acknowledged messages delivered",
            DELIVERY_WAIT_S,
        )
        await receiver.stop()
        for key, seqs in receiver.first_seen.items():
            assert seqs == sorted(seqs), f"{key} out of order"
        await stream.close()
        await producer.close()


async def _not_registered(cluster: LocalCluster, broker: ClusterBroker, via: ClusterBroker) -> bool:
    return broker.broker_id not in await cluster.registered(via=via)


async def test_a_registration_leaves_a_silent_controller_with_no_layout_change(
    three_brokers: LocalCluster,
) -> None:
    # Nothing changes the layout, so the DAG still names the sleeping leader: only the
    # registration's own keepalive can tell that its controller stopped answering.
    cluster = three_brokers
    topic, leader = await create_topic(cluster, 1)
    live = others(cluster, leader)
    async with Client(live[0].service_url) as client:
        stream = await client.subscribe_stream(topic, subscription="s", consumer_name="w1")
        registration = stream._registration
        old = registration.connection
        assert old is not None and old.address == (leader.host, leader.port)
        leader.pause()
        try:
            await eventually(
                lambda: registration.connection not in (None, old),
                "registered away from the paused leader",
                ASSIGNMENT_WAIT_S,
            )
            conn = registration.connection
            assert conn is not None and conn.address != (leader.host, leader.port)
            assert stream.segment_ids == [0]  # the share waited for it at the new leader
            epoch = await split_at_the_leader(cluster, topic, live)
            await eventually(
                lambda: stream.layout_epoch == epoch and stream.segment_ids == [1, 2],
                "the children of a split under the new leader",
                ASSIGNMENT_WAIT_S,
            )
        finally:
            leader.resume()
        await stream.close()

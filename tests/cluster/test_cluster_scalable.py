"""Scalable topics on three brokers: segments owned by different brokers, the DAG naming
each segment's owner, a split asked at a non-leader (307), and a controller leader killed
in the middle of a split, whose split another broker's controller finishes.

The cluster starts once for the module; a test that kills a broker starts it again.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from anabranch.aio import Client
from anabranch.core.hash_range import segment_hash
from anabranch.errors import TopicTerminated
from anabranch.metadata.etcd import EtcdMetadataStore
from anabranch.testing.cluster import ClusterBroker, LocalCluster
from tests.cluster.local_cluster import SESSION_TTL_S, TAKEOVER_SLACK_S, fresh_name, read_all
from tests.scalable.wire import RawClient

SCALABLE_TAKEOVER_S = 40.0
"""Bound on a new controller leader finishing a dead leader's split: the scalable
service's own session TTL (limits.SCALABLE_SESSION_TTL_S, 10 s) plus recovery."""


def segment_names(topic: str, layout: dict[str, Any]) -> dict[int, str]:
    """Segment id → ``segment://`` name of every segment in a layout."""
    base = topic.split("://", 1)[1]
    return {
        int(seg_id): f"segment://{base}/{s['hashRange']['start']:04x}-"
        f"{s['hashRange']['end']:04x}-{seg_id}"
        for seg_id, s in layout["segments"].items()
    }


async def create_topic(cluster: LocalCluster, segments: int) -> tuple[str, ClusterBroker]:
    """A new scalable topic; returns it and its controller leader."""
    topic = f"topic://public/default/{fresh_name('scal')}"
    short = topic.split("://", 1)[1]
    status, body, leader = await cluster.http_follow(
        "PUT", f"/admin/v2/scalable/{short}?numInitialSegments={segments}"
    )
    assert status == 204, body
    return topic, leader


async def layout_of(cluster: LocalCluster, topic: str, via: ClusterBroker) -> dict[str, Any]:
    status, layout = await cluster.http(
        "GET", f"/admin/v2/scalable/{topic.split('://', 1)[1]}", via=via
    )
    assert status == 200, layout
    return dict(layout)


async def produce(url: str, segment: str, values: list[bytes]) -> None:
    async with Client(url) as client:
        producer = await client.create_producer(segment)
        for value in values:
            await producer.send(value)


async def move_segment(
    cluster: LocalCluster, segment: str, owner: ClusterBroker, to: ClusterBroker
) -> None:
    """Unload ``segment`` from ``owner`` towards ``to``; a producer makes ``to`` claim it."""
    rest = segment.split("://", 1)[1]
    status, body = await cluster.http(
        "PUT", f"/admin/v2/segments/{rest}/unload?destinationBroker={to.broker_id}", via=owner
    )
    assert status == 204, body
    await produce(to.service_url, segment, [b"moved"])
    assert await cluster.segment_owner(segment) is to


async def remote_segment_owner(
    cluster: LocalCluster, topic: str, leader: ClusterBroker
) -> tuple[dict[int, str], ClusterBroker]:
    """The topic's segment names and the owner of segment 0, moved off the controller
    leader if the leader owned it (so the leader's segment operations go over the wire)."""
    names = segment_names(topic, await layout_of(cluster, topic, leader))
    owner = await cluster.segment_owner(names[0])
    assert owner is not None
    if owner is leader:
        other = next(b for b in cluster.brokers if b is not leader)
        await move_segment(cluster, names[0], owner, other)
        owner = other
    return names, owner


async def split_held_by_a_paused_owner(
    cluster: LocalCluster,
    store: EtcdMetadataStore,
    topic: str,
    leader: ClusterBroker,
    owner: ClusterBroker,
    *,
    deadline_s: float,
) -> asyncio.Future[tuple[int, Any]]:
    """Pause segment 0's owner and ask the leader to split it; returns the pending request
    once the split's intent is recorded (the seal is sent and unanswered)."""
    short = topic.split("://", 1)[1]
    owner.pause()
    split = asyncio.ensure_future(
        cluster.http("POST", f"/admin/v2/scalable/{short}/split/0", via=leader)
    )
    deadline = time.monotonic() + deadline_s
    while await store.get(f"/topics/{short}/pending-op") is None:
        assert time.monotonic() < deadline, "the split never recorded its intent"
        await asyncio.sleep(0.05)
    return split


async def test_segments_on_different_brokers_split_at_a_non_leader(
    three_brokers: LocalCluster,
) -> None:
    cluster = three_brokers
    topic, leader = await create_topic(cluster, 2)
    names = segment_names(topic, await layout_of(cluster, topic, leader))
    owners = {i: await cluster.segment_owner(name) for i, name in names.items()}
    assert all(owner is not None for owner in owners.values()), owners
    if owners[0] is owners[1]:
        other = next(b for b in cluster.brokers if b is not owners[0])
        assert owners[1] is not None
        await move_segment(cluster, names[1], owners[1], other)
        owners[1] = other
    assert owners[0] is not owners[1]

    # A DAG watch at any broker names each segment's owner and the controller leader.
    watcher = next(b for b in cluster.brokers if b is not leader)
    raw = await RawClient.connect(watcher.port)
    try:
        update = await raw.lookup(1, topic)
        assert not update.HasField("error"), update
        brokers = {e.segment_id: e.broker_url for e in update.dag.segment_brokers}
        assert brokers == {i: o.service_url for i, o in owners.items() if o is not None}
        assert update.dag.controller_broker_url == leader.service_url

        bootstrap = cluster.brokers[0].service_url
        await produce(bootstrap, names[0], [b"p0-a", b"p0-b"])
        await produce(bootstrap, names[1], [b"p1-a"])

        # A split at a non-leader is redirected to the leader, who splits a segment that
        # another broker owns (sealing it there).
        short = topic.split("://", 1)[1]
        status, location = await cluster.http(
            "POST", f"/admin/v2/scalable/{short}/split/0", via=watcher
        )
        if watcher is not leader:
            assert status == 307 and location.startswith(leader.http_url), (status, location)
        status, layout, answered = await cluster.http_follow(
            "POST", f"/admin/v2/scalable/{short}/split/0", via=watcher
        )
        assert status == 200 and answered is leader, (status, layout)
        assert layout["epoch"] == 1 and layout["segments"]["0"]["state"] == "SEALED"
        update = await raw.update(1)
        names = segment_names(topic, layout)
        reported = {e.segment_id: e.broker_url for e in update.dag.segment_brokers}
        assert set(reported) == {0, 1, 2, 3}
        for child in (2, 3):
            owner = await cluster.segment_owner(names[child])
            assert owner is not None and reported[child] == owner.service_url
    finally:
        await raw.close()

    # The sealed parent keeps its messages and refuses new ones; children take writes.
    with pytest.raises(TopicTerminated):
        await produce(bootstrap, names[0], [b"too-late"])
    stored = await read_all(bootstrap, names[0])
    assert [v for v in stored if v.startswith(b"p0")] == [b"p0-a", b"p0-b"]
    await produce(bootstrap, names[2], [b"child"])


async def test_sigkill_of_the_controller_leader_mid_split(three_brokers: LocalCluster) -> None:
    cluster = three_brokers
    topic, leader = await create_topic(cluster, 1)
    short = topic.split("://", 1)[1]
    names, owner = await remote_segment_owner(cluster, topic, leader)
    survivor = next(b for b in cluster.brokers if b not in (leader, owner))
    assert cluster.etcd is not None
    store = await EtcdMetadataStore.open(cluster.etcd.endpoint)
    try:
        # The segment's owner sleeps, so the leader's split stops half-way (its intent
        # recorded, the parent not sealed yet); then the leader dies.
        split = await split_held_by_a_paused_owner(
            cluster, store, topic, leader, owner, deadline_s=20
        )
        pending = f"/topics/{short}/pending-op"
        await asyncio.sleep(0.3)
        leader.kill()
        owner.resume()
        split.cancel()
        await asyncio.gather(split, return_exceptions=True)

        # Another broker's controller (started by a request there) is elected once the
        # dead leader's session expires, and finishes the split.
        status, _ = await cluster.http("POST", f"/admin/v2/scalable/{short}/split/0", via=survivor)
        assert status in (307, 503)
        deadline = time.monotonic() + SCALABLE_TAKEOVER_S
        while True:
            layout = await layout_of(cluster, topic, survivor)
            if layout["epoch"] == 1 and await store.get(pending) is None:
                break
            assert time.monotonic() < deadline, f"split not finished: {layout}"
            await asyncio.sleep(0.2)
    finally:
        owner.resume()
        await store.close()
    assert layout["segments"]["0"]["state"] == "SEALED"
    assert layout["segments"]["0"]["childIds"] == [1, 2]
    names = segment_names(topic, layout)
    await produce(survivor.service_url, names[1], [b"after-failover"])
    child_owner = await cluster.segment_owner(names[1])
    assert child_owner is not None and child_owner is not leader
    with pytest.raises(TopicTerminated):
        await produce(survivor.service_url, names[0], [b"too-late"])


async def test_sigkill_of_a_hot_segment_owner_with_keyed_traffic(
    three_brokers: LocalCluster,
) -> None:
    cluster = three_brokers
    topic, leader = await create_topic(cluster, 2)
    bootstrap = next(b for b in cluster.brokers if b is not leader)
    victim = next(b for b in cluster.brokers if b not in (leader, bootstrap))
    layout = await layout_of(cluster, topic, leader)
    names = segment_names(topic, layout)
    owners = {i: await cluster.segment_owner(name) for i, name in names.items()}
    if victim not in owners.values():
        owner = owners[0]
        assert owner is not None
        await move_segment(cluster, names[0], owner, victim)
        owners[0] = victim
    hot = next(i for i, owner in owners.items() if owner is victim)
    hot_range = layout["segments"][str(hot)]["hashRange"]
    in_hot = [
        k
        for k in (f"key-{i}" for i in range(200))
        if hot_range["start"] <= segment_hash(k) <= hot_range["end"]
    ]
    elsewhere = [k for k in (f"key-{i}" for i in range(200)) if k not in in_hot]
    keys = in_hot[:4] + elsewhere[:2]

    acked: list[tuple[str, int]] = []
    ack_times: list[float] = []
    received: list[tuple[str, int]] = []
    stop = asyncio.Event()
    produced = asyncio.Event()  # set once the last send was answered
    async with Client(bootstrap.service_url) as client:
        stream = await client.subscribe_stream(topic, subscription="s", consumer_name="c1")
        producer = await client.create_producer(topic, batching=False)

        async def produce_keys() -> None:
            for seq in itertools.count():
                for key in keys:
                    if stop.is_set():
                        return
                    await producer.send(f"{key}:{seq:06d}".encode(), key=key)
                    acked.append((key, seq))
                    ack_times.append(time.monotonic())

        async def consume() -> None:
            while not produced.is_set() or not set(acked) <= set(received):
                msg = await stream.receive(timeout=0.5)
                if msg is not None and b":" in msg.value:  # not move_segment's marker
                    key, seq = msg.value.decode().split(":")
                    received.append((key, int(seq)))
                    await stream.acknowledge_cumulative(msg)

        producing = asyncio.ensure_future(produce_keys())
        consuming = asyncio.ensure_future(consume())
        try:
            while len(acked) < 60:
                assert not producing.done(), producing
                await asyncio.sleep(0.05)
            victim.kill()
            killed = time.monotonic()
            while sum(t > killed for t in ack_times) < 60:
                assert not producing.done(), producing
                assert time.monotonic() - killed < SESSION_TTL_S + 30, "no recovery"
                await asyncio.sleep(0.05)
            stop.set()
            await producing
            produced.set()
            await asyncio.wait_for(consuming, 30)
        finally:
            stop.set()
            produced.set()
            producing.cancel()
            consuming.cancel()
    first = next(t for t in ack_times if t > killed)
    assert first - killed < SESSION_TTL_S + TAKEOVER_SLACK_S
    new_owner = await cluster.segment_owner(names[hot], via=bootstrap)
    assert new_owner is not None and new_owner is not victim

    # Stored: every acknowledged message once, each key's messages in send order.
    stored: list[tuple[str, int]] = []
    for name in names.values():
        for value in await read_all(bootstrap.service_url, name):
            if b":" in value:
                key, seq = value.decode().split(":")
                stored.append((key, int(seq)))
    assert len(stored) == len(set(stored)), "duplicates stored despite deduplication"
    assert set(acked) <= set(stored)
    for key in keys:
        seqs = [seq for k, seq in stored if k == key]
        assert seqs == sorted(seqs), f"{key} stored out of order"
    # Received: everything acknowledged; per key, first deliveries in order, no gaps.
    assert set(acked) <= set(received)
    for key in keys:
        firsts: list[int] = []
        for k, number in received:
            if k == key and number not in firsts:
                firsts.append(number)
        assert firsts == list(range(len(firsts))), f"{key} delivered out of order"


async def test_autoscale_splits_a_hot_segment_another_broker_owns(
    three_brokers: LocalCluster,
) -> None:
    """The controller leader reads segment 0's load from its owner over the wire
    (``GET .../cluster/segments/.../load``) and splits it once it is hot."""
    cluster = three_brokers
    topic, leader = await create_topic(cluster, 1)
    _, owner = await remote_segment_owner(cluster, topic, leader)
    assert owner is not leader
    short = topic.split("://", 1)[1]
    policy = {"enabled": True, "splitMsgRateIn": 20, "splitThroughputIn": 0,
              "splitSustainMs": 0, "splitCooldownMs": 0, "maxSegments": 2}  # fmt: skip
    other = next(b for b in cluster.brokers if b not in (leader, owner))
    status, body = await cluster.http(
        "POST", f"/admin/v2/scalable/{short}/autoscale", via=other, json=policy
    )
    assert status == 204, body
    async with Client(cluster.brokers[0].service_url) as client:
        producer = await client.create_producer(topic, batch_delay_s=0.002)
        for round_ in itertools.count():
            assert round_ < 600, "the hot segment was never split"  # hang guard (~2 min)
            await asyncio.gather(*[await producer.send_async(b"v", key=f"k{i}") for i in range(20)])
            await asyncio.sleep(0.2)
            if (await layout_of(cluster, topic, leader))["epoch"] >= 1:
                break
        await producer.close()
    layout = await layout_of(cluster, topic, leader)
    assert layout["segments"]["0"]["state"] == "SEALED"
    assert sorted(layout["segments"]["0"]["childIds"]) == [1, 2]
    status, metrics = await cluster.http("GET", "/metrics", via=leader)
    assert status == 200
    assert 'action="split",cluster=' in metrics and 'reason="msgRateIn"' in metrics

"""Three brokers across "machines": each its own data directory, nothing shared but etcd
and a 3-node NATS JetStream cluster (R3 streams, ``sync_interval: always``).

One cluster for the module (``LocalCluster(storage="jetstream")``); a test that kills a
broker or a NATS node brings it back before the next one starts. Deduplication is on in
``public/default``, so "exactly once" is checked on what is stored. Every broker runs with
the ``stale-owner-serves`` failpoint: a broker whose session ran out keeps serving, so the
only thing that can stop its appends is the JetStream fence (the conditional publish after
the new owner's ledger marker); the failpoint changes nothing while sessions hold.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from anabranch import failpoints
from anabranch.aio import Client
from anabranch.errors import AnabranchError, ProducerFenced
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.jetstream_client import JetStreamClient, StreamNotFound
from anabranch.testing.cluster import ClusterBroker, LocalCluster
from tests.cluster.local_cluster import (
    SESSION_TTL_S,
    TAKEOVER_SLACK_S,
    fresh_name,
    others,
    read_all,
)
from tests.cluster.test_cluster import Traffic
from tests.scalable.wire import RawClient

T = pb.BaseCommand

LEADER_FAILOVER_S = 15.0
"""Hang guard on a JetStream stream electing a new leader (NATS: a few seconds)."""
SEND_GUARD_S = 60.0
"""Hang guard on a send or producer creation that must fail."""


@pytest.fixture(scope="module")
def js_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(
        tmp_path_factory.mktemp("jscluster"),
        brokers=3,
        session_ttl_s=SESSION_TTL_S,
        storage="jetstream",
        nats_nodes=3,
        env={failpoints.ENV_VAR: failpoints.STALE_OWNER_SERVES},
    )
    asyncio.run(local.start())
    try:
        status, body = asyncio.run(
            local.http("POST", "/admin/v2/namespaces/public/default/deduplication", json=True)
        )
        assert status == 204, body
        yield local
    finally:
        asyncio.run(local.stop())


@pytest.fixture
async def cluster(js_cluster: LocalCluster) -> AsyncIterator[LocalCluster]:
    """The cluster, with every broker and NATS node running again after the test (in
    this module it stands in for conftest's file-backed ``cluster``)."""
    yield js_cluster
    nats = js_cluster.nats
    assert nats is not None
    for node in nats.nodes:
        node.resume()
        if not node.running:
            nats.start_node(node.name)
    await asyncio.to_thread(nats.wait_ready)
    for broker in js_cluster.brokers:
        broker.resume()
        if not broker.running:
            await broker.start()
    await js_cluster.wait_registered(len(js_cluster.brokers))


def fresh_topic(prefix: str) -> str:
    return f"persistent://public/default/{fresh_name(prefix)}"


async def check_nothing_lost(traffic: Traffic, url: str) -> list[bytes]:
    """Every acknowledged message was consumed and is stored exactly once, in order."""
    assert set(traffic.acked) <= traffic.received, "a consumer missed acknowledged messages"
    stored = await read_all(url, traffic.topic)
    assert len(stored) == len(set(stored)), "duplicates stored despite deduplication"
    assert set(traffic.acked) <= set(stored), "acknowledged messages lost"
    ours = [v for v in stored if v.startswith(b"msg-")]
    assert ours == sorted(ours), "stored out of send order"
    return stored


def stale_metadata() -> pb.MessageMetadata:
    return pb.MessageMetadata(producer_name="stale", sequence_id=1, publish_time=1)


def local_files(broker: ClusterBroker, cluster: LocalCluster) -> list[str]:
    return [str(p) for p in cluster.data_dir_of(broker.index).rglob("*") if p.is_file()]


async def test_every_broker_has_its_own_empty_data_directory(cluster: LocalCluster) -> None:
    topic = fresh_topic("own-dir")
    owner = await cluster.owner_of(topic)
    async with Client(cluster.service_url) as client:
        producer = await client.create_producer(topic)
        for i in range(20):
            await producer.send(f"m{i}".encode())
    dirs = {cluster.data_dir_of(b.index) for b in cluster.brokers}
    assert len(dirs) == len(cluster.brokers)
    # The ledger is in JetStream, not on the owner's disk; the broker says so at start.
    assert local_files(owner, cluster) == []
    started = " ".join(owner.log_path.read_text().split())  # the console wraps lines
    assert "ledgers on JetStream R3 at nats://127.0.0.1:" in started
    assert (await cluster.stream_leader(topic)).running


async def test_sigkill_of_the_stream_leader_during_produce_loses_nothing(
    cluster: LocalCluster,
) -> None:
    topic = fresh_topic("js-leader")
    async with Client(cluster.service_url) as client:
        traffic = Traffic(client, topic)
        await traffic.start()
        await traffic.wait_acks_after(time.monotonic(), 30, timeout_s=30)
        leader = await cluster.stream_leader(topic)
        leader.kill()
        killed_at = time.monotonic()
        await traffic.wait_acks_after(killed_at, 30, timeout_s=LEADER_FAILOVER_S + 30)
        await traffic.stop()
        await traffic.drain(timeout_s=20)
        new_leader = await cluster.stream_leader(topic)
    assert new_leader is not leader
    await check_nothing_lost(traffic, cluster.service_url)


async def test_sigkill_of_the_owner_during_produce_loses_nothing(cluster: LocalCluster) -> None:
    topic = fresh_topic("js-owner")
    owner = await cluster.owner_of(topic)
    (bootstrap, _) = others(cluster, owner)
    async with Client(bootstrap.service_url) as client:
        traffic = Traffic(client, topic)
        await traffic.start()
        await traffic.wait_acks_after(time.monotonic(), 30, timeout_s=30)
        owner.kill()
        killed_at = time.monotonic()
        await traffic.wait_acks_after(killed_at, 30, timeout_s=SESSION_TTL_S + 30)
        first = traffic.first_ack_after(killed_at)
        await traffic.stop()
        await traffic.drain(timeout_s=20)
    assert first is not None and first - killed_at < SESSION_TTL_S + TAKEOVER_SLACK_S
    assert await cluster.owner_of(topic, via=bootstrap) is not owner
    await check_nothing_lost(traffic, bootstrap.service_url)


async def test_a_stale_owner_cannot_append(cluster: LocalCluster) -> None:
    topic = fresh_topic("js-stale")
    owner = await cluster.owner_of(topic)
    (bootstrap, spare) = others(cluster, owner)
    # A producer connected straight to the owner (no lookup, no reconnect logic): what
    # it sends after the pause reaches the stale owner's ledger.
    raw = await RawClient.connect(owner.port)
    await raw.producer(topic, 1, "stale")
    before = await raw.produce(1, "stale", 0, b"from-the-owner")
    assert before.type == T.SEND_RECEIPT, before.command
    async with Client(bootstrap.service_url) as client:
        traffic = Traffic(client, topic)
        await traffic.start()
        await traffic.wait_acks_after(time.monotonic(), 20, timeout_s=30)
        owner.pause()
        paused_at = time.monotonic()
        try:
            # Its session runs out; another broker takes the topic, and opening the
            # ledger appends the new ledger's marker: the old owner's fence.
            await asyncio.sleep(SESSION_TTL_S + 1.0)
            async with Client(spare.service_url) as other_client:
                other = await other_client.create_producer(topic, producer_name="during-pause")
                await other.send(b"written-by-the-new-owner")
            new_owner = await cluster.owner_of(topic, via=spare)
            assert new_owner is not owner
        finally:
            owner.resume()
        # The woken broker still believes it serves (the failpoint): the SEND reaches
        # its ledger, whose conditional publish fails; the producer is closed, unanswered.
        await raw.send(commands.send(1, 1), stale_metadata(), b"from-the-stale-owner")
        answer = await raw.next(
            lambda f: f.type in (T.SEND_RECEIPT, T.SEND_ERROR, T.CLOSE_PRODUCER)
        )
        await raw.close()
        assert answer.type != T.SEND_RECEIPT, "the stale owner acknowledged an append"
        await traffic.wait_acks_after(paused_at, 20, timeout_s=30)
        await traffic.stop()
        await traffic.drain(timeout_s=20)
    stored = await check_nothing_lost(traffic, bootstrap.service_url)
    assert b"written-by-the-new-owner" in stored
    assert b"from-the-owner" in stored
    assert b"from-the-stale-owner" not in stored
    log = owner.log_path.read_text()
    assert "lost its metadata session" in log
    assert "ledger fenced by a new owner" in log
    # Restart it: the failpoint left it believing it owns topics it lost.
    owner.kill()


async def test_a_broker_on_a_fresh_machine_serves_the_whole_history(
    cluster: LocalCluster,
) -> None:
    topic = fresh_topic("js-fresh")
    owner = await cluster.owner_of(topic)
    values = [f"h{i:04d}".encode() for i in range(200)]
    async with Client(owner.service_url) as client:
        consumer = await client.subscribe(topic, "history", initial_position="earliest")
        producer = await client.create_producer(topic)
        for value in values:
            await producer.send(value)
        for _ in range(100):
            msg = await consumer.receive(timeout=10)
            assert msg is not None
            await consumer.acknowledge(msg)
        await consumer.close()
    fresh = await cluster.add_broker()
    try:
        assert local_files(fresh, cluster) == []
        short = topic.split("://", 1)[1]
        status, body = await cluster.http(
            "PUT",
            f"/admin/v2/persistent/{short}/unload?destinationBroker={fresh.broker_id}",
            via=owner,
        )
        assert status == 204, body
        assert await read_all(fresh.service_url, topic) == values
        assert await cluster.owner_of(topic, via=fresh) is fresh
        # The subscription's cursor came along (it is in etcd): the rest, nothing twice.
        async with Client(fresh.service_url) as client:
            consumer = await client.subscribe(topic, "history")
            rest = []
            while (msg := await consumer.receive(timeout=3)) is not None:
                rest.append(msg.value)
                await consumer.acknowledge(msg)
        assert rest == values[100:]
        assert local_files(fresh, cluster) == []
    finally:
        await fresh.stop()
        cluster.brokers.remove(fresh)


async def test_scalable_segments_on_jetstream_survive_an_owner_kill(
    cluster: LocalCluster,
) -> None:
    topic = f"topic://public/default/{fresh_name('js-scal')}"
    short = topic.split("://", 1)[1]
    status, body, _ = await cluster.http_follow(
        "PUT", f"/admin/v2/scalable/{short}?numInitialSegments=1"
    )
    assert status == 204, body
    parent = f"segment://{short}/0000-ffff-0"
    values = [f"s{i:04d}".encode() for i in range(150)]

    async def send(batch: list[bytes]) -> None:
        async with Client(cluster.service_url) as client:
            producer = await client.create_producer(topic, batching=False)
            for value in batch:
                await producer.send(value, key=value.decode())

    await send(values[:50])
    # A split seals the parent on its owner (a seal marker in its stream); the children
    # take the writes, each on its own stream.
    status, layout, _ = await cluster.http_follow("POST", f"/admin/v2/scalable/{short}/split/0")
    assert status == 200, layout
    assert layout["segments"]["0"]["state"] == "SEALED"
    children = [
        f"segment://{short}/{c['hashRange']['start']:04x}-{c['hashRange']['end']:04x}-{i}"
        for i, c in layout["segments"].items()
        if i != "0"
    ]
    assert len(children) == 2
    await send(values[50:100])
    owner = await cluster.segment_owner(children[0])
    assert owner is not None
    assert local_files(owner, cluster) == []
    owner.kill()
    await send(values[100:])
    survivor = next(b for b in cluster.brokers if b.running)
    assert await read_all(survivor.service_url, parent) == values[:50]
    in_children = [v for child in children for v in await read_all(survivor.service_url, child)]
    assert sorted(in_children) == values[50:]
    new_owner = await cluster.segment_owner(children[0])
    assert new_owner is not None and new_owner is not owner


async def test_a_stream_deleted_behind_our_back_fences_the_topic(cluster: LocalCluster) -> None:
    topic = fresh_topic("js-deleted")
    assert cluster.nats is not None
    async with Client(cluster.service_url) as client:
        producer = await client.create_producer(topic, batching=False)
        for i in range(20):
            await producer.send(f"d{i}".encode())
        js = await JetStreamClient.connect(cluster.nats.urls)
        try:
            await js.delete_stream(cluster.stream_of(topic))
        finally:
            await js.close()
        # The send is not acknowledged: a typed error, and nothing recreates the stream.
        with pytest.raises(AnabranchError) as raised:
            await asyncio.wait_for(producer.send(b"after-the-delete"), SEND_GUARD_S)
        assert not raised.value.retriable, raised.value
        assert "deleted" in str(raised.value)
        with pytest.raises(ProducerFenced, match="deleted behind our back"):
            await asyncio.wait_for(client.create_producer(topic), SEND_GUARD_S)
    js = await JetStreamClient.connect(cluster.nats.urls)
    try:
        with pytest.raises(StreamNotFound):
            await js.stream_info(cluster.stream_of(topic))
    finally:
        await js.close()
    # What the operator does: delete the topic; the name then starts afresh.
    short = topic.split("://", 1)[1]
    status, body, _ = await cluster.http_follow("DELETE", f"/admin/v2/persistent/{short}")
    assert status == 204, body
    async with Client(cluster.service_url) as client:
        producer = await client.create_producer(topic)
        await producer.send(b"afresh")
    assert await read_all(cluster.service_url, topic) == [b"afresh"]

"""Advertised listeners and topic-list watchers across a three-broker cluster: a lookup
naming a listener answers the owning broker's URL of that listener (each broker publishes
its listeners in its registry record), the official client follows it, and a watcher on
one broker hears of topics another broker creates."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulsar
import pytest

from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.cluster import LocalCluster
from tests.broker.test_core_protocol import RawClient
from tests.cluster.local_cluster import SESSION_TTL_S, fresh_name

T = pb.BaseCommand
P = "persistent://public/default"


class ListenerCluster(LocalCluster):
    """Every broker advertises its port as ``internal`` (127.0.0.1) and ``external``
    (localhost): two names, both reachable here."""

    async def _fronts_for(self, index: int, settings: dict[str, Any]) -> dict[str, Any]:
        port = settings["port"]
        return {
            "advertised_listeners": (
                f"internal:pulsar://127.0.0.1:{port},external:pulsar://localhost:{port}"
            )
        }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = ListenerCluster(tmp_path_factory.mktemp("listeners"), session_ttl_s=SESSION_TTL_S)
    asyncio.run(local.start())
    try:
        yield local
    finally:
        asyncio.run(local.stop())


async def lookup_external(port: int, topic: str) -> tuple[str, list[str]]:
    """Follow LOOKUP (naming ``external``) from the broker on ``port`` to a Connect; the
    URL answered and every URL seen."""
    seen: list[str] = []
    authoritative = False
    for _ in range(5):
        client = await RawClient.open(port)
        try:
            await client.handshake()
            body = pb.CommandLookupTopic(
                topic=topic,
                request_id=1,
                authoritative=authoritative,
                advertised_listener_name="external",
            )
            await client.send(T(type=T.LOOKUP, lookupTopic=body))
            answer = (await client.expect(T.LOOKUP_RESPONSE)).command.lookupTopicResponse
        finally:
            await client.close()
        assert answer.response != pb.CommandLookupTopicResponse.Failed, answer.message
        seen.append(answer.brokerServiceUrl)
        if answer.response == pb.CommandLookupTopicResponse.Connect:
            return answer.brokerServiceUrl, seen
        authoritative = answer.authoritative
        port = int(answer.brokerServiceUrl.rsplit(":", 1)[1])
    raise AssertionError(f"no Connect after {seen}")


async def test_a_named_listener_of_the_owner_is_answered(cluster: LocalCluster) -> None:
    ports = {b.port for b in cluster.brokers}
    for _ in range(3):
        topic = f"{P}/{fresh_name('ext')}"
        url, seen = await lookup_external(cluster.brokers[0].port, topic)
        assert all(u.startswith("pulsar://localhost:") for u in seen), seen
        port = int(url.rsplit(":", 1)[1])
        assert port in ports
        # Asked at a broker that does not own it: the owner's record names its listeners.
        other = next(b for b in cluster.brokers if b.port != port)
        path = f"/lookup/v2/topic/persistent/public/default/{topic.rsplit('/', 1)[1]}"
        status, owner = await cluster.http("GET", f"{path}?listenerName=external", via=other)
        assert status == 200 and owner["brokerUrl"] == f"pulsar://localhost:{port}"
        status, owner = await cluster.http("GET", path, via=other)
        assert status == 200 and owner["brokerUrl"] == f"pulsar://127.0.0.1:{port}"
        status, _ = await cluster.http("GET", f"{path}?listenerName=nope", via=other)
        assert status == 404


def official_external(url: str, topics: list[str]) -> list[bytes]:
    client = pulsar.Client(url, listener_name="external", operation_timeout_seconds=30)
    try:
        got = []
        for topic in topics:
            consumer = client.subscribe(
                topic, "s", initial_position=pulsar.InitialPosition.Earliest
            )
            client.create_producer(topic).send(topic.encode())
            msg = consumer.receive(timeout_millis=15_000)
            consumer.acknowledge(msg)
            got.append(bytes(msg.data()))
        return got
    finally:
        client.close()


async def test_official_client_through_the_external_listener(cluster: LocalCluster) -> None:
    topics = [f"{P}/{fresh_name('official-ext')}" for _ in range(3)]
    got = await asyncio.to_thread(official_external, cluster.brokers[1].service_url, topics)
    assert got == [t.encode() for t in topics]


async def test_a_watcher_hears_of_topics_created_through_other_brokers(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    prefix = fresh_name("watched")
    client = await RawClient.open(cluster.brokers[0].port)
    try:
        await client.handshake()
        body = pb.CommandWatchTopicList(
            request_id=1,
            watcher_id=1,
            namespace="public/default",
            topics_pattern=f"{P}/{prefix}-.*",
        )
        await client.send(T(type=T.WATCH_TOPIC_LIST, watchTopicList=body))
        success = (await client.expect(T.WATCH_TOPIC_LIST_SUCCESS)).command
        assert list(success.watchTopicListSuccess.topic) == []
        created = []
        for i in range(4):  # created through brokers 1 and 2 (whoever ends up owning them)
            topic = f"{P}/{prefix}-{i}"
            await asyncio.to_thread(
                official_external, cluster.brokers[1 + i % 2].service_url, [topic]
            )
            created.append(topic)
        heard: list[str] = []
        while len(heard) < len(created):
            update = (await client.expect(T.WATCH_TOPIC_UPDATE)).command.watchTopicUpdate
            heard.extend(update.new_topics)
        assert sorted(heard) == sorted(created)
    finally:
        await client.close()

"""A two-broker cluster with token authentication and TLS listeners: lookups redirect to
``pulsar+ssl://`` owners, brokers authenticate to each other (probes, segment operations,
forwarded unloads) with the cluster's broker token, and clients with the official client
and ours produce and consume through any broker."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pulsar
import pytest

from anabranch.aio import Client
from anabranch.testing.certificates import TestPki, TlsSetup
from anabranch.testing.cluster import LocalCluster
from anabranch.testing.security import TokenAuth
from tests.security.official import round_trip

_names = itertools.count()


@pytest.fixture(scope="module")
def secured_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalCluster, TokenAuth, TestPki]]:
    pki = TestPki.create(tmp_path_factory.mktemp("pki"))
    auth = TokenAuth()
    cluster = LocalCluster(
        tmp_path_factory.mktemp("cluster"),
        brokers=2,
        security=TlsSetup(pki, also=auth),
    )
    asyncio.run(cluster.start())
    try:
        yield cluster, auth, pki
    finally:
        asyncio.run(cluster.stop())


def fresh(prefix: str) -> str:
    return f"persistent://public/default/{prefix}-{next(_names)}"


async def test_admin_needs_a_token(
    secured_cluster: tuple[LocalCluster, TokenAuth, TestPki],
) -> None:
    cluster, _, _ = secured_cluster
    headers = cluster.http_headers
    cluster.http_headers = {}
    try:
        status, _ = await cluster.http("GET", "/admin/v2/tenants")
    finally:
        cluster.http_headers = headers
    assert status == 401
    status, body = await cluster.http("GET", "/admin/v2/tenants")
    assert status == 200 and "public" in body


async def test_our_client_over_tls_reaches_owners_on_both_brokers(
    secured_cluster: tuple[LocalCluster, TokenAuth, TestPki],
) -> None:
    cluster, auth, pki = secured_cluster
    first = cluster.brokers[0].service_url_tls
    assert first is not None
    owners = set()
    topics = [fresh("tls") for _ in range(6)]
    async with Client(
        first, auth_token=auth.token("alice"), tls_trust_certs_file_path=str(pki.ca_cert)
    ) as client:
        for topic in topics:
            producer = await client.create_producer(topic)
            await producer.send(topic.encode())
            owners.add((await cluster.owner_of(topic)).broker_id)
    # Lookups at the first broker sent the client to the second one's TLS port too.
    assert len(owners) == 2


async def test_official_client_over_tls_via_either_broker(
    secured_cluster: tuple[LocalCluster, TokenAuth, TestPki],
) -> None:
    cluster, auth, pki = secured_cluster
    for broker in cluster.brokers:
        url = broker.service_url_tls
        assert url is not None
        got = await asyncio.to_thread(
            round_trip,
            url,
            fresh("official"),
            tls_trust_certs_file_path=str(pki.ca_cert),
            authentication=pulsar.AuthenticationToken(auth.token("bob")),
        )
        assert got == [f"m-{i}".encode() for i in range(5)]


async def test_scalable_topic_segment_operations_between_brokers(
    secured_cluster: tuple[LocalCluster, TokenAuth, TestPki],
) -> None:
    cluster, auth, pki = secured_cluster
    name = f"scaled-{next(_names)}"
    status, body, _ = await cluster.http_follow(
        "PUT", f"/admin/v2/scalable/public/default/{name}?numInitialSegments=4"
    )
    assert status in (200, 204), body
    status, body, _ = await cluster.http_follow(
        "POST", f"/admin/v2/scalable/public/default/{name}/split/0"
    )
    assert status in (200, 204), body
    url = cluster.service_url_tls
    async with Client(
        url, auth_token=auth.token("carol"), tls_trust_certs_file_path=str(pki.ca_cert)
    ) as client:
        producer = await client.create_producer(f"topic://public/default/{name}")
        for i in range(20):
            await producer.send(b"x", key=f"k{i}")


async def test_namespace_unload_is_forwarded_with_the_broker_token(
    secured_cluster: tuple[LocalCluster, TokenAuth, TestPki],
) -> None:
    cluster, auth, pki = secured_cluster
    async with Client(
        cluster.service_url_tls,
        auth_token=auth.token("dave"),
        tls_trust_certs_file_path=str(pki.ca_cert),
    ) as client:
        for _ in range(4):
            producer = await client.create_producer(fresh("unload"))
            await producer.send(b"x")
    status, body = await cluster.http("PUT", "/admin/v2/namespaces/public/default/unload")
    assert status == 204, body

"""Lookups of topics that do not exist write nothing to etcd (issue 15, bounded resources).

Two cluster brokers on one etcd. A lookup of a name that would not be auto-created (its
namespace turns auto-creation off) fails with TopicNotFound and leaves etcd's keys as they
were; a lookup of a name that would be auto-created claims it (so concurrent lookups agree
on one owner), and the claim is released once it has stayed unused for
``idle_ownership_release_s``: random names looked up leave no records behind.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import msgspec
import pytest

from anabranch.broker.policies import AutoTopicCreationOverride, NamespacePolicies, Policies
from anabranch.client.connection import ConnectionPool
from anabranch.metadata.etcd import EtcdMetadataStore
from anabranch.testing.cluster import LocalCluster

pytestmark = pytest.mark.timeout(300)

IDLE_RELEASE_S = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(
        tmp_path_factory.mktemp("lookups"),
        brokers=2,
        session_ttl_s=3.0,
        idle_ownership_release_s=IDLE_RELEASE_S,
    )
    asyncio.run(local.start())
    try:
        yield local
    finally:
        asyncio.run(local.stop())


async def keys(store: EtcdMetadataStore) -> set[str]:
    out: set[str] = set()
    start: str | None = None
    while True:
        page = await store.list_prefix("/", start_after=start)
        out.update(r.path for r in page.records)
        if not page.more or not page.records:
            return out
        start = page.records[-1].path


async def lookup_all(cluster: LocalCluster, names: list[str]) -> list[object]:
    pools = [ConnectionPool(b.service_url) for b in cluster.brokers]
    try:
        return await asyncio.gather(
            *(pools[i % len(pools)].lookup(name) for i, name in enumerate(names)),
            return_exceptions=True,
        )
    finally:
        await asyncio.gather(*(pool.close() for pool in pools))


async def test_lookups_of_names_that_would_not_be_created_write_nothing(
    cluster: LocalCluster,
) -> None:
    assert cluster.etcd is not None
    store = await EtcdMetadataStore.open(cluster.etcd.endpoint)
    try:
        status, body = await cluster.http("PUT", "/admin/v2/namespaces/public/noauto")
        assert status in (204, 409), body
        off = AutoTopicCreationOverride(allow_auto_topic_creation=False)

        def no_auto(old: NamespacePolicies) -> NamespacePolicies:
            return msgspec.structs.replace(old, auto_topic_creation_override=off)

        await Policies(store).update_namespace_policies("public/noauto", no_auto)
        before = await keys(store)
        names = [f"persistent://public/noauto/{uuid.uuid4().hex}" for _ in range(200)]
        answers = await lookup_all(cluster, names)
        assert all(type(a).__name__ in ("NotFound", "TopicNotFound") for a in answers), answers[:3]
        assert await keys(store) == before
    finally:
        await store.close()


async def test_claims_of_looked_up_names_never_used_are_released(cluster: LocalCluster) -> None:
    assert cluster.etcd is not None
    store = await EtcdMetadataStore.open(cluster.etcd.endpoint)
    try:
        before = await keys(store)
        names = [f"persistent://public/default/{uuid.uuid4().hex}" for _ in range(100)]
        answers = await lookup_all(cluster, names)
        assert not [a for a in answers if isinstance(a, BaseException)], answers[:3]
        assert len(await keys(store) - before) == 100  # one ownership record per name
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30 * IDLE_RELEASE_S
        while (await keys(store)) - before and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)  # etcd's keys: polled, nothing to wait on here
        assert not (await keys(store)) - before
        # A name looked up again is claimed again, by exactly one broker.
        again = await lookup_all(cluster, [names[0]] * 4)
        assert len({str(a) for a in again}) == 1, again
    finally:
        await store.close()

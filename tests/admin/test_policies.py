"""Policies over the in-memory metadata store: CAS, validation, emptiness, partitions."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest

from anabranch.broker.policies import (
    ClusterData,
    NamespacePolicies,
    Policies,
    RetentionPolicies,
    TenantInfo,
    namespace_path,
    tenant_path,
)
from anabranch.core.names import NamespaceName
from anabranch.errors import AlreadyExists, BadVersion, InvalidArgument, NotEmpty, NotFound
from anabranch.metadata.memory import MemoryMetadataStore


@pytest.fixture
async def store() -> AsyncIterator[MemoryMetadataStore]:
    s = MemoryMetadataStore()
    yield s
    await s.close()


@pytest.fixture
async def policies(store: MemoryMetadataStore) -> Policies:
    p = Policies(store)
    await p.ensure_standalone_defaults()
    return p


async def keys(store: MemoryMetadataStore) -> list[str]:
    return [r.path for r in (await store.list_prefix("/")).records]


async def test_standalone_defaults_are_idempotent(
    policies: Policies, store: MemoryMetadataStore
) -> None:
    before = await keys(store)
    await policies.ensure_standalone_defaults()
    assert await keys(store) == before
    assert await policies.list_clusters() == ["standalone"]
    assert await policies.list_tenants() == ["public"]
    assert await policies.list_namespaces("public") == ["public/default"]
    assert (await policies.get_tenant("public")).allowed_clusters == ["standalone"]
    assert (await policies.get_cluster("standalone")).broker_service_url.startswith("pulsar://")
    assert before == [
        "/admin/clusters/standalone",
        "/admin/namespaces/public/default",
        "/admin/tenants/public",
    ]


async def test_records_use_pulsar_json_shapes(
    policies: Policies, store: MemoryMetadataStore
) -> None:
    await policies.set_namespace_policies(
        "public/default",
        NamespacePolicies(
            deduplication_enabled=True,
            retention=RetentionPolicies(retention_time_in_minutes=5, retention_size_in_mb=-1),
        ),
    )
    record = await store.get("/admin/namespaces/public/default")
    assert record is not None
    doc = msgspec.json.decode(record.value)
    assert doc["deduplicationEnabled"] is True
    assert doc["retention_policies"] == {"retentionTimeInMinutes": 5, "retentionSizeInMB": -1}
    tenant = msgspec.json.decode((await store.get("/admin/tenants/public")).value)  # type: ignore[union-attr]
    assert tenant == {"adminRoles": [], "allowedClusters": ["standalone"]}


@pytest.mark.parametrize("bad", ["", "a/b", "has space", "..", "x" * 256, "per%cent", "amp&ersand"])
async def test_invalid_names_write_nothing(
    policies: Policies, store: MemoryMetadataStore, bad: str
) -> None:
    before = await keys(store)
    revision = await store.current_revision()
    with pytest.raises(InvalidArgument):
        await policies.create_cluster(bad)
    with pytest.raises(InvalidArgument):
        await policies.create_tenant(bad)
    with pytest.raises(InvalidArgument):
        await policies.create_namespace(f"public/{bad}")
    with pytest.raises(InvalidArgument):
        await policies.create_partitioned_topic(f"persistent://public/default/{bad}", 2)
    with pytest.raises(InvalidArgument):
        await policies.register_topic(f"persistent://public/{bad}/x")
    assert await keys(store) == before
    assert await store.current_revision() == revision


async def test_tenant_with_unknown_cluster_is_refused(
    policies: Policies, store: MemoryMetadataStore
) -> None:
    with pytest.raises(InvalidArgument, match="nowhere"):
        await policies.create_tenant("acme", TenantInfo(allowed_clusters=["nowhere"]))
    assert await policies.list_tenants() == ["public"]


async def test_creates_are_exclusive(policies: Policies) -> None:
    with pytest.raises(AlreadyExists):
        await policies.create_cluster("standalone")
    with pytest.raises(AlreadyExists):
        await policies.create_tenant("public")
    with pytest.raises(AlreadyExists):
        await policies.create_namespace("public/default")
    with pytest.raises(NotFound):
        await policies.create_namespace("nobody/ns")


async def test_update_with_stale_version_fails_and_changes_nothing(policies: Policies) -> None:
    old, version = await policies.namespace_policies_version("public/default")
    await policies.set_namespace_policies(
        "public/default", NamespacePolicies(deduplication_enabled=True), expected_version=version
    )
    with pytest.raises(BadVersion):
        await policies.set_namespace_policies(
            "public/default",
            NamespacePolicies(deduplication_enabled=False),
            expected_version=version,
        )
    assert old.deduplication_enabled is False
    assert (await policies.namespace_policies("public/default")).deduplication_enabled is True


async def test_update_function_is_a_cas_loop(policies: Policies) -> None:
    def flip(p: NamespacePolicies) -> NamespacePolicies:
        count = (p.max_producers_per_topic or 0) + 1
        return msgspec.structs.replace(p, max_producers_per_topic=count)

    for _ in range(3):
        await policies.update_namespace_policies("public/default", flip)
    assert (await policies.namespace_policies("public/default")).max_producers_per_topic == 3


async def test_cluster_update_and_delete(policies: Policies) -> None:
    await policies.create_cluster("other", ClusterData(service_url="http://x:1"))
    await policies.update_cluster("other", ClusterData(service_url="http://y:2"))
    assert (await policies.get_cluster("other")).service_url == "http://y:2"
    with pytest.raises(NotEmpty):
        await policies.delete_cluster("standalone")  # tenant public still uses it
    await policies.delete_cluster("other")
    assert await policies.list_clusters() == ["standalone"]
    with pytest.raises(NotFound):
        await policies.delete_cluster("other")


async def test_non_empty_namespace_delete_is_refused(
    policies: Policies, store: MemoryMetadataStore
) -> None:
    assert await policies.register_topic("persistent://public/default/a") is True
    assert await policies.register_topic("persistent://public/default/a") is False
    with pytest.raises(NotEmpty):
        await policies.delete_namespace("public/default")
    # The refused delete left the namespace usable (its deleted mark was cleared).
    policies_now = await policies.namespace_policies("public/default")
    assert policies_now.deleted is False
    assert await policies.register_topic("persistent://public/default/b") is True
    assert await policies.list_topics("public/default") == [
        "persistent://public/default/a",
        "persistent://public/default/b",
    ]
    assert await policies.unregister_topic("persistent://public/default/a") is True
    assert await policies.unregister_topic("persistent://public/default/b") is True
    await policies.create_partitioned_topic("persistent://public/default/p", 2)
    with pytest.raises(NotEmpty):
        await policies.delete_namespace("public/default")
    assert await policies.delete_partitioned_topic("persistent://public/default/p") == 2
    await policies.delete_namespace("public/default")
    assert await store.get(namespace_path(NamespaceName("public", "default"))) is None
    with pytest.raises(NotFound):
        await policies.register_topic("persistent://public/default/c")


async def test_non_empty_tenant_delete_is_refused(policies: Policies) -> None:
    with pytest.raises(NotEmpty):
        await policies.delete_tenant("public")
    await policies.delete_namespace("public/default")
    await policies.delete_tenant("public")
    assert await policies.list_tenants() == []
    with pytest.raises(NotFound):
        await policies.list_namespaces("public")


async def test_namespace_create_fences_a_concurrent_tenant_delete(
    policies: Policies, store: MemoryMetadataStore
) -> None:
    # Creating a namespace re-puts the tenant, so a delete that read the older version fails.
    before = await store.get(tenant_path("public"))
    await policies.create_namespace("public/more")
    after = await store.get(tenant_path("public"))
    assert before is not None and after is not None
    assert after.stat.version == before.stat.version + 1
    with pytest.raises(BadVersion):
        await store.delete(tenant_path("public"), expected_version=before.stat.version)


async def test_registration_while_namespace_is_being_deleted_is_refused(
    policies: Policies,
) -> None:
    await policies.update_namespace_policies(
        "public/default", lambda p: msgspec.structs.replace(p, deleted=True)
    )
    with pytest.raises(NotFound):
        await policies.register_topic("persistent://public/default/x")
    with pytest.raises(NotFound):
        await policies.namespace_policies("public/default")
    with pytest.raises(NotFound):
        await policies.create_partitioned_topic("persistent://public/default/y", 2)


async def test_partitions_increase_only(policies: Policies) -> None:
    topic = "persistent://public/default/orders"
    assert await policies.get_partitions(topic) == 0
    await policies.create_partitioned_topic(topic, 3)
    assert await policies.get_partitions(topic) == 3
    assert await policies.get_partitions(topic + "-partition-1") == 0
    with pytest.raises(AlreadyExists):
        await policies.create_partitioned_topic(topic, 5)
    for smaller in (3, 2):
        with pytest.raises(InvalidArgument, match="only increase"):
            await policies.update_partitioned_topic(topic, smaller)
    assert await policies.get_partitions(topic) == 3
    await policies.update_partitioned_topic(topic, 5)
    assert (await policies.get_partitioned_topic(topic)).partitions == 5
    assert await policies.list_partitioned_topics("public/default") == [topic]
    with pytest.raises(InvalidArgument):
        await policies.create_partitioned_topic("persistent://public/default/z", 0)
    with pytest.raises(InvalidArgument):
        await policies.create_partitioned_topic(topic + "-partition-0", 2)
    with pytest.raises(NotFound):
        await policies.update_partitioned_topic("persistent://public/default/none", 2)


async def test_partitioned_and_plain_names_do_not_collide(policies: Policies) -> None:
    await policies.register_topic("persistent://public/default/plain")
    with pytest.raises(AlreadyExists):
        await policies.create_partitioned_topic("persistent://public/default/plain", 2)
    await policies.create_partitioned_topic("persistent://public/default/parted", 2)
    with pytest.raises(AlreadyExists):
        await policies.register_topic("persistent://public/default/parted")
    # Partitions of a partitioned topic register fine.
    assert await policies.register_topic("persistent://public/default/parted-partition-0")
    assert await policies.topic_exists("persistent://public/default/parted-partition-0")

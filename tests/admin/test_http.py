"""The admin HTTP API against an in-process broker (memory metadata and ledgers)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.admin.http import all_routes
from anabranch.client.client import Client
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/orders"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


@pytest.fixture
async def admin(broker: InProcessBroker) -> AsyncIterator[AdminClient]:
    assert broker.http_url is not None
    async with AdminClient(broker.http_url) as client:
        yield client


async def status_of(coro: object) -> int:
    """The HTTP status an admin call failed with."""
    with pytest.raises(AdminHttpError) as info:
        await coro  # type: ignore[misc]
    return info.value.status


async def produce(broker: InProcessBroker, topic: str, count: int) -> None:
    async with Client(broker.service_url) as client:
        producer = await client.create_producer(topic, batching=False)
        for i in range(count):
            await producer.send(f"m-{i}".encode())
        await producer.close()


# --- clusters, tenants, namespaces ---------------------------------------------------------


async def test_clusters(admin: AdminClient) -> None:
    assert await admin.list_clusters() == ["standalone"]
    await admin.create_cluster("east", "http://east:8080", "pulsar://east:6650")
    assert (await admin.get_cluster("east"))["brokerServiceUrl"] == "pulsar://east:6650"
    assert await status_of(admin.create_cluster("east")) == 409
    assert await status_of(admin.get_cluster("west")) == 404
    assert await status_of(admin.create_cluster("bad name")) == 400
    assert await status_of(admin.delete_cluster("standalone")) == 409  # tenant public uses it
    await admin.delete_cluster("east")
    assert await admin.list_clusters() == ["standalone"]
    assert await status_of(admin.delete_cluster("east")) == 404


async def test_tenants(admin: AdminClient) -> None:
    await admin.create_tenant("acme", allowed_clusters=["standalone"], admin_roles=["ops"])
    assert await admin.get_tenant("acme") == {
        "adminRoles": ["ops"],
        "allowedClusters": ["standalone"],
    }
    assert await admin.list_tenants() == ["acme", "public"]
    assert await status_of(admin.create_tenant("acme")) == 409
    assert await status_of(admin.create_tenant("other", allowed_clusters=["nowhere"])) == 400
    await admin.update_tenant("acme", allowed_clusters=[], admin_roles=["root"])
    assert (await admin.get_tenant("acme"))["adminRoles"] == ["root"]
    assert await status_of(admin.get_tenant("nobody")) == 404
    assert await status_of(admin.delete_tenant("public")) == 409  # has public/default
    await admin.delete_tenant("acme")
    assert await status_of(admin.delete_tenant("acme")) == 404


async def test_namespaces_and_deduplication(admin: AdminClient) -> None:
    await admin.create_namespace("public/orders")
    assert await admin.list_namespaces("public") == ["public/default", "public/orders"]
    assert await status_of(admin.create_namespace("public/orders")) == 409
    assert await status_of(admin.create_namespace("nobody/ns")) == 404
    assert await status_of(admin.list_namespaces("nobody")) == 404
    assert await admin.get_deduplication("public/orders") is False
    await admin.set_deduplication("public/orders", True)
    assert await admin.get_deduplication("public/orders") is True
    policies = await admin.get_namespace_policies("public/orders")
    assert policies["deduplicationEnabled"] is True
    await admin.remove_deduplication("public/orders")
    assert await admin.get_deduplication("public/orders") is False
    assert await status_of(admin.get_deduplication("public/none")) == 404
    bad = admin.request("POST", "/admin/v2/namespaces/public/orders/deduplication", "yes")
    assert await status_of(bad) == 400

    await admin.create_topic("persistent://public/orders/t")
    assert await admin.namespace_topics("public/orders") == ["persistent://public/orders/t"]
    assert await status_of(admin.delete_namespace("public/orders")) == 409
    await admin.delete_topic("persistent://public/orders/t")
    await admin.delete_namespace("public/orders")
    assert await status_of(admin.get_namespace_policies("public/orders")) == 404
    assert await status_of(admin.namespace_topics("public/orders")) == 404


async def test_namespace_created_with_policies(admin: AdminClient) -> None:
    await admin.create_namespace("public/ttl", {"message_ttl_in_seconds": 60})
    assert (await admin.get_namespace_policies("public/ttl"))["message_ttl_in_seconds"] == 60
    bad = admin.request("PUT", "/admin/v2/namespaces/public/ns2", {"deduplicationEnabled": 3})
    assert await status_of(bad) == 400


# --- topics ------------------------------------------------------------------------------------


async def test_non_partitioned_topic_lifecycle(admin: AdminClient) -> None:
    await admin.create_topic(TOPIC)
    assert await admin.list_topics("public/default") == [TOPIC]
    assert await status_of(admin.create_topic(TOPIC)) == 409
    assert await admin.get_partitions(TOPIC) == 0
    assert (await admin.stats(TOPIC))["msgInCounter"] == 0
    await admin.delete_topic(TOPIC)
    assert await admin.list_topics("public/default") == []
    assert await status_of(admin.delete_topic(TOPIC)) == 404
    assert await status_of(admin.stats(TOPIC)) == 404
    assert await status_of(admin.create_topic("persistent://public/nowhere/x")) == 404
    assert await status_of(admin.request("PUT", "/admin/v2/persistent/public/default/a%26b")) == 400


async def test_partitioned_topic_lifecycle(admin: AdminClient, broker: InProcessBroker) -> None:
    await admin.create_partitioned_topic(TOPIC, 2)
    assert await admin.get_partitions(TOPIC) == 2
    assert await admin.list_partitioned_topics("public/default") == [TOPIC]
    assert await admin.list_topics("public/default") == [f"{TOPIC}-partition-{i}" for i in (0, 1)]
    assert await status_of(admin.create_partitioned_topic(TOPIC, 3)) == 409
    assert await status_of(admin.create_topic(TOPIC)) == 409
    assert await status_of(admin.update_partitioned_topic(TOPIC, 1)) == 400
    assert (
        await status_of(admin.create_partitioned_topic("persistent://public/default/z", 0)) == 400
    )
    await admin.update_partitioned_topic(TOPIC, 3)
    assert await admin.get_partitions(TOPIC) == 3
    assert await status_of(admin.stats(TOPIC)) == 404  # a partitioned topic has partitioned-stats
    await produce(broker, f"{TOPIC}-partition-2", 3)
    stats = await admin.partitioned_stats(TOPIC, per_partition=True)
    assert stats["msgInCounter"] == 3
    assert stats["metadata"] == {"partitions": 3}
    assert f"{TOPIC}-partition-2" in stats["partitions"]
    await admin.delete_partitioned_topic(TOPIC)
    assert await admin.get_partitions(TOPIC) == 0
    assert await admin.list_topics("public/default") == []
    assert await status_of(admin.delete_partitioned_topic(TOPIC)) == 404


async def test_stats_internal_stats_and_terminate(
    admin: AdminClient, broker: InProcessBroker
) -> None:
    await produce(broker, TOPIC, 5)
    stats = await admin.stats(TOPIC)
    assert stats["msgInCounter"] == 5
    assert stats["bytesInCounter"] > 0
    assert stats["deduplicationStatus"] == "Disabled"
    internal = await admin.internal_stats(TOPIC)
    assert internal["numberOfEntries"] == 5
    assert internal["state"] == "LedgerOpened"
    last = await admin.terminate(TOPIC)
    assert f"{last['ledgerId']}:{last['entryId']}" == internal["lastConfirmedEntry"]
    assert last["partitionIndex"] == -1
    assert (await admin.internal_stats(TOPIC))["state"] == "Terminated"
    assert await status_of(admin.terminate("persistent://public/default/none")) == 404


async def test_subscriptions(admin: AdminClient, broker: InProcessBroker) -> None:
    await produce(broker, TOPIC, 4)
    await admin.create_subscription(TOPIC, "from-start", (-1, -1))
    await admin.create_subscription(TOPIC, "from-end")
    assert await admin.subscriptions(TOPIC) == ["from-end", "from-start"]
    assert await status_of(admin.create_subscription(TOPIC, "from-end")) == 409

    def cursor(internal: dict[str, object], name: str) -> dict[str, object]:
        cursors = internal["cursors"]
        assert isinstance(cursors, dict)
        return dict(cursors[name])

    internal = await admin.internal_stats(TOPIC)
    assert cursor(internal, "from-start")["numberOfEntriesSinceFirstNotAckedMessage"] == 4
    assert cursor(internal, "from-end")["numberOfEntriesSinceFirstNotAckedMessage"] == 0

    await admin.skip(TOPIC, "from-start", 1)
    internal = await admin.internal_stats(TOPIC)
    assert cursor(internal, "from-start")["numberOfEntriesSinceFirstNotAckedMessage"] == 3
    await admin.skip_all(TOPIC, "from-start")
    internal = await admin.internal_stats(TOPIC)
    assert cursor(internal, "from-start")["numberOfEntriesSinceFirstNotAckedMessage"] == 0

    ledger_id, entry_id = (int(x) for x in str(internal["lastConfirmedEntry"]).split(":"))
    await admin.reset_cursor(TOPIC, "from-start", ledger_id, entry_id - 1)
    internal = await admin.internal_stats(TOPIC)
    assert cursor(internal, "from-start")["numberOfEntriesSinceFirstNotAckedMessage"] == 2
    await admin.reset_cursor_to_time(TOPIC, "from-start", 0)
    internal = await admin.internal_stats(TOPIC)
    assert cursor(internal, "from-start")["numberOfEntriesSinceFirstNotAckedMessage"] == 4

    assert await status_of(admin.skip(TOPIC, "missing", 1)) == 404
    assert await status_of(admin.skip_all(TOPIC, "missing")) == 404
    sub = "/admin/v2/persistent/public/default/orders/subscription/from-start"
    assert await status_of(admin.request("POST", f"{sub}/skip/many")) == 400
    assert await status_of(admin.request("POST", f"{sub}/resetcursor", {"ledgerId": 1})) == 400
    await admin.delete_subscription(TOPIC, "from-start")
    assert await admin.subscriptions(TOPIC) == ["from-end"]
    assert await status_of(admin.delete_subscription(TOPIC, "from-start")) == 404


async def test_lookup_health_and_unknown_paths(admin: AdminClient, broker: InProcessBroker) -> None:
    answer = await admin.lookup(TOPIC)
    assert answer["brokerUrl"] == broker.service_url
    assert answer["nativeUrl"] == broker.service_url
    assert answer["httpUrl"] == broker.http_url
    assert await status_of(admin.request("GET", "/lookup/v2/topic/weird/public/default/x")) == 400
    segment = "/lookup/v2/topic/segment/public/default/orders/0000-7fff-1"
    assert (await admin.request("GET", segment))["brokerUrl"] == broker.service_url
    bad = "/lookup/v2/topic/segment/public/default/orders/not-a-range"
    assert await status_of(admin.request("GET", bad)) == 400
    assert await admin.health() == "ok"
    assert await status_of(admin.request("GET", "/admin/v2/nothing")) == 404
    assert await status_of(admin.request("PATCH", "/admin/v2/tenants")) == 405


async def test_unexpected_exception_is_500_and_the_server_survives(
    admin: AdminClient, broker: InProcessBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def boom(*args: object) -> list[str]:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(broker.service.policies, "list_tenants", boom)
    with pytest.raises(AdminHttpError) as info:
        await admin.list_tenants()
    assert info.value.status == 500
    assert info.value.reason == "internal error"  # nothing internal: no type, no text
    assert await admin.list_clusters() == ["standalone"]


async def test_oversized_body_is_413(admin: AdminClient, broker: InProcessBroker) -> None:
    huge = b'{"adminRoles": ["' + b"x" * (2 * 1024 * 1024) + b'"]}'
    async with aiohttp.ClientSession() as session:
        url = f"{broker.http_url}/admin/v2/tenants/big"
        async with session.put(url, data=io.BytesIO(huge)) as response:
            assert response.status == 413
            assert "reason" in await response.json()
    assert "big" not in await admin.list_tenants()


async def test_deeply_nested_json_is_400(admin: AdminClient, broker: InProcessBroker) -> None:
    deep = b'{"x":' * 3000 + b"1" + b"}" * 3000
    await admin.create_topic(TOPIC)
    requests = [
        ("PUT", "/admin/v2/tenants/deep"),
        ("POST", "/admin/v2/namespaces/public/default/retention"),
        ("PUT", "/admin/v2/persistent/public/default/orders/subscription/s"),
    ]
    async with aiohttp.ClientSession() as session:
        for method, path in requests:
            async with session.request(method, f"{broker.http_url}{path}", data=deep) as response:
                assert response.status == 400, path
                assert "nested too deeply" in (await response.json())["reason"]
    assert "deep" not in await admin.list_tenants()
    assert await admin.subscriptions(TOPIC) == []


async def test_numbers_beyond_java_ints_and_longs_are_400(
    admin: AdminClient, broker: InProcessBroker
) -> None:
    await admin.create_topic(TOPIC)
    huge, over_int = 10**23, 2**31
    ns = "/admin/v2/namespaces/public/default"
    requests: list[tuple[str, str, object]] = [
        ("POST", f"{ns}/messageTTL", huge),
        ("POST", f"{ns}/messageTTL", over_int),
        ("POST", f"{ns}/retention", {"retentionTimeInMinutes": 1, "retentionSizeInMB": huge}),
        ("POST", f"{ns}/retention", {"retentionTimeInMinutes": over_int, "retentionSizeInMB": 1}),
        ("POST", f"{ns}/backlogQuota", {"limitSize": huge, "limitTime": -1,
                                        "policy": "producer_request_hold"}),
        ("POST", f"{ns}/backlogQuota", {"limitSize": -1, "limitTime": over_int,
                                        "policy": "producer_request_hold"}),
        ("PUT", f"{ns}/offloadThreshold", huge),
        ("POST", f"{ns}/compactionThreshold", -huge),
        ("POST", "/admin/v2/persistent/public/default/orders/messageTTL", over_int),
    ]  # fmt: skip
    before = await broker.service.policies.namespace_policies("public/default")
    async with aiohttp.ClientSession() as session:
        for method, path, body in requests:
            async with session.request(method, f"{broker.http_url}{path}", json=body) as answer:
                assert answer.status == 400, (path, body, answer.status)
    assert await broker.service.policies.namespace_policies("public/default") == before


async def test_errors_name_resources_not_metadata_paths(admin: AdminClient) -> None:
    await admin.create_topic(TOPIC)
    with pytest.raises(AdminHttpError) as taken:
        await admin.create_partitioned_topic(TOPIC, 2)
    assert taken.value.status == 409
    assert taken.value.reason == f"topic {TOPIC} already exists"
    with pytest.raises(AdminHttpError) as busy:
        await admin.delete_namespace("public/default")
    assert busy.value.status == 409
    assert busy.value.reason.startswith("namespace public/default is not empty")
    assert "/admin/" not in taken.value.reason + busy.value.reason


# --- metrics and OpenAPI ---------------------------------------------------------------------


async def test_metrics_show_per_topic_series_after_producing(
    admin: AdminClient, broker: InProcessBroker
) -> None:
    await produce(broker, TOPIC, 3)
    await admin.create_subscription(TOPIC, "billing", (-1, -1))
    families = {f.name: f for f in text_string_to_metric_families(await admin.metrics())}
    labels = {"cluster": "standalone", "namespace": "public/default", "topic": TOPIC}

    def value(family: str, **extra: str) -> float:
        for sample in families[family].samples:
            if sample.labels == {**labels, **extra} and not sample.name.endswith("_created"):
                return float(sample.value)
        raise AssertionError(f"no {family} sample for {labels} {extra}")

    assert value("anabranch_in_messages") == 3
    assert value("anabranch_in_bytes") > 0
    assert value("anabranch_storage_entries") == 3
    assert value("anabranch_subscription_back_log", subscription="billing") == 3
    assert value("anabranch_msg_backlog") == 3
    assert value("anabranch_subscriptions_count") == 1
    assert value("anabranch_producers_count") == 0
    assert "anabranch_bad_frames" in families
    assert "anabranch_active_connections" in families
    assert families["anabranch_in_messages"].type == "counter"


async def test_openapi_lists_every_route(broker: InProcessBroker) -> None:
    assert broker.http_url is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.http_url + "/openapi.json") as response,
    ):
        assert response.status == 200
        doc = await response.json()
    assert doc["openapi"].startswith("3.")
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    served = {(r.method, r.path) for r in all_routes()}
    assert documented == served
    for required in (
        ("GET", "/metrics"),
        ("GET", "/admin/v2/brokers/health"),
        ("POST", "/admin/v2/persistent/{tenant}/{namespace}/{topic}/terminate"),
        ("GET", "/lookup/v2/topic/{domain}/{tenant}/{namespace}/{topic}"),
    ):
        assert required in documented
    op = doc["paths"]["/admin/v2/tenants/{tenant}"]["put"]
    assert [p["name"] for p in op["parameters"]] == ["tenant"]
    assert "409" in op["responses"]

"""Scalable-topic and segment admin routes against an in-process broker (memory metadata and
ledgers), plus a second admin app on the same metadata store that is not the leader."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from anabranch import limits
from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.admin.http import ADMIN_KEY, build_app
from anabranch.admin.service import AdminService
from anabranch.core.hash_range import HASH_MAX
from anabranch.core.names import SegmentName
from anabranch.errors import NotFound
from anabranch.metadata.api import Check
from anabranch.scalable.segment_ops import StorageSegmentOps
from anabranch.scalable.service import ScalableTopicService
from anabranch.testing.broker import InProcessBroker

TOPIC = "topic://public/default/orders"
PATH = "/admin/v2/scalable/public/default/orders"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


@pytest.fixture
async def admin(broker: InProcessBroker) -> AsyncIterator[AdminClient]:
    assert broker.http_url is not None
    async with AdminClient(broker.http_url) as client:
        yield client


def admin_service(broker: InProcessBroker) -> AdminService:
    """The AdminService behind the broker's own admin app."""
    assert broker.node is not None
    runner: web.AppRunner = broker.node.http_runner
    return runner.app[ADMIN_KEY]


async def failure(coro: Any) -> AdminHttpError:
    with pytest.raises(AdminHttpError) as info:
        await coro
    return info.value


def active(layout: dict[str, Any]) -> list[dict[str, Any]]:
    segments = [s for s in layout["segments"].values() if s["state"] == "ACTIVE"]
    return sorted(segments, key=lambda s: s["hashRange"]["start"])


def ranges(segments: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(s["hashRange"]["start"], s["hashRange"]["end"]) for s in segments]


@pytest.mark.parametrize("count", [1, 3, 4])
async def test_create_tiles_the_keyspace(admin: AdminClient, count: int) -> None:
    await admin.create_scalable_topic(TOPIC, count)
    layout = await admin.get_scalable_topic(TOPIC)
    segments = active(layout)
    assert (layout["epoch"], layout["nextSegmentId"]) == (0, count)
    assert [s["segmentId"] for s in segments] == list(range(count))
    spans = ranges(segments)
    assert spans[0][0] == 0 and spans[-1][1] == HASH_MAX
    assert all(prev[1] + 1 == nxt[0] for prev, nxt in itertools.pairwise(spans))
    assert await admin.list_scalable_topics("public/default") == [TOPIC]
    assert (await failure(admin.create_scalable_topic(TOPIC, 2))).status == 409


async def test_create_rejects_bad_segment_counts(admin: AdminClient) -> None:
    for query in ("0", "-1", "x", str(limits.SCALABLE_INITIAL_SEGMENTS_MAX + 1)):
        err = await failure(admin.request("PUT", f"{PATH}?numInitialSegments={query}"))
        assert err.status == 400 and "numInitialSegments" in err.reason
    assert await admin.list_scalable_topics("public/default") == []


async def test_split_then_merge(admin: AdminClient) -> None:
    await admin.create_scalable_topic(TOPIC, 2)
    layout = await admin.split_segment(TOPIC, 0)
    assert layout == await admin.get_scalable_topic(TOPIC)
    assert layout["epoch"] == 1
    children = {s["segmentId"]: s for s in active(layout) if s["segmentId"] != 1}
    assert sorted(children) == [2, 3]
    assert ranges([children[2], children[3]]) == [(0x0000, 0x3FFF), (0x4000, 0x7FFF)]
    assert children[2]["parentIds"] == [0] and children[2]["createdAtEpoch"] == 1
    sealed = layout["segments"]["0"]
    assert (sealed["state"], sealed["childIds"], sealed["sealedAtEpoch"]) == ("SEALED", [2, 3], 1)

    merged = await admin.merge_segments(TOPIC, 3, 1)  # 4000-7fff + 8000-ffff
    assert merged["epoch"] == 2
    child = merged["segments"]["4"]
    assert (child["state"], child["parentIds"]) == ("ACTIVE", [3, 1])
    assert (child["hashRange"]["start"], child["hashRange"]["end"]) == (0x4000, 0xFFFF)
    assert ranges(active(merged)) == [(0x0000, 0x3FFF), (0x4000, 0xFFFF)]


async def test_refused_changes_answer_4xx_and_leave_the_layout(admin: AdminClient) -> None:
    await admin.create_scalable_topic(TOPIC, 4)
    before = await admin.get_scalable_topic(TOPIC)

    err = await failure(admin.merge_segments(TOPIC, 0, 2))  # 0000-3fff and 8000-bfff
    assert 400 <= err.status < 500 and err.reason
    assert await admin.get_scalable_topic(TOPIC) == before

    err = await failure(admin.split_segment(TOPIC, 99))
    assert 400 <= err.status < 500 and "99" in err.reason
    assert await admin.get_scalable_topic(TOPIC) == before

    err = await failure(admin.request("POST", f"{PATH}/split/abc"))
    assert err.status == 400

    await admin.split_segment(TOPIC, 1)
    after_split = await admin.get_scalable_topic(TOPIC)
    err = await failure(admin.split_segment(TOPIC, 1))  # sealed now
    assert 400 <= err.status < 500 and err.reason
    err = await failure(admin.merge_segments(TOPIC, 1, 2))
    assert 400 <= err.status < 500
    assert await admin.get_scalable_topic(TOPIC) == after_split


async def test_unknown_topic_is_404(admin: AdminClient) -> None:
    assert (await failure(admin.get_scalable_topic("topic://public/default/nope"))).status == 404
    assert (await failure(admin.scalable_stats("topic://public/default/nope"))).status == 404


async def test_subscriptions_on_every_active_segment(
    broker: InProcessBroker, admin: AdminClient
) -> None:
    await admin.create_scalable_topic(TOPIC, 2)
    await admin.split_segment(TOPIC, 1)
    await admin.create_scalable_subscription(TOPIC, "billing")
    assert await admin.scalable_subscriptions(TOPIC) == ["billing"]
    ops = await admin_service(broker).segment_ops()
    layout = await admin.get_scalable_topic(TOPIC)
    for segment in active(layout):
        name = SegmentName.parse(
            f"segment://public/default/orders/"
            f"{segment['hashRange']['start']:04x}-{segment['hashRange']['end']:04x}-"
            f"{segment['segmentId']}"
        )
        assert await ops.segment_subscriptions(name) == ["billing"]

    stats = await admin.scalable_stats(TOPIC)
    assert stats["epoch"] == 1 and stats["subscriptions"] == ["billing"]
    by_id = stats["segments"]
    assert sorted(by_id) == ["0", "1", "2", "3"]
    assert (by_id["1"]["state"], by_id["1"]["hashRange"]) == ("SEALED", "8000-ffff")
    assert (by_id["2"]["state"], by_id["2"]["hashRange"]) == ("ACTIVE", "8000-bfff")
    assert by_id["3"]["backlog"] == {"billing": 0}

    await admin.delete_scalable_subscription(TOPIC, "billing")
    assert await admin.scalable_subscriptions(TOPIC) == []
    err = await failure(admin.create_scalable_subscription(TOPIC, "bad\x01name"))
    assert err.status == 400


async def test_delete(admin: AdminClient) -> None:
    await admin.create_scalable_topic(TOPIC, 2)
    await admin.delete_scalable_topic(TOPIC)
    assert await admin.list_scalable_topics("public/default") == []
    assert (await failure(admin.get_scalable_topic(TOPIC))).status == 404
    assert (await failure(admin.list_scalable_topics("public/nope"))).status == 404


async def test_namespace_topic_listings_leave_segments_out(
    broker: InProcessBroker, admin: AdminClient
) -> None:
    plain = "persistent://public/default/plain"
    await admin.create_topic(plain)
    await admin.create_scalable_topic(TOPIC, 2)
    loaded = [t.name for t in broker.service.loaded_topics()]
    assert any(name.startswith("segment://public/default/orders/") for name in loaded)
    assert await admin.list_topics("public/default") == [plain]
    assert await admin.namespace_topics("public/default") == [plain]
    assert await admin.list_scalable_topics("public/default") == [TOPIC]


async def test_a_namespace_with_a_scalable_topic_is_not_deleted(admin: AdminClient) -> None:
    await admin.create_namespace("public/sc")
    await admin.create_scalable_topic("topic://public/sc/orders", 1)
    err = await failure(admin.delete_namespace("public/sc"))
    assert err.status == 409 and "topic://public/sc/orders" in err.reason
    assert await admin.list_scalable_topics("public/sc") == ["topic://public/sc/orders"]
    await admin.create_scalable_topic("topic://public/sc/more", 1)  # the namespace is live
    for name in ("orders", "more"):
        await admin.delete_scalable_topic(f"topic://public/sc/{name}")
    await admin.delete_namespace("public/sc")
    assert "public/sc" not in await admin.list_namespaces("public")


async def test_create_with_a_failed_guard_creates_nothing(broker: InProcessBroker) -> None:
    scalable = await admin_service(broker).scalable()
    policies = broker.service.policies
    guard = await policies.namespace_guard("public/default")
    stale = Check(guard.path, expected_version=(guard.expected_version or 0) + 1)
    with pytest.raises(NotFound, match="being deleted"):
        await scalable.create(TOPIC, 1, guard=[stale])
    with pytest.raises(NotFound):
        await scalable.get_metadata(TOPIC)
    await scalable.create(TOPIC, 1, guard=[guard])
    assert (await scalable.get_metadata(TOPIC)).epoch == 0
    with pytest.raises(NotFound):
        await policies.namespace_guard("public/absent")


async def test_segment_routes(broker: InProcessBroker, admin: AdminClient) -> None:
    segment = "segment://public/default/raw/0000-ffff-0"
    await admin.create_segment(segment, ["a", "b"])
    ops = await admin_service(broker).segment_ops()
    assert await ops.segment_subscriptions(SegmentName.parse(segment)) == ["a", "b"]
    assert await admin.terminate_segment(segment) == {}
    await admin.delete_segment(segment)
    bad = "/admin/v2/segments/public/default/raw/zzzz-ffff-0"
    assert (await failure(admin.request("PUT", bad, []))).status == 400
    not_list = "/admin/v2/segments/public/default/raw/0000-ffff-0"
    assert (await failure(admin.request("PUT", not_list, {"a": 1}))).status == 400


@pytest.fixture
async def follower(broker: InProcessBroker) -> AsyncIterator[str]:
    """A second admin app on the broker's metadata store, with its own ScalableTopicService
    (its own metadata session), so it is not the leader of topics the broker leads."""
    service = broker.service
    ops = StorageSegmentOps(service.ledgers)
    scalable = ScalableTopicService(service.store, ops, service.clock, "http://follower:1")
    await scalable.start()
    admin = AdminService(service, "http://follower:1", scalable=scalable)
    runner = web.AppRunner(build_app(admin, CollectorRegistry()), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    address = runner.addresses[0]
    try:
        yield f"http://127.0.0.1:{address[1]}"
    finally:
        await runner.cleanup()
        await scalable.close()
        await ops.close()


async def test_non_leader_redirects_mutations(
    broker: InProcessBroker, admin: AdminClient, follower: str
) -> None:
    await admin.create_scalable_topic(TOPIC, 2)  # the broker's own app leads the topic
    assert broker.http_url is not None
    async with aiohttp.ClientSession() as http:
        for method, path in [
            ("POST", f"{PATH}/split/0"),
            ("POST", f"{PATH}/merge/0/1"),
            ("PUT", f"{PATH}/subscriptions/billing"),
            ("DELETE", PATH),
        ]:
            async with http.request(method, follower + path, allow_redirects=False) as resp:
                assert resp.status == 307, (method, path, await resp.text())
                assert resp.headers["Location"] == broker.http_url + path
                assert "not the controller" in (await resp.json())["reason"]
        # Reads are answered by any broker.
        async with http.get(follower + PATH) as resp:
            assert resp.status == 200
            assert (await resp.json())["epoch"] == 0
    # AdminClient follows the redirect: the split lands on the leader.
    async with AdminClient(follower) as client:
        layout = await client.split_segment(TOPIC, 0)
    assert layout["epoch"] == 1
    assert (await admin.get_scalable_topic(TOPIC))["epoch"] == 1


async def test_openapi_lists_the_scalable_paths(admin: AdminClient) -> None:
    paths = (await admin.openapi())["paths"]
    assert set(paths["/admin/v2/scalable/{tenant}/{namespace}/{topic}"]) == {"get", "put", "delete"}
    assert "post" in paths["/admin/v2/scalable/{tenant}/{namespace}/{topic}/split/{segmentId}"]
    assert "post" in paths["/admin/v2/scalable/{tenant}/{namespace}/{topic}/merge/{id1}/{id2}"]
    sub = "/admin/v2/scalable/{tenant}/{namespace}/{topic}/subscriptions/{subscription}"
    assert set(paths[sub]) == {"put", "delete"}
    assert "get" in paths["/admin/v2/scalable/{tenant}/{namespace}/{topic}/stats"]
    assert "get" in paths["/admin/v2/scalable/{tenant}/{namespace}"]
    segment = "/admin/v2/segments/{tenant}/{namespace}/{topic}/{descriptor}"
    assert set(paths[segment]) == {"put", "delete"}
    assert "post" in paths[segment + "/terminate"]
    assert (
        "307"
        in paths["/admin/v2/scalable/{tenant}/{namespace}/{topic}/split/{segmentId}"]["post"][
            "responses"
        ]
    )

"""Permission grants through the admin API and the CLI, and the segment delete guard
(authentication off: the standalone default, where every request is allowed)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.testing.broker import InProcessBroker
from tests.admin.test_cli import admin_url, cli, cli_json  # noqa: F401  (fixture)

TOPIC = "persistent://public/default/orders"
SCALABLE = "topic://public/default/stream"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


@pytest.fixture
async def admin(broker: InProcessBroker) -> AsyncIterator[AdminClient]:
    assert broker.http_url is not None
    async with AdminClient(broker.http_url) as client:
        yield client


async def failure(coro: Any) -> AdminHttpError:
    with pytest.raises(AdminHttpError) as info:
        await coro
    return info.value


async def test_namespace_grants(admin: AdminClient) -> None:
    assert await admin.namespace_permissions("public/default") == {}
    await admin.grant_namespace_permission("public/default", "app", ["produce", "consume"])
    await admin.grant_namespace_permission("public/default", "reader", ["consume"])
    assert await admin.namespace_permissions("public/default") == {
        "app": ["consume", "produce"],
        "reader": ["consume"],
    }
    # A grant replaces the role's actions, as Pulsar's does.
    await admin.grant_namespace_permission("public/default", "app", ["produce"])
    assert (await admin.namespace_permissions("public/default"))["app"] == ["produce"]
    await admin.revoke_namespace_permission("public/default", "app")
    await admin.revoke_namespace_permission("public/default", "nobody")  # nothing to revoke
    assert await admin.namespace_permissions("public/default") == {"reader": ["consume"]}
    # Stored with the namespace's policies, under Pulsar's key.
    policies = await admin.get_namespace_policies("public/default")
    assert policies["auth_policies"]["namespace_auth"] == {"reader": ["consume"]}


async def test_topic_grants_merge_with_the_namespace(admin: AdminClient) -> None:
    await admin.grant_namespace_permission("public/default", "app", ["consume"])
    await admin.grant_permission(TOPIC, "app", ["produce"])
    await admin.grant_permission(TOPIC, "writer", ["produce"])
    assert await admin.permissions(TOPIC) == {
        "app": ["consume", "produce"],
        "writer": ["produce"],
    }
    # A partition's grant is its topic's.
    assert await admin.permissions(TOPIC + "-partition-1") == await admin.permissions(TOPIC)
    assert await admin.permissions("persistent://public/default/other") == {"app": ["consume"]}
    await admin.revoke_permission(TOPIC, "writer")
    assert await admin.permissions(TOPIC) == {"app": ["consume", "produce"]}
    policies = await admin.get_namespace_policies("public/default")
    assert policies["auth_policies"]["destination_auth"] == {TOPIC: {"app": ["produce"]}}


async def test_a_deleted_topic_takes_its_grants_along(admin: AdminClient) -> None:
    partitioned = "persistent://public/default/parts"
    await admin.create_topic(TOPIC)
    await admin.create_partitioned_topic(partitioned, 2)
    await admin.create_scalable_topic(SCALABLE, 1)
    for topic in (TOPIC, partitioned, SCALABLE):
        await admin.grant_permission(topic, "app", ["produce"])
    await admin.grant_namespace_permission("public/default", "ns-wide", ["consume"])
    await admin.delete_topic(TOPIC)
    await admin.delete_partitioned_topic(partitioned)
    await admin.delete_scalable_topic(SCALABLE)
    policies = await admin.get_namespace_policies("public/default")
    assert policies["auth_policies"]["destination_auth"] == {}
    assert policies["auth_policies"]["namespace_auth"] == {"ns-wide": ["consume"]}
    await admin.create_topic(TOPIC)  # the same name again: no grant of the old one
    assert await admin.permissions(TOPIC) == {"ns-wide": ["consume"]}


async def test_scalable_topic_grants(admin: AdminClient) -> None:
    await admin.grant_permission(SCALABLE, "app", ["consume"])
    assert await admin.permissions(SCALABLE) == {"app": ["consume"]}
    assert await admin.permissions(TOPIC) == {}  # a different topic
    await admin.revoke_permission(SCALABLE, "app")
    assert await admin.permissions(SCALABLE) == {}


async def test_bad_grants_are_refused_and_change_nothing(admin: AdminClient) -> None:
    base = "/admin/v2/namespaces/public/default/permissions/app"
    assert (await failure(admin.request("POST", base, ["write"]))).status == 400
    assert (await failure(admin.request("POST", base, []))).status == 400
    assert (await failure(admin.request("POST", base, {"produce": 1}))).status == 400
    assert (await failure(admin.request("POST", base))).status == 400
    bad_role = "/admin/v2/namespaces/public/default/permissions/%0A"
    assert (await failure(admin.request("POST", bad_role, ["produce"]))).status == 400
    missing = admin.grant_namespace_permission("public/nowhere", "app", ["produce"])
    assert (await failure(missing)).status == 404
    assert await admin.namespace_permissions("public/default") == {}
    assert (await failure(admin.namespace_permissions("public/nowhere"))).status == 404


def test_cli_grant_revoke_list(admin_url: str) -> None:  # noqa: F811
    ns = "public/default"
    cli(admin_url, "namespaces", "grant-permission", ns, "--role", "app", "--actions",
        "produce,consume")  # fmt: skip
    assert cli_json(admin_url, "namespaces", "permissions", ns) == {"app": ["consume", "produce"]}
    cli(admin_url, "topics", "grant-permission", TOPIC, "--role", "w", "--actions", "produce")
    assert cli_json(admin_url, "topics", "permissions", TOPIC) == {
        "app": ["consume", "produce"],
        "w": ["produce"],
    }
    cli(admin_url, "topics", "revoke-permission", TOPIC, "--role", "w")
    cli(admin_url, "namespaces", "revoke-permission", ns, "--role", "app")
    assert cli_json(admin_url, "topics", "permissions", TOPIC) == {}
    out = cli(admin_url, "namespaces", "grant-permission", ns, "--role", "app", "--actions",
              "write", code=1)  # fmt: skip
    assert out == ""
    assert json.loads(cli(admin_url, "namespaces", "permissions", ns, "-o", "json")) == {}


# --- destructive segment operations check the layout ---------------------------------------


def owned_segment(descriptor: str, suffix: str = "") -> str:
    return f"/admin/v2/cluster/segments/public/default/stream/{descriptor}{suffix}"


async def test_deleting_an_active_segment_is_refused_and_its_data_stays(
    broker: InProcessBroker, admin: AdminClient
) -> None:
    await admin.create_scalable_topic(SCALABLE, 1)
    await admin.create_scalable_subscription(SCALABLE, "audit")
    async with Client(broker.service_url) as client:
        producer = await client.create_producer(SCALABLE)
        for i in range(5):
            await producer.send(f"m{i}".encode(), key=f"k{i}")
        await producer.close()
    backlog = owned_segment("0000-ffff-0", "/backlog/audit")
    assert await admin.request("GET", backlog) == 5

    for path in (
        owned_segment("0000-ffff-0"),
        "/admin/v2/segments/public/default/stream/0000-ffff-0",
    ):
        err = await failure(admin.request("DELETE", path))
        assert err.status == 409
        assert "active" in err.reason and "/" not in err.reason.split("segment://")[0]
    assert await admin.request("GET", backlog) == 5
    layout = await admin.get_scalable_topic(SCALABLE)
    assert layout["segments"]["0"]["state"] == "ACTIVE"

    # Sealed by a split: now the parent's data may go (retention's pruning does this).
    await admin.split_segment(SCALABLE, 0)
    await admin.request("DELETE", owned_segment("0000-ffff-0"))
    # A segment no layout has (pruned, or never there) may go too.
    await admin.request("DELETE", owned_segment("0000-0fff-9"))
    # Deleting the topic deletes its active segments (the topic is marked as going away).
    await admin.delete_scalable_topic(SCALABLE)
    assert await admin.list_scalable_topics("public/default") == []

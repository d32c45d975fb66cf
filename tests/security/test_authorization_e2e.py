"""Authorization end to end with the official ``pulsar`` client and ours (token auth on).

A consume-only role cannot produce until produce is granted; a tenant admin of one tenant
cannot touch another; the superuser can do everything. Refusals name only what the
request named.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pulsar
import pytest

from anabranch.aio import Client
from anabranch.client.errors import AuthorizationFailed
from tests.security.authz_world import (
    CONSUMER,
    PRODUCER,
    SCALABLE,
    SUPERUSER,
    TENANT_ADMIN,
    TOPIC,
    world,
)
from tests.security.official import refusal, round_trip

V2 = "/admin/v2"


def official(token: str) -> dict[str, Any]:
    return {"authentication": pulsar.AuthenticationToken(token)}


async def test_consume_only_role_cannot_produce_until_granted(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        url, token = w.broker.service_url, w.auth.token(CONSUMER)
        # The refusal comes from the PRODUCER command (the lookup is allowed: consume).
        assert await asyncio.to_thread(refusal, url, TOPIC, **official(token)) == (
            "AuthorizationError"
        )
        status, stats = await w.http(SUPERUSER, "GET", f"{V2}/persistent/acme/ns/t/stats")
        assert status == 200 and '"publishers":[]' in stats  # no producer was attached
        # Our client says the same.
        async with Client(url, auth_token=token) as client:
            with pytest.raises(AuthorizationFailed, match="not authorized to producer"):
                await client.create_producer(TOPIC)
            consumer = await client.subscribe(TOPIC, "sub")  # consume was granted
            await consumer.close()
        await w.ok("POST", f"{V2}/persistent/acme/ns/t/permissions/{CONSUMER}", ["produce"])
        got = await asyncio.to_thread(round_trip, url, TOPIC, **official(token))
        assert got == [f"m-{i}".encode() for i in range(5)]
        # Revoked again: new producers are refused.
        await w.ok("DELETE", f"{V2}/persistent/acme/ns/t/permissions/{CONSUMER}")
        assert await asyncio.to_thread(refusal, url, TOPIC, **official(token)) == (
            "AuthorizationError"
        )


async def test_scalable_topics_check_produce_and_consume_too(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        url = w.broker.service_url
        async with Client(url, auth_token=w.auth.token(CONSUMER)) as client:
            producer = await client.create_producer(SCALABLE)  # the DAG lookup: allowed
            with pytest.raises(AuthorizationFailed, match="not authorized to producer"):
                await producer.send(b"x", key="k")  # its segment producer: refused
            stream = await client.subscribe_stream(SCALABLE, "sub", consumer_name="a")
            await stream.close()
        async with Client(url, auth_token=w.auth.token(PRODUCER)) as client:
            producer = await client.create_producer(SCALABLE)
            await producer.send(b"x", key="k")
            await producer.close()
            with pytest.raises(AuthorizationFailed, match="scalable_topic_subscribe"):
                await client.subscribe_stream(SCALABLE, "sub", consumer_name="b")


async def test_a_tenant_admin_cannot_touch_another_tenant(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        admin = TENANT_ADMIN
        # Its own tenant: namespaces, grants, topics, data.
        assert (await w.http(admin, "PUT", f"{V2}/namespaces/acme/more"))[0] == 204
        grant = f"{V2}/namespaces/acme/more/permissions/app"
        assert (await w.http(admin, "POST", grant, ["consume"]))[0] == 204
        assert (await w.http(admin, "GET", f"{V2}/tenants/acme"))[0] == 200
        mine = await asyncio.to_thread(
            round_trip, w.broker.service_url, "persistent://acme/more/x", **official(
                w.auth.token(admin))
        )  # fmt: skip
        assert len(mine) == 5
        # Tenant "other": every kind of request is refused, and nothing is created.
        for method, path, body in [
            ("GET", f"{V2}/tenants/other", None),
            ("PUT", f"{V2}/namespaces/other/more", None),
            ("GET", f"{V2}/namespaces/other", None),
            ("DELETE", f"{V2}/namespaces/other/ns", None),
            ("POST", f"{V2}/namespaces/other/ns/permissions/{admin}", ["produce"]),
            ("PUT", f"{V2}/persistent/other/ns/x", None),
            ("GET", f"{V2}/persistent/other/ns", None),
            ("POST", f"{V2}/tenants/acme", {"adminRoles": [admin, "x"]}),  # superuser's
        ]:
            status, reason = await w.http(admin, method, path, body)
            assert (status, reason) == (403, f"role {admin} is not authorized to {method} {path}")
        namespaces = await w.broker.service.policies.list_namespaces("other")
        assert namespaces == ["other/ns"]
        assert await w.broker.service.policies.namespace_permissions("other/ns") == {}
        theirs = "persistent://other/ns/x"
        assert await asyncio.to_thread(
            refusal, w.broker.service_url, theirs, **official(w.auth.token(admin))
        ) == "AuthorizationError"  # fmt: skip
        assert not await w.broker.service.policies.topic_exists(theirs)


async def test_the_superuser_can_do_everything(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        for tenant in ("acme", "other"):
            await w.ok("PUT", f"{V2}/namespaces/{tenant}/su")
            await w.ok("POST", f"{V2}/namespaces/{tenant}/su/permissions/x", ["produce"])
            topic = f"persistent://{tenant}/su/t"
            got = await asyncio.to_thread(
                round_trip, w.broker.service_url, topic, **official(w.auth.token(SUPERUSER))
            )
            assert len(got) == 5
        await w.ok("PUT", f"{V2}/tenants/third", {"allowedClusters": ["standalone"]})
        await w.ok("GET", f"{V2}/tenants")
        await w.ok("GET", f"{V2}/cluster/segments/acme/ns/s/0000-ffff-0/subscriptions")


async def test_a_refusal_names_only_what_was_asked(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        status, reason = await w.http(CONSUMER, "GET", f"{V2}/namespaces/other/ns/permissions")
        assert status == 403
        assert reason == (
            f"role {CONSUMER} is not authorized to GET {V2}/namespaces/other/ns/permissions"
        )
        # A tenant that does not exist is refused the same way (its absence is not told).
        status, reason = await w.http(CONSUMER, "GET", f"{V2}/tenants/ghost")
        assert (status, reason) == (
            403,
            f"role {CONSUMER} is not authorized to GET {V2}/tenants/ghost",
        )

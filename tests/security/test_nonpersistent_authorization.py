"""Non-persistent topics take the same grants as persistent ones (namespace grants apply),
on the wire with the official client and ours, and on their admin routes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pulsar
import pytest

from anabranch.aio import Client
from anabranch.client.errors import AuthorizationFailed
from tests.security.authz_world import CONSUMER, PRODUCER, SUPERUSER, WRONG, world
from tests.security.official import refusal

TOPIC = "non-persistent://acme/ns/live"
STATS = "/admin/v2/non-persistent/acme/ns/live/stats"


def official(token: str) -> dict[str, Any]:
    return {"authentication": pulsar.AuthenticationToken(token)}


async def test_grants_apply_to_non_persistent_topics(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        url = w.broker.service_url
        for role, expected in ((CONSUMER, "AuthorizationError"), (WRONG, "AuthorizationError"),
                               (PRODUCER, "none")):  # fmt: skip
            token = w.auth.token(role)
            assert await asyncio.to_thread(refusal, url, TOPIC, **official(token)) == expected
        async with Client(url, auth_token=w.auth.token(CONSUMER)) as client:
            consumer = await client.subscribe(TOPIC, "sub")  # consume was granted
            with pytest.raises(AuthorizationFailed):
                await client.create_producer(TOPIC)
            # Its admin routes check the same grants (stats: produce or consume).
            assert (await w.http(CONSUMER, "GET", STATS))[0] == 200
            assert (await w.http(WRONG, "GET", STATS))[0] == 403
            assert (await w.http(CONSUMER, "DELETE", STATS[: -len("/stats")]))[0] == 403
            await consumer.close()
        async with Client(url, auth_token=w.auth.token(PRODUCER)) as client:
            with pytest.raises(AuthorizationFailed):
                await client.subscribe(TOPIC, "sub")
        status, _ = await w.http(SUPERUSER, "DELETE", STATS[: -len("/stats")])
        assert status == 204

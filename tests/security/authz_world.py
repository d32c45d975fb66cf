"""A broker with token authentication and authorization on, and one role of each kind.

Tenant ``acme`` (admin role ``acme-admin``) has namespace ``acme/ns`` where ``reader`` may
consume and ``writer`` may produce; tenant ``other`` (admin ``other-admin``) has
``other/ns``. ``admin`` is the superuser. The *wrong role* is ``other-admin``: an admin,
but of another tenant.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from anabranch.core.authz import Need
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.security import TokenAuth

SUPERUSER = "admin"
TENANT_ADMIN = "acme-admin"
WRONG = "other-admin"
CONSUMER = "reader"
PRODUCER = "writer"
ANONYMOUS = None
ROLES: list[str | None] = [ANONYMOUS, WRONG, CONSUMER, PRODUCER, TENANT_ADMIN, SUPERUSER]

TOPIC = "persistent://acme/ns/t"
SCALABLE = "topic://acme/ns/s"

ALLOWED: dict[Need, frozenset[str]] = {
    Need.NONE: frozenset({WRONG, CONSUMER, PRODUCER, TENANT_ADMIN, SUPERUSER}),
    Need.OWNED: frozenset({WRONG, CONSUMER, PRODUCER, TENANT_ADMIN, SUPERUSER}),
    Need.AUTHENTICATED: frozenset({WRONG, CONSUMER, PRODUCER, TENANT_ADMIN, SUPERUSER}),
    Need.LOOKUP: frozenset({CONSUMER, PRODUCER, TENANT_ADMIN, SUPERUSER}),
    Need.NAMESPACE: frozenset({CONSUMER, PRODUCER, TENANT_ADMIN, SUPERUSER}),
    Need.PRODUCE: frozenset({PRODUCER, TENANT_ADMIN, SUPERUSER}),
    Need.CONSUME: frozenset({CONSUMER, TENANT_ADMIN, SUPERUSER}),
    Need.TENANT_ADMIN: frozenset({TENANT_ADMIN, SUPERUSER}),
    Need.SUPERUSER: frozenset({SUPERUSER}),
    Need.CLUSTER: frozenset({SUPERUSER}),
}
"""Who may do what on ``acme/ns`` resources, written out by hand (the expectation the
tables are checked against; a role absent from a row is refused)."""


@dataclass
class World:
    broker: InProcessBroker
    auth: TokenAuth

    @property
    def http_url(self) -> str:
        assert self.broker.http_url is not None
        return self.broker.http_url

    def headers(self, role: str | None) -> dict[str, str]:
        if role is None:
            return {}
        return {"Authorization": f"Bearer {self.auth.token(role)}"}

    async def http(
        self, role: str | None, method: str, path: str, body: Any = None
    ) -> tuple[int, str]:
        """Status and ``reason`` (or raw text) of one request as ``role``."""
        data = None if body is None else msgspec.json.encode(body)
        headers = self.headers(role)
        if data is not None:
            headers["Content-Type"] = "application/json"
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.http_url + path, data=data, headers=headers) as resp,
        ):
            raw = await resp.read()
            reason = raw.decode("utf-8", "replace")
            if resp.content_type == "application/json" and resp.status >= 400:
                with contextlib.suppress(msgspec.DecodeError, AttributeError):
                    reason = str(msgspec.json.decode(raw).get("reason", ""))
            return resp.status, reason

    async def ok(self, method: str, path: str, body: Any = None) -> None:
        """A superuser request that must succeed."""
        status, reason = await self.http(SUPERUSER, method, path, body)
        assert status < 300, (method, path, status, reason)


@contextlib.asynccontextmanager
async def world(tmp_path: Path, **config: Any) -> AsyncIterator[World]:
    auth = TokenAuth(superusers=[SUPERUSER], extra={"authorization_enabled": True, **config})
    async with InProcessBroker(tmp_path, ledgers="memory", security=auth) as broker:
        w = World(broker, auth)
        v2 = "/admin/v2"
        for tenant, admin in (("acme", TENANT_ADMIN), ("other", WRONG)):
            body = {"adminRoles": [admin], "allowedClusters": ["standalone"]}
            await w.ok("PUT", f"{v2}/tenants/{tenant}", body)
            await w.ok("PUT", f"{v2}/namespaces/{tenant}/ns")
        await w.ok("PUT", f"{v2}/persistent/acme/ns/t")
        await w.ok("PUT", f"{v2}/scalable/acme/ns/s")
        await w.ok("POST", f"{v2}/namespaces/acme/ns/permissions/{CONSUMER}", ["consume"])
        await w.ok("POST", f"{v2}/namespaces/acme/ns/permissions/{PRODUCER}", ["produce"])
        yield w

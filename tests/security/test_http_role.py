"""The HTTP middleware's contract: ``request["anabranch.role"]`` is the authenticated role
(None when authentication is disabled or on an open path without credentials)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from anabranch.admin.authentication import authentication_middleware
from anabranch.admin.http import error_middleware
from anabranch.security.authentication import AuthenticationService
from anabranch.security.providers_basic import BasicProvider
from anabranch.security.providers_token import TokenProvider
from anabranch.security.tokens import create_token

SECRET = b"s" * 32
USERS = {"ann": "{SHA}W6ph5Mm5Pz8GgiULbPgzG37mj9g="}  # password "password"


async def whoami(request: web.Request) -> web.Response:
    return web.json_response({"role": request["anabranch.role"]})


Serve = Callable[[AuthenticationService | None], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[TestServer] = []

    async def start(service: AuthenticationService | None) -> str:
        app = web.Application(middlewares=[error_middleware, authentication_middleware(service)])
        app.router.add_get("/whoami", whoami)
        app.router.add_get("/admin/v2/brokers/health", whoami)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url(""))

    yield start
    for server in servers:
        await server.close()


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        return resp.status, await resp.json()


def service() -> AuthenticationService:
    return AuthenticationService([TokenProvider(SECRET, ["HS256"]), BasicProvider(USERS)])


async def test_disabled_role_is_none(serve: Serve) -> None:
    base = await serve(None)
    assert await get(f"{base}/whoami") == (200, {"role": None})


async def test_bearer_and_basic_set_the_role(serve: Serve) -> None:
    base = await serve(service())
    bearer = {"Authorization": f"Bearer {create_token(SECRET, 'tok-role')}"}
    assert await get(f"{base}/whoami", bearer) == (200, {"role": "tok-role"})
    basic = {"Authorization": "Basic " + base64.b64encode(b"ann:password").decode()}
    assert await get(f"{base}/whoami", basic) == (200, {"role": "ann"})


@pytest.mark.parametrize(
    "header",
    [
        None,
        "Bearer x.y.z",
        "Basic " + base64.b64encode(b"ann:wrong").decode(),
        "Basic !!!",
        "Digest abc",
    ],
)
async def test_bad_or_missing_credentials_are_401(serve: Serve, header: str | None) -> None:
    base = await serve(service())
    status, body = await get(f"{base}/whoami", {"Authorization": header} if header else None)
    assert status == 401
    assert str(body["reason"]).startswith("authentication failed")


async def test_health_is_open(serve: Serve) -> None:
    base = await serve(service())
    assert await get(f"{base}/admin/v2/brokers/health") == (200, {"role": None})
    bearer = {"Authorization": f"Bearer {create_token(SECRET, 'x')}"}
    assert await get(f"{base}/admin/v2/brokers/health", bearer) == (200, {"role": "x"})

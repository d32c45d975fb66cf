"""Token authentication (JWT HS256/RS256/ES256) on the binary protocol and HTTP.

The official client (``pulsar.AuthenticationToken``) and ours produce and consume with a
valid token; a wrong, expired or missing token is an authentication error at once (the
official client's create_producer raises AuthenticationError, not Timeout after 30 s).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pulsar
import pytest

from anabranch.aio import Client
from anabranch.client.errors import AuthenticationFailed
from anabranch.testing.broker import BrokerProcess, InProcessBroker
from anabranch.testing.security import TokenAuth
from tests.security.official import refusal, round_trip

TOPIC = "persistent://public/default/secured"


@pytest.fixture
async def auth_broker(tmp_path: Path) -> AsyncIterator[tuple[InProcessBroker, TokenAuth]]:
    auth = TokenAuth()
    async with InProcessBroker(tmp_path, security=auth) as broker:
        yield broker, auth


def session_roles(broker: InProcessBroker) -> list[str | None]:
    assert broker.node is not None
    return [s.role for s in broker.node.server.sessions]


@pytest.mark.parametrize("algorithm", ["HS256", "RS256", "ES256"])
async def test_official_client_round_trip_with_a_token(tmp_path: Path, algorithm: str) -> None:
    auth = TokenAuth(algorithm=algorithm)  # type: ignore[arg-type]
    async with InProcessBroker(tmp_path, security=auth) as broker:
        got = await asyncio.to_thread(
            round_trip,
            broker.service_url,
            TOPIC,
            authentication=pulsar.AuthenticationToken(auth.token("alice")),
        )
    assert got == [f"m-{i}".encode() for i in range(5)]


async def test_official_client_session_gets_the_token_role(
    auth_broker: tuple[InProcessBroker, TokenAuth],
) -> None:
    broker, auth = auth_broker
    token = auth.token("alice")
    client = await asyncio.to_thread(
        pulsar.Client, broker.service_url, authentication=pulsar.AuthenticationToken(token)
    )
    try:
        await asyncio.to_thread(client.create_producer, TOPIC)
        assert "alice" in session_roles(broker)
    finally:
        await asyncio.to_thread(client.close)


@pytest.mark.parametrize("case", ["wrong-key", "garbage", "expired", "missing"])
async def test_official_client_bad_token_is_an_authentication_error(
    auth_broker: tuple[InProcessBroker, TokenAuth], case: str
) -> None:
    broker, auth = auth_broker
    tokens = {
        "wrong-key": TokenAuth().token("alice"),
        "garbage": "not-a-jwt",
        "expired": auth.token("alice", expires_in_s=-60),
    }
    options = {}
    if case in tokens:
        options["authentication"] = pulsar.AuthenticationToken(tokens[case])
    name = await asyncio.to_thread(refusal, broker.service_url, TOPIC, **options)
    assert name == "AuthenticationError"
    assert broker.service.counters.authentication_failures >= 1
    assert broker.service.loaded_topic(TOPIC) is None  # nothing was created


async def test_our_client_with_a_token(auth_broker: tuple[InProcessBroker, TokenAuth]) -> None:
    broker, auth = auth_broker
    async with Client(broker.service_url, auth_token=auth.token("bob")) as client:
        producer = await client.create_producer(TOPIC)
        await producer.send(b"hello")
        assert "bob" in session_roles(broker)


async def test_our_client_with_a_token_callable(
    auth_broker: tuple[InProcessBroker, TokenAuth],
) -> None:
    broker, auth = auth_broker
    calls: list[int] = []

    def supplier() -> str:
        calls.append(1)
        return auth.token("carol")

    async with Client(broker.service_url, auth_token=supplier) as client:
        producer = await client.create_producer(TOPIC)
        await producer.send(b"hello")
    assert calls


@pytest.mark.parametrize("token", ["not-a-jwt", None])
async def test_our_client_bad_or_missing_token_fails_fast(
    auth_broker: tuple[InProcessBroker, TokenAuth], token: str | None
) -> None:
    broker, _ = auth_broker
    async with Client(broker.service_url, auth_token=token) as client:
        with pytest.raises(AuthenticationFailed):
            await client.create_producer(TOPIC)
    assert broker.service.loaded_topic(TOPIC) is None


async def test_anonymous_role_lets_clients_without_credentials_in(tmp_path: Path) -> None:
    auth = TokenAuth(extra={"anonymous_user_role": "guest"})
    async with (
        InProcessBroker(tmp_path, security=auth) as broker,
        Client(broker.service_url) as client,
    ):
        producer = await client.create_producer(TOPIC)
        await producer.send(b"x")
        assert "guest" in session_roles(broker)


async def test_auth_disabled_sessions_have_no_role(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker:
        async with Client(broker.service_url) as client:
            producer = await client.create_producer(TOPIC)
            await producer.send(b"x")
            roles = session_roles(broker)
        assert broker.service.authentication is None
    assert roles and all(role is None for role in roles)


# --- HTTP ---------------------------------------------------------------------------------


async def http_status(url: str, headers: dict[str, str] | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        body = await resp.json(content_type=None) if resp.status != 200 else None
        return resp.status, body


async def test_http_needs_a_valid_bearer_token(
    auth_broker: tuple[InProcessBroker, TokenAuth],
) -> None:
    broker, auth = auth_broker
    url = f"{broker.http_url}/admin/v2/tenants"
    status, body = await http_status(url)
    assert status == 401
    assert isinstance(body, dict) and "reason" in body
    assert (await http_status(url, {"Authorization": "Bearer nope"}))[0] == 401
    wrong = TokenAuth().token("alice")
    assert (await http_status(url, {"Authorization": f"Bearer {wrong}"}))[0] == 401
    good = {"Authorization": f"Bearer {auth.token('alice')}"}
    assert (await http_status(url, good))[0] == 200


async def test_http_metrics_need_credentials_health_does_not(
    auth_broker: tuple[InProcessBroker, TokenAuth],
) -> None:
    broker, auth = auth_broker
    assert (await http_status(f"{broker.http_url}/metrics"))[0] == 401
    good = {"Authorization": f"Bearer {auth.token('alice')}"}
    assert (await http_status(f"{broker.http_url}/metrics", good))[0] == 200
    assert (await http_status(f"{broker.http_url}/admin/v2/brokers/health"))[0] == 200


async def test_http_metrics_open_when_configured(tmp_path: Path) -> None:
    auth = TokenAuth(extra={"authenticate_metrics_endpoint": False})
    async with InProcessBroker(tmp_path, security=auth) as broker:
        assert (await http_status(f"{broker.http_url}/metrics"))[0] == 200
        assert (await http_status(f"{broker.http_url}/admin/v2/tenants"))[0] == 401


async def test_standalone_process_with_token_auth_from_env(tmp_path: Path) -> None:
    """``anabranch standalone`` configured through ``ANABRANCH_*`` variables (lists in
    Pulsar's comma form); the readiness probe authenticates with the broker token."""
    auth = TokenAuth()
    process = BrokerProcess(tmp_path / "data", security=auth)
    await process.start()
    try:
        async with Client(process.service_url, auth_token=auth.token("erin")) as client:
            producer = await client.create_producer(TOPIC)
            await producer.send(b"x")
        async with Client(process.service_url, auth_token="bad") as client:
            with pytest.raises(AuthenticationFailed):
                await client.create_producer(TOPIC)
    finally:
        await process.stop()

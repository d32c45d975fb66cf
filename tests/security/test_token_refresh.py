"""Expired tokens on live connections: the broker sends AUTH_CHALLENGE, a client with a
token supplier answers with a fresh token and keeps its connection; one that cannot is
closed (Pulsar's authenticationRefreshCheckSeconds)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pulsar

from anabranch.aio import Client
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.security import TokenAuth

TOPIC = "persistent://public/default/refresh"
LIFETIME_S = 2.0


POLLS = 400
"""Polls 25 ms apart: 10 s, several refresh intervals past the token's lifetime."""


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    for _ in range(POLLS):
        if condition():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never happened: {what}")


async def test_supplier_answers_the_challenge_and_the_connection_stays(tmp_path: Path) -> None:
    auth = TokenAuth(extra={"auth_refresh_check_s": 0.2})
    issued: list[str] = []

    def supplier() -> str:
        issued.append(auth.token("alice", expires_in_s=LIFETIME_S))
        return issued[-1]

    async with InProcessBroker(tmp_path, security=auth) as broker:
        counters = broker.service.counters
        async with Client(broker.service_url, auth_token=supplier) as client:
            producer = await client.create_producer(TOPIC)
            opened = counters.connections_opened
            await wait_for(lambda: counters.authentication_refreshes >= 1, "a refresh")
            await producer.send(b"after-refresh")
            assert counters.connections_opened == opened  # the same connection
            assert counters.authentication_failures == 0
            assert len(issued) >= 2


async def test_expired_static_token_closes_the_connection(tmp_path: Path) -> None:
    auth = TokenAuth(extra={"auth_refresh_check_s": 0.2})
    token = auth.token("alice", expires_in_s=LIFETIME_S)
    async with InProcessBroker(tmp_path, security=auth) as broker:
        counters = broker.service.counters
        async with Client(broker.service_url, auth_token=token) as client:
            await client.create_producer(TOPIC)
            await wait_for(lambda: counters.authentication_failures >= 1, "the close")
            assert counters.authentication_refreshes == 0


def official_producer_across_expiry(url: str, supplier: Callable[[], str]) -> None:
    client = pulsar.Client(
        url, authentication=pulsar.AuthenticationToken(supplier), operation_timeout_seconds=30
    )
    try:
        producer = client.create_producer(TOPIC)
        producer.send(b"before")
        time.sleep(LIFETIME_S * 2)  # the token expires and the broker challenges it
        producer.send(b"after")
    finally:
        client.close()


async def test_official_client_token_supplier_answers_the_challenge(tmp_path: Path) -> None:
    auth = TokenAuth(extra={"auth_refresh_check_s": 0.2})
    issued: list[str] = []

    def supplier() -> str:
        issued.append(auth.token("alice", expires_in_s=LIFETIME_S))
        return issued[-1]

    async with InProcessBroker(tmp_path, security=auth) as broker:
        counters = broker.service.counters
        await asyncio.to_thread(official_producer_across_expiry, broker.service_url, supplier)
        assert counters.authentication_refreshes >= 1
        assert counters.authentication_failures == 0
        assert counters.connections_opened == 1  # no reconnect was needed

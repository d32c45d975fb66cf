"""Autoscale policies through the admin API and CLI: namespace and topic overrides over the
broker defaults, validation, the owner's segment-load route and the stats' intent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from typer.testing import CliRunner

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.cli.main import app
from anabranch.testing.broker import InProcessBroker
from tests.admin.test_scalable_cli import admin_url  # noqa: F401 (a fixture)

TOPIC = "topic://public/default/orders"
NS = "public/default"


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


async def test_topic_over_namespace_over_broker_defaults(admin: AdminClient) -> None:
    await admin.create_scalable_topic(TOPIC, 1)
    assert await admin.get_scalable_autoscale(NS) is None
    assert await admin.get_scalable_autoscale(TOPIC) is None
    applied = await admin.get_scalable_autoscale(TOPIC, applied=True)
    assert (applied["enabled"], applied["maxSegments"]) == (False, 16)  # off by default

    await admin.set_scalable_autoscale(NS, {"enabled": True, "maxSegments": 8})
    await admin.set_scalable_autoscale(TOPIC, {"maxSegments": 4, "splitMsgRateIn": 100})
    assert await admin.get_scalable_autoscale(NS) == {"enabled": True, "maxSegments": 8}
    applied = await admin.get_scalable_autoscale(TOPIC, applied=True)
    assert (applied["enabled"], applied["maxSegments"], applied["splitMsgRateIn"]) == (
        True,
        4,
        100.0,
    )
    await admin.remove_scalable_autoscale(TOPIC)
    assert (await admin.get_scalable_autoscale(TOPIC, applied=True))["maxSegments"] == 8
    await admin.remove_scalable_autoscale(NS)
    assert (await admin.get_scalable_autoscale(TOPIC, applied=True))["enabled"] is False


async def test_invalid_policies_are_refused_and_nothing_is_stored(admin: AdminClient) -> None:
    await admin.create_scalable_topic(TOPIC, 1)
    await admin.set_scalable_autoscale(NS, {"maxSegments": 4})
    for body in ({"maxSegments": "many"}, {"bogus": 1}, {"mergeLowWater": 2.0}):
        assert (await failure(admin.set_scalable_autoscale(TOPIC, body))).status == 400
    # Valid alone, but not under the namespace's maxSegments 4.
    assert (await failure(admin.set_scalable_autoscale(TOPIC, {"minSegments": 5}))).status == 400
    assert await admin.get_scalable_autoscale(TOPIC) is None
    missing = "topic://public/default/missing"
    assert (await failure(admin.set_scalable_autoscale(missing, {"enabled": True}))).status == 404
    assert (await failure(admin.get_scalable_autoscale(missing))).status == 404


async def test_owner_load_route_and_stats_intent(
    broker: InProcessBroker, admin: AdminClient
) -> None:
    await admin.create_scalable_topic(TOPIC, 1)
    assert broker.node is not None
    service = broker.node.service
    await service.autoscaler.evaluate_all()
    assert (await admin.scalable_stats(TOPIC))["segments"]["0"]["intent"] == "disabled"
    await admin.set_scalable_autoscale(TOPIC, {"enabled": True, "splitMsgRateIn": 1e9})
    assert broker.service_url is not None and broker.http_url is not None
    async with Client(broker.service_url) as client:
        producer = await client.create_producer(TOPIC)
        for i in range(5):
            await producer.send(b"v", key=f"k{i}")
        await producer.close()
    layout = await admin.get_scalable_topic(TOPIC)
    descriptor = "0000-ffff-0"
    assert layout["segments"]["0"]["state"] == "ACTIVE"
    url = f"{broker.http_url}/admin/v2/cluster/segments/public/default/orders/{descriptor}/load"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200
        load = await response.json()
    assert load["msgInCounter"] == 5 and load["bytesInCounter"] > 0
    await service.autoscaler.evaluate_all()
    await asyncio.sleep(0.01)  # two readings some time apart make a rate
    await service.autoscaler.evaluate_all()
    stats = await admin.scalable_stats(TOPIC)
    assert stats["segments"]["0"]["intent"].startswith("hold")
    assert stats["autoscale"]["policy"]["enabled"] is True
    assert set(stats["segments"]["0"]["rates"]) >= {"msgRateIn", "backlog"}
    # The overrides live under the topic: deleting it deletes them.
    await admin.delete_scalable_topic(TOPIC)
    await admin.create_scalable_topic(TOPIC, 1)
    assert await admin.get_scalable_autoscale(TOPIC) is None


def test_cli_sets_gets_and_removes_overrides(admin_url: str) -> None:  # noqa: F811
    runner = CliRunner()

    def cli(*args: str, code: int = 0) -> str:
        result = runner.invoke(app, ["admin", "--admin-url", admin_url, "scalable", *args])
        assert result.exit_code == code, (result.stdout, result.stderr)
        return result.stdout

    cli("create", TOPIC)
    cli("set-autoscale", TOPIC, "enabled=true", "maxSegments=6", "mergeLowWater=0.2")
    got = json.loads(cli("get-autoscale", TOPIC, "--output", "json"))
    assert got == {"enabled": True, "maxSegments": 6, "mergeLowWater": 0.2}
    applied = json.loads(cli("get-autoscale", TOPIC, "--applied", "--output", "json"))
    assert applied["splitSustainMs"] == 30_000
    cli("set-autoscale", TOPIC, "maxSegments=lots", code=1)
    cli("remove-autoscale", TOPIC)
    assert cli("get-autoscale", TOPIC, "--output", "json").strip() == "null"
    assert "intent" in cli("stats", TOPIC)

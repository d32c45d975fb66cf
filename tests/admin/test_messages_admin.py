"""Peek, examine, get-by-id and expire over the admin API and CLI, on messages the
official client wrote (batched and not, with keys and properties, compressed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pulsar
import pytest
from typer.testing import CliRunner

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.cli.main import app
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.clock import ManualClock

TOPIC = "persistent://public/default/peek"
SUB_PATH = "/admin/v2/persistent/public/default/peek/subscription"


def produce(url: str) -> None:
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        client.subscribe(TOPIC, "billing").close()
        client.subscribe(TOPIC, "audit").close()
        plain = client.create_producer(
            TOPIC, batching_enabled=False, compression_type=pulsar.CompressionType.LZ4
        )
        plain.send(b"first", partition_key="k1", properties={"source": "test"})
        plain.send(b"second")
        batched = client.create_producer(
            TOPIC, batching_enabled=True, batching_max_publish_delay_ms=50
        )
        for i in range(3):
            batched.send_async(f"batched-{i}".encode(), None, partition_key=f"b{i}")
        batched.flush()
    finally:
        client.close()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path) as broker:
        await asyncio.to_thread(produce, broker.service_url)
        yield broker


def cli(url: str, *args: str) -> Any:
    result = CliRunner().invoke(app, ["admin", "--admin-url", url, *args, "--output", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if result.output.strip() else None


async def test_peek_splits_batches_and_keeps_the_backlog(world: InProcessBroker) -> None:
    assert world.http_url is not None
    async with AdminClient(world.http_url) as admin:
        peeked = await admin.peek_messages(TOPIC, "billing", 5)
        assert [m["payload"] for m in peeked] == [
            b"first", b"second", b"batched-0", b"batched-1", b"batched-2",
        ]  # fmt: skip
        first = peeked[0]
        assert first["key"] == "k1" and first["properties"] == {"source": "test"}
        assert peeked[2]["key"] == "b0" and peeked[2]["messageId"].count(":") == 2
        again = await admin.peek_messages(TOPIC, "billing", 1)
        assert again[0]["payload"] == b"first"  # peeking acknowledges nothing
        assert len(await admin.peek_messages(TOPIC, "billing", 10)) == 5  # all there is
        with pytest.raises(AdminHttpError) as past:  # 3 entries: the 4th is 404
            await admin.request_raw("GET", f"{SUB_PATH}/billing/position/4")
        assert past.value.status == 404
        with pytest.raises(AdminHttpError) as zero:
            await admin.request_raw("GET", f"{SUB_PATH}/billing/position/0")
        assert zero.value.status == 400
        with pytest.raises(AdminHttpError) as unknown:
            await admin.peek_messages(TOPIC, "nobody", 1)
        assert unknown.value.status == 404


async def test_examine_and_get_by_id(world: InProcessBroker) -> None:
    assert world.http_url is not None
    async with AdminClient(world.http_url) as admin:
        earliest = await admin.examine_message(TOPIC, "earliest", 2)
        assert [m["payload"] for m in earliest] == [b"second"]
        latest = await admin.examine_message(TOPIC, "latest", 1)
        assert [m["payload"] for m in latest][-1] == b"batched-2"
        ledger, entry = (int(x) for x in earliest[0]["messageId"].split(":"))
        by_id = await admin.get_message_by_id(TOPIC, ledger, entry)
        assert by_id[0]["payload"] == b"second"
        for bad, status in ((("earliest", 0), 400), (("sideways", 1), 400), (("latest", 99), 404)):
            with pytest.raises(AdminHttpError) as refused:
                await admin.examine_message(TOPIC, *bad)
            assert refused.value.status == status
        with pytest.raises(AdminHttpError) as missing:
            await admin.get_message_by_id(TOPIC, ledger, entry + 1000)
        assert missing.value.status == 404


async def test_expire_messages_moves_cursors_forward_only(world: InProcessBroker) -> None:
    assert world.http_url is not None
    http = world.http_url
    async with AdminClient(http) as admin:
        await admin.expire_messages(TOPIC, "billing", 3600)  # nothing is an hour old
        assert len(await admin.peek_messages(TOPIC, "billing", 5)) == 5
        await asyncio.sleep(1.1)  # now every message is older than 1 s
        await asyncio.to_thread(cli, http, "topics", "expire-messages", TOPIC, "-s", "billing",
                                "-t", "1")  # fmt: skip
        with pytest.raises(AdminHttpError):
            await admin.peek_messages(TOPIC, "billing", 1)
        stats = await admin.request("GET", "/admin/v2/persistent/public/default/peek/stats")
        assert stats["subscriptions"]["billing"]["msgBacklog"] == 0
        assert stats["subscriptions"]["audit"]["msgBacklog"] > 0
        # Pulsar's backlogSize is bytes (the slowest subscription's): 3 entries here.
        assert stats["backlogEntries"] == 3
        assert 0 < stats["backlogSize"] <= stats["storageSize"]
        await admin.expire_messages_all_subscriptions(TOPIC, 1)
        stats = await admin.request("GET", "/admin/v2/persistent/public/default/peek/stats")
        assert stats["subscriptions"]["audit"]["msgBacklog"] == 0
        assert stats["backlogSize"] == stats["backlogEntries"] == 0


async def test_cli_prints_peeked_messages(world: InProcessBroker) -> None:
    assert world.http_url is not None
    shown = await asyncio.to_thread(
        cli, world.http_url, "topics", "examine-message", TOPIC, "-i", "earliest", "-m", "1"
    )
    assert shown[0]["payload"] == "first" and shown[0]["properties"] == {"source": "test"}


async def test_stats_rates_are_shared_by_callers_polling_faster_than_the_window(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    async with InProcessBroker(tmp_path, clock=clock) as broker:
        assert broker.http_url is not None
        await asyncio.to_thread(produce, broker.service_url)
        clock.advance(2.0)  # two seconds after the topic was loaded
        async with AdminClient(broker.http_url) as admin:
            path = "/admin/v2/persistent/public/default/peek/stats"
            first, second = [await admin.request("GET", path) for _ in range(2)]
            # The first call started a new mark; the second, within the window, reuses the
            # one before it instead of measuring zero messages over no time.
            assert first["msgRateIn"] == second["msgRateIn"] == 5 / 2.0
            clock.advance(1.0)
            assert (await admin.request("GET", path))["msgRateIn"] == 0.0  # nothing new

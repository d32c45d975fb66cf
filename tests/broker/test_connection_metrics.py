"""Broker-wide counters reach ``/metrics``: connections opened/closed, frames refused from
their length prefix, connections closed for other protocol errors; and internal stats
report the bytes stored."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from anabranch.aio import Client
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import encode_command
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_core_protocol import RawClient

T = pb.BaseCommand
TOPIC = "persistent://public/default/counted"
CLUSTER = {"cluster": "standalone"}


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, metadata="memory") as b:
        yield b


async def scrape(broker: InProcessBroker) -> dict[str, float]:
    assert broker.http_url is not None
    async with aiohttp.ClientSession() as http, http.get(broker.http_url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels == CLUSTER
    }


async def test_connection_and_bad_frame_counters_reach_metrics(broker: InProcessBroker) -> None:
    before = await scrape(broker)
    assert before["anabranch_bad_frames_total"] == 0
    assert before["anabranch_protocol_errors_total"] == 0

    healthy = await RawClient.open(broker.port)
    bad_length = await RawClient.open(broker.port)
    bad_command = await RawClient.open(broker.port)
    try:
        await healthy.handshake()
        await bad_length.handshake()
        await bad_length.raw(struct.pack(">I", 2**31 - 1) + b"\x00" * 16)  # oversized prefix
        await bad_length.closed_by_broker()
        await bad_command.raw(encode_command(commands.ping()))  # a command before CONNECT
        await bad_command.closed_by_broker()

        during = await scrape(broker)
        assert during["anabranch_bad_frames_total"] == 1
        assert during["anabranch_protocol_errors_total"] == 1
        assert broker.service.protocol_errors == 2
        # 3 connections so far (scrapes are HTTP, not counted); 2 closed by the broker.
        assert during["anabranch_connections_opened_total"] == 3
        assert during["anabranch_connections_closed_total"] == 2
        assert during["anabranch_active_connections"] == 1
        await healthy.send(commands.ping())
        await healthy.expect(T.PONG)
    finally:
        await healthy.close()
        await bad_length.close()
        await bad_command.close()


async def test_internal_stats_report_storage_size(broker: InProcessBroker) -> None:
    client = await RawClient.open(broker.port)
    try:
        await client.handshake()
        await client.send(commands.producer(TOPIC, 1, 1, "sizer"))
        await client.expect(T.PRODUCER_SUCCESS)
        for seq in range(5):
            await client.send_message(1, seq, b"x" * 100, name="sizer")
            await client.expect(T.SEND_RECEIPT)
    finally:
        await client.close()
    topic = broker.service.loaded_topic(TOPIC)
    assert topic is not None
    stored = sum(info.size for info in topic.ledger.ledgers)  # type: ignore[attr-defined]
    assert stored >= 5 * 100  # each entry: metadata + the 100-byte payload
    assert broker.http_url is not None
    path = "/admin/v2/persistent/public/default/counted"
    async with aiohttp.ClientSession() as http:
        async with http.get(broker.http_url + path + "/internalStats") as resp:
            internal = await resp.json()
        async with http.get(broker.http_url + path + "/stats") as resp:
            stats = await resp.json()
    assert internal["storageSize"] == internal["totalSize"] == stored
    assert internal["numberOfEntries"] == 5
    assert internal["currentLedgerEntries"] == 5
    assert internal["currentLedgerSize"] == stored
    assert stats["storageSize"] == stored


async def test_the_policy_cache_reports_its_hits(broker: InProcessBroker) -> None:
    before = await scrape(broker)
    assert before["anabranch_policy_cache_live"] == 1
    async with Client(broker.service_url) as client:
        for _ in range(3):
            producer = await client.create_producer(TOPIC)
            await producer.close()
    after = await scrape(broker)
    # Each create reads the partitioned metadata, namespace and topic policies: the
    # first ones from the store, the others from memory.
    hits = after["anabranch_policy_cache_hits_total"] - before["anabranch_policy_cache_hits_total"]
    assert hits >= 6
    assert after["anabranch_policy_cache_entries"] >= 3


async def test_the_tail_caches_stay_within_storage_cache_bytes(tmp_path: Path) -> None:
    """Topics written one after another hold the broker's cache budget in all: the gauge
    never passes it, the older topics' entries were evicted, and they still read back."""
    async with InProcessBroker(tmp_path, metadata="memory", storage_cache_bytes=8192) as b:
        topics = [f"persistent://public/default/cached-{i}" for i in range(4)]
        async with Client(b.service_url) as client:
            for topic in topics:
                producer = await client.create_producer(topic)
                for n in range(20):
                    await producer.send(f"{topic}:{n}".encode() + b"." * 300)
                await producer.close()
                held = (await scrape(b))["anabranch_storage_cache_bytes"]
                assert 0 < held <= 8192
            metrics = await scrape(b)
            assert metrics["anabranch_storage_cache_limit_bytes"] == 8192
            assert metrics["anabranch_storage_cache_evicted_bytes_total"] > 4 * 20 * 300 - 8192
            consumer = await client.subscribe(topics[0], "s", initial_position="earliest")
            for n in range(20):
                msg = await consumer.receive(timeout=10)
                assert msg is not None
                assert msg.value.startswith(f"{topics[0]}:{n}.".encode())
            await consumer.close()

"""Tiered storage end to end: a real in-process broker offloading to a real SeaweedFS.

A topic with a tiny rollover (10 entries per ledger) seals ledgers quickly; the admin
trigger or a namespace threshold offloads them, the deletion lag (0 here) lets the sweep
drop the hot files, and our client, the official ``pulsar`` client and a restarted broker
all read every message back. The faults: S3 stopped during an offload (status ERROR, the
ledger stays hot, retried once S3 is back), wrong credentials (a clear error), and a
broker without an offload driver (409).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pulsar
import pytest

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.core.names import SegmentName
from anabranch.storage.base import ManagedLedgerBase
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.seaweedfs import SeaweedS3

NS = "public/default"
HANG_GUARD_S = 60.0
PER_LEDGER = 10


def broker_for(data: Path, s3: SeaweedS3 | None, **overrides: Any) -> InProcessBroker:
    settings: dict[str, Any] = {
        "managed_ledger_max_entries_per_ledger": PER_LEDGER,
        "offload_check_interval_s": 0.2,
        "offload_deletion_lag_ms": 0,
        "cursor_persist_interval_ms": 0,
    }
    if s3 is not None:
        settings.update(
            offload_driver="s3",
            s3_endpoint=s3.endpoint,
            s3_bucket=s3.bucket,
            s3_region=s3.region,
            s3_access_key_id=s3.access_key,
            s3_secret_access_key=s3.secret_key,
        )
    settings.update(overrides)
    return InProcessBroker(data, metadata="sqlite", **settings)


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    async with asyncio.timeout(HANG_GUARD_S):  # a hang guard, not a time limit on the code
        for _ in itertools.count():
            if await check():
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


async def produce(client: Client, topic: str, count: int) -> list[Any]:
    producer = await client.create_producer(topic, batching=False)
    ids = [await producer.send(b"m%03d" % i) for i in range(count)]
    await producer.close()
    return ids


async def read_all(client: Client, topic: str, count: int) -> list[bytes]:
    reader = await client.create_reader(topic, "earliest")
    out = []
    for _ in range(count):
        msg = await reader.read_next(timeout=10)
        assert msg is not None
        out.append(msg.value)
    await reader.close()
    return out


def official_read_all(url: str, topic: str, count: int) -> list[bytes]:
    client = pulsar.Client(url, operation_timeout_seconds=15)
    try:
        consumer = client.subscribe(
            topic, "official", initial_position=pulsar.InitialPosition.Earliest
        )
        out = []
        for _ in range(count):
            msg = consumer.receive(timeout_millis=10_000)
            out.append(msg.data())
            consumer.acknowledge(msg)
        consumer.close()
        return out
    finally:
        client.close()


def hot_files(data: Path) -> set[str]:
    return {p.name for p in (data / "ledgers").glob("*/*.log")}


async def internal_ledgers(admin: AdminClient, topic: str) -> list[dict[str, Any]]:
    return list((await admin.internal_stats(topic))["ledgers"])


async def test_manual_offload_read_back_everywhere_and_after_restart(
    tmp_path: Path, seaweed: SeaweedS3
) -> None:
    topic = f"persistent://{NS}/manual"
    expected = [b"m%03d" % i for i in range(35)]
    data = tmp_path / "data"
    async with broker_for(data, seaweed) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            ids = await produce(client, topic, 35)
            status = await admin.offload_status(topic)
            assert status["status"] == "NOT_RUN"
            before = await asyncio.to_thread(hot_files, data)
            assert len(before) == 4  # three sealed ledgers and the open one
            last = ids[-1]
            await admin.offload(topic, (last.ledger_id, last.entry_id))

            async def done() -> bool:
                return str((await admin.offload_status(topic))["status"]) == "SUCCESS"

            await eventually(done, "offload succeeds")
            ledgers = await internal_ledgers(admin, topic)
            assert [i["offloaded"] for i in ledgers] == [True, True, True, False]
            status = await admin.offload_status(topic)
            assert status["firstUnoffloadedMessage"]["ledgerId"] == last.ledger_id

            async def hot_gone() -> bool:
                return len(await asyncio.to_thread(hot_files, data)) == 1

            await eventually(hot_gone, "hot copies deleted after the lag")
            metrics = await admin.metrics()
            assert 'anabranch_ledgers_offloaded_total{cluster="standalone"} 3.0' in metrics
            assert await read_all(client, topic, 35) == expected
            first = ids[3]  # in the first, now cold, ledger: the admin reads it from S3 too
            [got] = await admin.get_message_by_id(topic, first.ledger_id, first.entry_id)
            assert got["payload"] == b"m003"
            url = broker.service_url
            assert await asyncio.to_thread(official_read_all, url, topic, 35) == expected

    async with broker_for(data, seaweed) as again, Client(again.service_url) as client:
        assert await read_all(client, topic, 35) == expected


async def test_namespace_threshold_offloads_automatically(
    tmp_path: Path, seaweed: SeaweedS3
) -> None:
    topic = f"persistent://{NS}/threshold"
    async with broker_for(tmp_path / "data", seaweed, offload_deletion_lag_ms=-1) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            assert await admin.get_offload_value(NS, "offloadThreshold") == -1
            await admin.set_offload_value(NS, "offloadThreshold", 0)
            assert await admin.get_offload_value(NS, "offloadThreshold") == 0
            await produce(client, topic, 25)

            async def offloaded() -> bool:
                flags = [i["offloaded"] for i in await internal_ledgers(admin, topic)]
                return flags == [True, True, False]

            await eventually(offloaded, "the threshold offloads both sealed ledgers")
            # A deletion lag of -1 keeps the hot copies.
            assert len(await asyncio.to_thread(hot_files, tmp_path / "data")) == 3
            await admin.remove_offload_value(NS, "offloadThreshold")
            assert await admin.get_offload_value(NS, "offloadThreshold") == -1
            path = f"/admin/v2/namespaces/{NS}/offloadPolicies"
            assert await admin.request("GET", path) is None
            body = {"managedLedgerOffloadThresholdInSeconds": 3600}
            await admin.request("POST", path, body)
            assert await admin.request("GET", path) == body
            with pytest.raises(AdminHttpError) as caught:
                await admin.request("POST", path, {"managedLedgerOffloadThresholdInBytes": -5})
            assert caught.value.status == 400
            await admin.request("DELETE", path)
            assert await admin.request("GET", path) is None


async def test_wrong_credentials_and_no_driver_are_clear_errors(
    tmp_path: Path, seaweed: SeaweedS3
) -> None:
    topic = f"persistent://{NS}/denied"
    async with broker_for(
        tmp_path / "a", seaweed, s3_secret_access_key="wrong-secret", offload_check_interval_s=30
    ) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            ids = await produce(client, topic, 15)
            await admin.offload(topic, (ids[-1].ledger_id, 0))

            async def failed() -> bool:
                return str((await admin.offload_status(topic))["status"]) == "ERROR"

            await eventually(failed, "offload fails")
            status = await admin.offload_status(topic)
            assert "credentials" in status["lastError"]
            assert "s3_secret_access_key" in status["lastError"]
            assert seaweed.endpoint not in status["lastError"]
            assert not any(i["offloaded"] for i in await internal_ledgers(admin, topic))

    async with broker_for(tmp_path / "b", None) as plain:
        assert plain.http_url is not None
        async with AdminClient(plain.http_url) as admin, Client(plain.service_url) as client:
            ids = await produce(client, topic, 15)
            with pytest.raises(AdminHttpError) as caught:
                await admin.offload(topic, (ids[-1].ledger_id, 0))
            assert caught.value.status == 409
            assert "offload is not configured" in caught.value.reason


async def test_s3_down_during_offload_stays_hot_then_retries(
    tmp_path: Path, seaweed: SeaweedS3
) -> None:
    topic = f"persistent://{NS}/outage"
    data = tmp_path / "data"
    async with broker_for(data, seaweed, offload_deletion_lag_ms=-1) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            ids = await produce(client, topic, 25)
            await asyncio.to_thread(seaweed.stop)
            try:
                await admin.offload(topic, (ids[-1].ledger_id, 0))

                async def failed() -> bool:
                    return str((await admin.offload_status(topic))["status"]) == "ERROR"

                await eventually(failed, "offload fails while S3 is down")
                assert "unavailable" in (await admin.offload_status(topic))["lastError"]
                assert not any(i["offloaded"] for i in await internal_ledgers(admin, topic))
                assert len(await asyncio.to_thread(hot_files, data)) == 3
                assert await read_all(client, topic, 25) == [b"m%03d" % i for i in range(25)]
            finally:
                await asyncio.to_thread(seaweed.start_again)

            async def retried() -> bool:
                return str((await admin.offload_status(topic))["status"]) == "SUCCESS"

            await eventually(retried, "the sweep retries the offload once S3 is back")
            flags = [i["offloaded"] for i in await internal_ledgers(admin, topic)]
            assert flags == [True, True, False]


async def test_scalable_topic_segments_are_offloaded_and_read_back(
    tmp_path: Path, seaweed: SeaweedS3
) -> None:
    segment = f"segment://{NS}/scaled/0000-ffff-0"
    data = tmp_path / "data"
    async with broker_for(data, seaweed) as broker:
        assert broker.http_url is not None
        await broker.service.scalable.ops.create_segment(SegmentName.parse(segment), [])
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            await admin.set_offload_value(NS, "offloadThreshold", 0)
            await produce(client, segment, 25)
            topic = await broker.service.get_topic(segment, create=False)
            ledger = topic.ledger
            assert isinstance(ledger, ManagedLedgerBase)

            async def cold() -> bool:
                return [i.hot for i in ledger.ledgers] == [False, False, True]

            await eventually(cold, "the segment's sealed ledgers offloaded and dropped")
            assert await read_all(client, segment, 25) == [b"m%03d" % i for i in range(25)]


async def test_topic_offload_policies_override_the_namespace(
    tmp_path: Path, seaweed: SeaweedS3
) -> None:
    kept = f"persistent://{NS}/kept-hot"
    moved = f"persistent://{NS}/moved"
    async with broker_for(tmp_path / "data", seaweed, offload_deletion_lag_ms=-1) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            await produce(client, kept, 15)
            await produce(client, moved, 15)
            path = f"/admin/v2/persistent/{NS}/kept-hot/offloadPolicies"
            assert await admin.request("GET", path) is None
            body = {"managedLedgerOffloadThresholdInBytes": -1}
            await admin.request("POST", path, body)
            assert await admin.request("GET", path) == body
            await admin.set_offload_value(NS, "offloadThreshold", 0)

            async def moved_offloaded() -> bool:
                return [i["offloaded"] for i in await internal_ledgers(admin, moved)] == [
                    True,
                    False,
                ]

            await eventually(moved_offloaded, "the namespace threshold offloads `moved`")
            sweeps = broker.service.offloader.sweeps

            async def swept_again() -> bool:
                return broker.service.offloader.sweeps > sweeps + 1

            await eventually(swept_again, "two more sweeps")
            assert not any(i["offloaded"] for i in await internal_ledgers(admin, kept))
            await admin.request("DELETE", path)

            async def kept_offloaded() -> bool:
                return any(i["offloaded"] for i in await internal_ledgers(admin, kept))

            await eventually(kept_offloaded, "without the override the namespace's applies")
            with pytest.raises(AdminHttpError) as caught:
                await admin.request("GET", f"/admin/v2/persistent/{NS}/absent/offloadPolicies")
            assert caught.value.status == 404

"""The Spark source reads a scalable topic whose sealed ledgers were offloaded to S3 (a
real SeaweedFS; deletion lag 0 drops the hot copies at once): the rows are those written,
without any option (tiered storage is transparent to readers)."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from anabranch.aio import Client
from anabranch.testing.broker import BrokerProcess, _settings_env
from anabranch.testing.seaweedfs import SeaweedS3
from pyspark_anabranch import _io
from tests.spark.conftest import Broker, keyed, wait_for_admin

PER_LEDGER = 5
"""Entries per ledger: a few dozen rows make several sealed ledgers to offload."""
HANG_GUARD_S = 120.0


@pytest.fixture(scope="module")
def offloading(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    s3 = SeaweedS3.start(tmp_path_factory.mktemp("seaweed"))
    settings = {
        "managed_ledger_max_entries_per_ledger": PER_LEDGER,
        "offload_check_interval_s": 0.2,
        "offload_deletion_lag_ms": 0,
        "offload_driver": "s3",
        "s3_endpoint": s3.endpoint,
        "s3_bucket": s3.bucket,
        "s3_region": s3.region,
        "s3_access_key_id": s3.access_key,
        "s3_secret_access_key": s3.secret_key,
    }
    proc = BrokerProcess(
        tmp_path_factory.mktemp("broker") / "data", fsync="never", env=_settings_env(settings)
    )
    asyncio.run(proc.start())
    try:
        admin_url = f"http://127.0.0.1:{proc.http_port}"
        wait_for_admin(admin_url)
        yield Broker(proc.service_url, admin_url)
    finally:
        asyncio.run(proc.stop())
        s3.stop()


async def produce_unbatched(url: str, topic: str, rows: list[tuple[str, bytes]]) -> None:
    async with Client(url) as client:
        producer = await client.create_producer(topic, batching=False)
        for key, value in rows:
            await producer.send(value, key=key)
        await producer.close()


def offloaded(admin_url: str) -> int:
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(r"^anabranch_ledgers_offloaded_total\{[^}]*\} ([0-9.]+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


def test_a_batch_read_of_offloaded_ledgers_matches_the_rows_written(
    spark: Any, offloading: Broker
) -> None:
    topic = "topic://public/default/offloaded-spark"
    offloading.create(topic, 1)
    rows = keyed("o", 4, 10)  # 40 single-message entries: 7 sealed ledgers of 5
    asyncio.run(produce_unbatched(offloading.service_url, topic, rows))
    admin = _io.admin_for(offloading.admin_url)
    _io.run(admin.set_offload_value("public/default", "offloadThreshold", 0))
    deadline = time.monotonic() + HANG_GUARD_S  # a hang guard, not a time limit on the code
    while offloaded(offloading.admin_url) < 7:
        assert time.monotonic() < deadline, "the sealed ledgers were never offloaded"
        time.sleep(0.2)
    df = spark.read.format("anabranch").options(**offloading.options(topic)).load()
    got = sorted((r["key"], r["value"]) for r in df.select("key", "value").collect())
    assert got == sorted((key.encode(), value) for key, value in rows)  # key is binary

"""Fixtures for the Spark tests: a broker subprocess (Spark's Python workers are separate
processes that reach it over TCP), one local Spark session per test module, and a producer
helper that routes keys to segments like the sink does."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from anabranch.testing.broker import BrokerProcess
from pyspark_anabranch import _io


@dataclass
class Broker:
    service_url: str
    admin_url: str

    def options(self, topic: str, **extra: str) -> dict[str, str]:
        return {"serviceUrl": self.service_url, "adminUrl": self.admin_url, "topic": topic, **extra}

    def create(self, topic: str, segments: int) -> None:
        _io.run(_io.admin_for(self.admin_url).create_scalable_topic(topic, segments))

    def layout(self, topic: str) -> dict[str, Any]:
        return dict(_io.run(_io.admin_for(self.admin_url).get_scalable_topic(topic)))

    def split(self, topic: str, segment_id: int) -> None:
        _io.run(_io.admin_for(self.admin_url).split_segment(topic, segment_id))

    def merge(self, topic: str, a: int, b: int) -> None:
        _io.run(_io.admin_for(self.admin_url).merge_segments(topic, a, b))

    def active(self, topic: str) -> list[int]:
        """Active segment ids in hash-range order (neighbours are adjacent)."""
        segs = [s for s in self.layout(topic)["segments"].values() if s["state"] == "ACTIVE"]
        return [s["segmentId"] for s in sorted(segs, key=lambda s: s["hashRange"]["start"])]

    def produce(self, topic: str, rows: list[tuple[str, bytes]]) -> int:
        """Send (key, value) rows in order and wait until all are stored."""
        sink = _io.TopicSink(_io.client_for(self.service_url))
        name = topic.removeprefix("topic://")

        async def go() -> int:
            try:
                await sink.send([(name, value, key, None, None) for key, value in rows])
                return await sink.finish()
            finally:
                await sink.close()

        return _io.run(go())


def wait_for_admin(admin_url: str, deadline_s: float = 30.0) -> None:
    """The binary port answers first; wait until the admin API does too."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            _io.run(_io.admin_for(admin_url).list_clusters())
            return
        except Exception:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    proc = BrokerProcess(tmp_path_factory.mktemp("broker") / "data", fsync="never")
    asyncio.run(proc.start())
    try:
        admin_url = f"http://127.0.0.1:{proc.http_port}"
        wait_for_admin(admin_url)
        yield Broker(proc.service_url, admin_url)
    finally:
        asyncio.run(proc.stop())


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("anabranch-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.pollingDelay", "50ms")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def topic(request: pytest.FixtureRequest) -> str:
    return f"topic://public/default/{request.node.name.replace('_', '-')[:60]}"


def keyed(tag: str, keys: int, per_key: int, offset: int = 0) -> list[tuple[str, bytes]]:
    """Rows ``(k<i>, b"<tag>:k<i>:<seq>")``, interleaved by key, seq from ``offset``."""
    return [
        (f"k{i}", f"{tag}:k{i}:{seq}".encode())
        for seq in range(offset, offset + per_key)
        for i in range(keys)
    ]

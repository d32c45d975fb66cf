"""``anabranch admin topics offload|offload-status`` and the namespaces' offload settings,
against a broker (running in a thread) that offloads to a real SeaweedFS."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from anabranch.aio import Client
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.seaweedfs import SeaweedS3
from tests.admin.test_cli import admin_url, cli, cli_json

__all__ = ["admin_url"]  # the fixture (a broker without an offload driver), for pytest

NS = "public/default"
TOPIC = f"persistent://{NS}/cli"


@dataclass
class Threaded:
    loop: asyncio.AbstractEventLoop
    broker: InProcessBroker

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)


@pytest.fixture
def offloading(tmp_path: Path, seaweed: SeaweedS3) -> Iterator[Threaded]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = InProcessBroker(
        tmp_path,
        managed_ledger_max_entries_per_ledger=5,
        offload_driver="aws-s3",
        s3_endpoint=seaweed.endpoint,
        s3_bucket=seaweed.bucket,
        s3_access_key_id=seaweed.access_key,
        s3_secret_access_key=seaweed.secret_key,
        offload_check_interval_s=0.2,
    )
    threaded = Threaded(loop, broker)
    try:
        threaded.run(broker.__aenter__())
        yield threaded
        threaded.run(broker.__aexit__(None, None, None))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


async def _produce(url: str, count: int) -> Any:
    async with Client(url) as client:
        producer = await client.create_producer(TOPIC, batching=False)
        ids = [await producer.send(b"c%d" % i) for i in range(count)]
        await producer.close()
        return ids[-1]


def test_namespace_offload_settings(offloading: Threaded) -> None:
    url = offloading.broker.http_url
    assert url is not None
    assert cli_json(url, "namespaces", "get-offload-threshold", NS) == -1
    cli(url, "namespaces", "set-offload-threshold", NS, "--size", "1G")
    assert cli_json(url, "namespaces", "get-offload-threshold", NS) == 1024**3
    cli(url, "namespaces", "set-offload-threshold-seconds", NS, "--time", "1h")
    assert cli_json(url, "namespaces", "get-offload-threshold-seconds", NS) == 3600
    assert cli_json(url, "namespaces", "get-offload-deletion-lag", NS) is None
    cli(url, "namespaces", "set-offload-deletion-lag", NS, "--lag", "10m")
    assert cli_json(url, "namespaces", "get-offload-deletion-lag", NS) == 600_000
    cli(url, "namespaces", "clear-offload-deletion-lag", NS)
    assert cli_json(url, "namespaces", "get-offload-deletion-lag", NS) is None


def test_topic_offload_and_status(offloading: Threaded) -> None:
    url = offloading.broker.http_url
    assert url is not None
    last = offloading.run(_produce(offloading.broker.service_url, 12))
    assert cli_json(url, "topics", "offload-status", TOPIC)["status"] == "NOT_RUN"
    cli(url, "topics", "offload", TOPIC, "-m", f"{last.ledger_id}:0")
    service = offloading.broker.service

    async def settled() -> dict[str, Any]:
        async with asyncio.timeout(60):  # a hang guard
            for _ in itertools.count():
                status = service.offloader.status(await topic())
                if status["status"] != "RUNNING":
                    return status
                await asyncio.sleep(0.05)
        raise AssertionError("unreachable")

    async def topic() -> Any:
        return await service.get_topic(TOPIC, create=False)

    assert offloading.run(settled())["status"] == "SUCCESS"
    status = cli_json(url, "topics", "offload-status", TOPIC)
    assert status["status"] == "SUCCESS"
    assert status["firstUnoffloadedMessage"]["ledgerId"] == last.ledger_id
    cli(url, "topics", "offload", TOPIC, code=2)  # neither -m nor -s
    offloading.run(_produce(offloading.broker.service_url, 5))  # one more sealed ledger
    cli(url, "topics", "offload", TOPIC, "-s", "0")  # keep nothing hot: every sealed ledger
    assert offloading.run(settled())["status"] == "SUCCESS"
    ledgers = cli_json(url, "topics", "internal-stats", TOPIC)["ledgers"]
    assert [i["offloaded"] for i in ledgers] == [True, True, True, False]


def test_offload_without_a_driver_is_refused(admin_url: str) -> None:
    out = cli(admin_url, "topics", "create", TOPIC)
    assert out is not None
    cli(admin_url, "topics", "offload", TOPIC, "-m", "1:0", code=1)
    cli(admin_url, "topics", "offload-status", TOPIC, code=1)

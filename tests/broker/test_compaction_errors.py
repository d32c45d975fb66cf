"""Compaction failures: a failed run reports ERROR with a reason that names no file path,
counts a failure in /metrics and leaves the previous view in force; a ledger a crash left
behind after a switch is deleted by the next run."""

from __future__ import annotations

from pathlib import Path

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.broker.metrics import broker_registry, render
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/failing"


async def test_a_failed_compaction_reports_error_and_keeps_the_view(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker, Client(broker.service_url) as client:
        assert broker.http_url is not None
        producer = await client.create_producer(TOPIC)
        for i in range(10):
            await producer.send(b"v%d" % i, key=f"k{i % 2}")
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None
        run = broker.service.compactions.of(topic)
        await run.trigger()
        await run.wait()
        assert run.status == "SUCCESS"
        horizon = await run.horizon()
        await producer.send(b"later", key="k0")
        await topic.ledger.close()  # reads of the topic fail from now on
        await run.trigger()
        await run.wait()
        async with AdminClient(broker.http_url) as admin:
            status = await admin.compaction_status(TOPIC)
        metrics = render(broker_registry(broker.service)).decode()
        assert await run.horizon() == horizon  # the previous view is still in force
    assert status["status"] == "ERROR"
    assert status["lastError"] and str(tmp_path) not in status["lastError"]
    assert 'anabranch_compaction_failed_total{cluster="standalone"} 1.0' in metrics


async def test_a_ledger_left_behind_by_a_crash_after_the_switch_is_deleted(
    tmp_path: Path,
) -> None:
    """A crash right after a switch leaves the previous generation's ledger: the next run
    after a reload deletes it."""

    async def compacted_ledgers(broker: InProcessBroker) -> list[str]:
        names = await broker.service.store.list_children("/managed-ledgers")
        return sorted(n.rsplit("__compacted-", 1)[1] for n in names if "__compacted-" in n)

    async def compact_once(broker: InProcessBroker, client: Client, value: bytes) -> None:
        producer = await client.create_producer(TOPIC)
        await producer.send(value, key="k")
        await producer.close()
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None
        run = broker.service.compactions.of(topic)
        await run.trigger()
        await run.wait()
        assert run.status == "SUCCESS"

    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        Client(broker.service_url) as client,
    ):
        await compact_once(broker, client, b"1")
        await compact_once(broker, client, b"2")
        # what a crash between the switch to generation 2 and deleting 1 leaves behind
        left = await broker.service.ledgers.open("public/default/persistent/failing/__compacted-1")
        await left.append(b"orphan")
        await left.close()
        assert await compacted_ledgers(broker) == ["1", "2"]
    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        Client(broker.service_url) as client,
    ):
        await compact_once(broker, client, b"3")
        remaining = await compacted_ledgers(broker)
    assert remaining == ["3"]

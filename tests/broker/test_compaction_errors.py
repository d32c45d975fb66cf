"""A compaction that fails reports ERROR with a reason that names no file path, counts a
failure in /metrics, and leaves the topic's previous compacted view in force."""

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

"""The official ``pulsar-client`` against a namespace backlog quota with the
``producer_exception`` policy: once the backlog is over the quota, creating a producer fails
with the client's ProducerBlockedQuotaExceededException, as against Pulsar."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pulsar

from anabranch.admin.client import AdminClient
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/official-quota"


def fill_backlog(url: str) -> None:
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        client.subscribe(TOPIC, "slow", initial_position=pulsar.InitialPosition.Earliest).close()
        producer = client.create_producer(TOPIC, batching_enabled=False)
        for _ in range(10):
            producer.send(b"x" * 1000)
        producer.close()
    finally:
        client.close()


def create_producer_error(url: str) -> str:
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        client.create_producer(TOPIC)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    finally:
        client.close()
    return "created"


async def test_official_client_is_refused_over_a_producer_exception_quota(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, backlog_quota_check_interval_s=3600) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin:
            await admin.set_backlog_quota(
                "public/default", limit_size=5_000, policy="producer_exception"
            )
            await asyncio.to_thread(fill_backlog, broker.service_url)
            await broker.service.sweeps.sweep_backlog_quotas()
            answer = await asyncio.to_thread(create_producer_error, broker.service_url)
    assert "ProducerBlockedQuotaExceeded" in answer, answer

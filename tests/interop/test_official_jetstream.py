"""A standalone broker with ``storage = "jetstream"`` serves the official pulsar-client:
produce, consume with acks, restart, and the history (and the subscription's position)
is still there — every ledger byte lives in a real 3-node NATS JetStream cluster (R3).

The client has its own threads, so client work runs in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pulsar
import pytest

from anabranch.storage.jetstream_ledger import JetStreamManagedLedgerFactory
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.nats import NatsCluster

TOPIC = "persistent://public/default/on-jetstream"
RECEIVE_MS = 5000


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    cluster = NatsCluster.start(tmp_path_factory.mktemp("nats"), nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()


def _client(url: str) -> pulsar.Client:
    # The client's own C++ logger: a Python logger is called from the client's threads,
    # which can crash the interpreter when they log while an event loop is torn down.
    logger = pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn)
    return pulsar.Client(url, operation_timeout_seconds=15, logger=logger)


def _produce_and_consume_half(url: str) -> tuple[list[bytes], list[bytes]]:
    client = _client(url)
    try:
        consumer = client.subscribe(TOPIC, "sub")
        producer = client.create_producer(TOPIC, batching_enabled=False)
        sent = [b"m%d" % i for i in range(50)]
        for data in sent:
            producer.send(data)
        producer.close()
        got = []
        for _ in range(25):
            msg = consumer.receive(RECEIVE_MS)
            got.append(msg.data())
            consumer.acknowledge(msg)
        consumer.close()
        return sent, got
    finally:
        client.close()


def _after_restart(url: str) -> tuple[list[bytes], list[bytes]]:
    client = _client(url)
    try:
        # The durable subscription resumes after what it acknowledged.
        consumer = client.subscribe(TOPIC, "sub")
        rest = []
        for _ in range(25):
            msg = consumer.receive(RECEIVE_MS)
            rest.append(msg.data())
            consumer.acknowledge(msg)
        # A reader from the start sees the whole history.
        reader = client.create_reader(TOPIC, pulsar.MessageId.earliest)
        history = []
        while reader.has_message_available():
            history.append(reader.read_next(RECEIVE_MS).data())
        return rest, history
    finally:
        client.close()


async def test_broker_on_jetstream_serves_history_across_restarts(
    tmp_path: Path, nats_cluster: NatsCluster
) -> None:
    options = {
        "metadata": "sqlite",
        "storage": "jetstream",
        "jetstream_urls": nats_cluster.urls,
        "jetstream_replicas": 3,
    }
    async with InProcessBroker(tmp_path, **options) as broker:  # type: ignore[arg-type]
        assert isinstance(broker.node and broker.node.ledgers, JetStreamManagedLedgerFactory)
        sent, first_half = await asyncio.to_thread(_produce_and_consume_half, broker.service_url)
    assert first_half == sent[:25]
    # No ledger file exists locally: the data is in JetStream only.
    assert not any((tmp_path / "ledgers").rglob("*.log"))
    async with InProcessBroker(tmp_path, **options) as broker:  # type: ignore[arg-type]
        rest, history = await asyncio.to_thread(_after_restart, broker.service_url)
    assert rest == sent[25:]
    assert history == sent

"""The official ``pulsar-client`` produces to and consumes from a topic whose name does not
fit a file name as it is (issue 15: it answered "File name too long: '/abs/path/...'")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pulsar

from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/" + "official-" + "n" * 241  # 250 characters


def produce_and_consume(url: str, topic: str) -> list[bytes]:
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(topic, "sub", initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic)
        for i in range(3):
            producer.send(f"m{i}".encode())
        got = []
        for _ in range(3):
            msg = consumer.receive(timeout_millis=10_000)
            consumer.acknowledge(msg)
            got.append(msg.data())
        return got
    finally:
        client.close()


async def test_official_client_long_topic_name(tmp_path: Path) -> None:
    assert len(TOPIC.rsplit("/", 1)[1]) == 250
    async with InProcessBroker(tmp_path) as broker:
        got = await asyncio.to_thread(produce_and_consume, broker.service_url, TOPIC)
    assert got == [b"m0", b"m1", b"m2"]

"""The official ``pulsar-client`` with message chunking (PIP-37): messages over the broker's
``max_message_size`` travel as chunks and arrive whole on Exclusive and Shared
subscriptions (a Shared subscription hands every chunk of a message to the consumer that got
its first one), with two producers interleaving their chunks, and across a broker restart."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pulsar

from anabranch.testing.broker import InProcessBroker
from anabranch.testing.ports import free_port

MAX_MESSAGE = 64 * 1024
"""The broker's max_message_size: the official client cuts chunks of this size."""


def big(tag: int) -> bytes:
    return bytes([tag]) * (5 * MAX_MESSAGE + 123)  # six chunks


def drain(consumers: list[pulsar.Consumer], count: int) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + 60
    while len(got) < count and time.monotonic() < deadline:
        for consumer in consumers:
            try:
                message = consumer.receive(timeout_millis=100)
            except pulsar.Timeout:
                continue
            got.append(message.data())
            consumer.acknowledge(message)
    return got


def chunked_roundtrip(
    url: str, topic: str, kind: pulsar.ConsumerType, consumers: int
) -> list[bytes]:
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        subs = [
            client.subscribe(topic, "s", consumer_type=kind, receiver_queue_size=4)
            for _ in range(consumers)
        ]
        producers = [
            client.create_producer(topic, chunking_enabled=True, batching_enabled=False)
            for _ in range(2)
        ]

        def send(producer: pulsar.Producer, tags: range) -> None:
            for tag in tags:
                producer.send(big(tag))

        threads = [
            threading.Thread(target=send, args=(p, range(i * 3, i * 3 + 3)))
            for i, p in enumerate(producers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return drain(subs, 6)
    finally:
        client.close()


async def test_chunked_messages_arrive_whole_on_exclusive_and_shared(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, max_message_size=MAX_MESSAGE) as broker:
        url = broker.service_url
        for kind, consumers in (
            (pulsar.ConsumerType.Exclusive, 1),
            (pulsar.ConsumerType.Shared, 2),
        ):
            topic = f"persistent://public/default/chunks-{kind}"
            got = await asyncio.to_thread(chunked_roundtrip, url, topic, kind, consumers)
            assert sorted(got) == sorted(big(tag) for tag in range(6)), kind
            stats = broker.service.loaded_topic(topic)
            assert stats is not None and stats.ledger.entry_count == 36  # 6 chunks each


def produce(url: str, topic: str, tags: range) -> None:
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        producer = client.create_producer(topic, chunking_enabled=True, batching_enabled=False)
        for tag in tags:
            producer.send(big(tag))
    finally:
        client.close()


def consume(url: str, topic: str, count: int) -> list[bytes]:
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        subs = [
            client.subscribe(topic, "restart", consumer_type=pulsar.ConsumerType.Shared,
                             initial_position=pulsar.InitialPosition.Earliest)
            for _ in range(2)
        ]  # fmt: skip
        return drain(subs, count)
    finally:
        client.close()


async def test_chunked_messages_survive_a_broker_restart(tmp_path: Path) -> None:
    topic = "persistent://public/default/chunks-restart"
    port = free_port("127.0.0.1")
    settings: dict[str, Any] = {"max_message_size": MAX_MESSAGE, "metadata": "sqlite", "port": port}
    async with InProcessBroker(tmp_path, **settings) as broker:
        await asyncio.to_thread(produce, broker.service_url, topic, range(2))
    async with InProcessBroker(tmp_path, **settings) as broker:
        await asyncio.to_thread(produce, broker.service_url, topic, range(2, 3))
        got = await asyncio.to_thread(consume, broker.service_url, topic, 3)
    assert sorted(got) == [big(0), big(1), big(2)]

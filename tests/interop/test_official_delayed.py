"""The official pulsar-client's delayed delivery (``deliver_after``) to Key_Shared and
Shared subscriptions: held by the broker until due (Key_Shared holds them since the
scalable topics' fan-out mode reuses its dispatch), each key's messages in order."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

import pulsar

from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/official-delayed"
DELAY_S = 0.8
RECEIVE_MS = 10_000


def produce_and_consume(url: str) -> dict[str, list[tuple[str, float]]]:
    """Per subscription type: (message, seconds after its send) in arrival order."""
    client = pulsar.Client(url, operation_timeout_seconds=15)
    try:
        consumers = {
            name: client.subscribe(TOPIC, name, consumer_type=kind)
            for name, kind in (
                ("ks", pulsar.ConsumerType.KeyShared),
                ("shared", pulsar.ConsumerType.Shared),
            )
        }
        producer = client.create_producer(TOPIC)
        sent_at = time.monotonic()
        producer.send(b"k:0", partition_key="k", deliver_after=timedelta(seconds=DELAY_S))
        producer.send(b"k:1", partition_key="k", deliver_after=timedelta(seconds=DELAY_S))
        producer.send(b"now", partition_key="other")
        out: dict[str, list[tuple[str, float]]] = {}
        for name, consumer in consumers.items():
            got = []
            for _ in range(3):
                msg = consumer.receive(timeout_millis=RECEIVE_MS)
                got.append((msg.data().decode(), time.monotonic() - sent_at))
                consumer.acknowledge(msg)
            out[name] = got
        return out
    finally:
        client.close()


async def test_official_client_delayed_messages_wait_until_due(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        got = await asyncio.to_thread(produce_and_consume, broker.service_url)
    for name, arrivals in got.items():
        assert [m for m, _ in arrivals] == ["now", "k:0", "k:1"], name
        for message, after in arrivals:
            if message != "now":
                assert after >= DELAY_S * 0.75, (name, message, after)  # clock slack

"""Helpers driving the official ``pulsar-client`` (run them in ``asyncio.to_thread``)."""

from __future__ import annotations

from typing import Any

import pulsar


def round_trip(url: str, topic: str, count: int = 5, **client_options: Any) -> list[bytes]:
    """Produce ``count`` messages and consume them back with the official client."""
    client = pulsar.Client(url, operation_timeout_seconds=30, **client_options)
    try:
        consumer = client.subscribe(topic, "sub", initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic)
        for i in range(count):
            producer.send(f"m-{i}".encode())
        out = []
        for _ in range(count):
            msg = consumer.receive(timeout_millis=30_000)
            out.append(msg.data())
            consumer.acknowledge(msg)
        return out
    finally:
        client.close()


def refusal(url: str, topic: str, **client_options: Any) -> str:
    """The name of the exception creating a producer raises (``"none"`` if it works)."""
    client = pulsar.Client(url, operation_timeout_seconds=30, **client_options)
    try:
        client.create_producer(topic)
        return "none"
    except Exception as err:
        return type(err).__name__
    finally:
        client.close()

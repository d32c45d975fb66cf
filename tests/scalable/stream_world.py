"""A real in-process broker, its admin and a client, with a keyed producer that records
what it sent: the setting of the stream consumer end-to-end tests.

Values are ``key:seq`` (``-:seq`` for an unkeyed message), ``seq`` counting per key, so
:func:`parse` gives back ``(key, seq)`` and :meth:`World.expected` what every key must
show, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from anabranch.admin.client import AdminClient
from anabranch.aio import Client, Message
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.stream_consumer import StreamConsumer
from anabranch.testing.broker import InProcessBroker

KEYS = [f"key-{i}" for i in range(16)]


@dataclass
class World:
    broker: InProcessBroker | None
    admin: AdminClient
    client: Client
    sent: dict[str | None, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def node(self) -> InProcessBroker:
        """The in-process broker (the crash test runs a process instead)."""
        assert self.broker is not None
        return self.broker

    async def producer(self, topic: str, *, batching: bool = True) -> ScalableProducer:
        """With ``batching=False`` every message is an entry of its own, so a small
        receiver queue leaves most of a segment on the broker."""
        producer = await self.client.create_producer(topic, batch_delay_s=0.002, batching=batching)
        assert isinstance(producer, ScalableProducer)
        return producer

    async def stream(self, topic: str, name: str, sub: str = "billing") -> StreamConsumer:
        return await self.client.subscribe_stream(topic, sub, consumer_name=name)

    async def produce(self, producer: ScalableProducer, count: int, *, keyed: bool = True) -> None:
        futures = []
        for i in range(count):
            key = KEYS[i % len(KEYS)] if keyed else None
            value = f"{key or '-'}:{self.sent[key]}".encode()
            futures.append(await producer.send_async(value, key=key))
            self.sent[key] += 1
        await asyncio.gather(*futures)

    def expected(self) -> dict[str | None, list[int]]:
        return {k: list(range(n)) for k, n in self.sent.items() if n}


@contextlib.asynccontextmanager
async def world_with(tmp_path: Path, grace_s: float = 30.0) -> AsyncIterator[World]:
    async with InProcessBroker(
        tmp_path, ledgers="memory", consumer_grace_period_s=grace_s
    ) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            yield World(broker, admin, client)


def parse(msg: Message) -> tuple[str | None, int]:
    """``(key, seq)`` of a value :meth:`World.produce` sent (checking the message's key)."""
    key, seq = msg.value.decode().split(":")
    assert (None if key == "-" else key) == msg.key
    return msg.key, int(seq)

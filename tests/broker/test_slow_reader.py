"""A consumer connection that sends FLOW and stops reading: the broker stops dispatching
to it once its socket's output buffer is over the high-water mark, instead of queueing
the whole backlog in memory once per subscription, and delivers the rest once it reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from anabranch import limits
from anabranch.aio import Client
from anabranch.broker.session import Session
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_core_protocol import RawClient

T = pb.BaseCommand
TOPIC = "persistent://public/default/slow-reader"
MESSAGES = 1000
PAYLOAD = 8 * 1024
SUBSCRIPTIONS = 3
HIGH_WATER = 256 * 1024


@pytest.fixture
async def broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[InProcessBroker]:
    # A small high-water mark, so a few hundred kilobytes show the bound.
    monkeypatch.setattr(limits, "SESSION_OUTPUT_BYTES_MAX", HIGH_WATER)
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        async with Client(b.service_url) as client:
            producer = await client.create_producer(TOPIC, batching=False)
            for i in range(MESSAGES):
                await producer.send_async(i.to_bytes(4, "big") + b"x" * PAYLOAD)
            await producer.flush()
        yield b


def consumer_sessions(broker: InProcessBroker) -> list[Session]:
    assert broker.node is not None
    return [s for s in broker.node.server.sessions if s.consumers]


async def test_a_connection_that_stops_reading_is_not_sent_the_whole_backlog(
    broker: InProcessBroker,
) -> None:
    client = await RawClient.open(broker.port)
    try:
        await client.handshake()
        for n in range(1, SUBSCRIPTIONS + 1):
            earliest = pb.CommandSubscribe.Earliest
            await client.send(
                commands.subscribe(
                    TOPIC, f"s{n}", pb.CommandSubscribe.Exclusive, n, n, initial_position=earliest
                )
            )
            await client.expect(T.SUCCESS)
        client.reader._transport.pause_reading()  # type: ignore[attr-defined]
        for n in range(1, SUBSCRIPTIONS + 1):
            await client.send(commands.flow(n, MESSAGES))
        [session] = consumer_sessions(broker)
        # Let the dispatchers run as long as they would need to send everything.
        for _ in range(50):
            await asyncio.sleep(0.02)
        consumers = list(session.consumers.values())
        sent = sum(c.messages_out for c in consumers)
        assert session.write_paused
        # At most what fills the socket buffers and the high-water mark, plus one pass
        # per subscription, not SUBSCRIPTIONS x MESSAGES.
        assert sent < SUBSCRIPTIONS * MESSAGES // 2, sent
        assert session.transport.get_write_buffer_size() < 8 * HIGH_WATER
        client.reader._transport.resume_reading()  # type: ignore[attr-defined]
        seen: dict[int, list[int]] = {n: [] for n in range(1, SUBSCRIPTIONS + 1)}
        while sum(len(v) for v in seen.values()) < SUBSCRIPTIONS * MESSAGES:
            frame = await client.recv()
            assert frame is not None
            if frame.type == T.MESSAGE:
                seen[frame.command.message.consumer_id].append(
                    int.from_bytes(frame.payload[:4], "big")
                )
        assert all(v == list(range(MESSAGES)) for v in seen.values())
    finally:
        await client.close()


async def test_a_reading_connection_gets_everything_past_the_mark(broker: InProcessBroker) -> None:
    """Dispatchers also stop on what one loop iteration queued (not yet in the socket);
    when the socket then takes it all, they are woken again, or a fast reader stalls."""
    async with Client(broker.service_url) as client:
        consumer = await client.subscribe(TOPIC, "fast", initial_position="earliest")
        got: list[int] = []
        for _ in range(MESSAGES):
            msg = await consumer.receive(timeout=30)
            assert msg is not None, f"stalled after {len(got)} messages"
            got.append(int.from_bytes(msg.value[:4], "big"))
        assert got == list(range(MESSAGES))

"""The broker-wide publish buffer (``broker/publish_buffer.py``): while the disk does not
answer, a producer's unanswered sends stop being read at the buffer's limit instead of
piling up in memory; connections without sends in flight are still served, and every
send completes once the disk answers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from anabranch.aio import Client
from anabranch.storage.api import Position
from anabranch.storage.memory import MemoryManagedLedger
from anabranch.testing.broker import InProcessBroker
from tests.scalable.conftest import eventually

LIMIT = 256 * 1024
MESSAGE = 64 * 1024
SENT = 40  # 2.5 MiB: ten times the limit


async def test_a_stalled_disk_pauses_publishers_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = asyncio.Event()
    append, append_many = MemoryManagedLedger.append, MemoryManagedLedger.append_many

    async def slow_append(self: MemoryManagedLedger, data: bytes) -> Position:
        await gate.wait()
        return await append(self, data)

    async def slow_append_many(
        self: MemoryManagedLedger, entries: Sequence[bytes]
    ) -> list[Position]:
        await gate.wait()
        return await append_many(self, entries)

    async with (
        InProcessBroker(
            tmp_path, ledgers="memory", max_message_publish_buffer_bytes=LIMIT
        ) as broker,
        Client(broker.service_url) as client,
    ):
        other = await client.create_producer("persistent://public/default/other")
        await other.send(b"before the stall")
        monkeypatch.setattr(MemoryManagedLedger, "append", slow_append)
        monkeypatch.setattr(MemoryManagedLedger, "append_many", slow_append_many)
        buffer = broker.service.publish_buffer
        producer = await client.create_producer(
            "persistent://public/default/stalled", batching=False, pending_messages_max=SENT
        )
        try:
            sends = [await producer.send_async(bytes(MESSAGE)) for _ in range(SENT)]
            await eventually(lambda: buffer.over, "the buffer goes over its limit")
            await asyncio.sleep(0.5)  # what the broker would still read, it reads now
            held, pauses = buffer.used, broker.service.counters.publish_buffer_pauses
            # A connection with nothing in flight is still read and answered.
            async with Client(broker.service_url) as second:
                reader = await second.subscribe(
                    "persistent://public/default/other", "s", initial_position="earliest"
                )
                message = await reader.receive()
        finally:
            gate.set()  # else the broker's stop would wait for the stalled appends
        await asyncio.gather(*sends)
        # One socket read and the frames already decoded past the limit, not the 2.5 MiB.
        assert LIMIT < held < 4 * LIMIT
        assert pauses == 1
        assert message is not None and message.value == b"before the stall"
    assert buffer.used == 0 and not buffer.over

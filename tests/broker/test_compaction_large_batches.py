"""A batch entry of many messages is folded into the compaction plan off the event loop
(a producer's batch of 100,000 tiny messages held the loop 0.3 s), with the same result."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from anabranch.aio import Client
from anabranch.broker import compaction
from anabranch.broker.compaction_messages import entry_messages
from anabranch.core.compaction import Message
from anabranch.storage.api import Entry
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/large-batches"


async def test_a_large_batch_is_folded_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop: list[tuple[int, bool]] = []

    def spy(entry: Entry, removed: bytes = b"") -> list[Message]:
        messages = entry_messages(entry, removed)
        on_loop.append((len(messages), threading.current_thread() is threading.main_thread()))
        return messages

    monkeypatch.setattr(compaction, "entry_messages", spy)
    big = compaction.INLINE_BATCH_MESSAGES_MAX + 500
    async with InProcessBroker(tmp_path) as broker, Client(broker.service_url) as client:
        producer = await client.create_producer(
            TOPIC,
            batch_messages_max=big,
            batch_bytes_max=2**20,
            pending_messages_max=2 * big,
            batch_delay_s=60.0,
        )
        sent = [await producer.send_async(b"v%d" % i, key=f"k{i % 10}") for i in range(big)]
        await producer.flush()
        await asyncio.gather(*sent)
        small = await producer.send_async(b"small", key="k0")  # parsed on the loop
        await producer.flush()
        await small
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None
        run = broker.service.compactions.of(topic)
        await run.trigger()
        await run.wait()
    assert run.status == "SUCCESS"
    assert sorted(on_loop) == [(1, True), (big, False)]
    # k1..k9 survive in the batch, k0 in the last message: everything else is removed.
    assert run.last_removed == big + 1 - 10

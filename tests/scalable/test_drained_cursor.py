"""A drained sealed parent's cursor is durable before its children are handed out.

The controller assigns a parent's children once ``segment_backlog`` of the parent answers
0. Cursors persist lazily (``cursor_persist_interval_ms``); if the 0 were answered from
memory alone, a failover of the parent's broker would reload the cursor from an older
saved position, and the parent's messages would be delivered again after the children's
(issue 19, item 4). So a 0 answer flushes the cursor first.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from anabranch.aio import Client
from anabranch.core.names import SegmentName
from anabranch.storage.cursor import ManagedCursor
from anabranch.storage.memory import MemoryManagedLedger, MemoryManagedLedgerFactory
from anabranch.testing.broker import InProcessBroker

SEGMENT = "segment://public/default/drained/0000-ffff-0"


async def test_a_zero_backlog_answer_persists_the_cursor(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        service = broker.service
        ops = service.scalable.ops
        segment = SegmentName.parse(SEGMENT)
        await ops.create_segment(segment, ["billing"])
        topic = await service.get_topic(SEGMENT, create=False)
        ledger = topic.ledger
        assert isinstance(ledger, MemoryManagedLedger)
        # Lazy persistence that never fires during the test: only a flush persists.
        ledger.config = dataclasses.replace(ledger.config, cursor_persist_interval_ms=3_600_000)
        factory = service.ledgers
        assert isinstance(factory, MemoryManagedLedgerFactory)

        def stored_cursor() -> bytes | None:
            return factory._stored[ledger.name].cursors.get("billing")

        async with Client(broker.service_url) as client:
            producer = await client.create_producer(SEGMENT)
            for i in range(3):
                await producer.send(f"m{i}".encode())
            consumer = await client.subscribe(SEGMENT, "billing")
            received = [await consumer.receive(timeout=5.0) for _ in range(3)]
            last = received[-1]
            assert last is not None and all(m is not None for m in received)
            await consumer.acknowledge_cumulative(last)
            cursor = next(c for c in ledger.cursors() if c.name == "billing")
            assert isinstance(cursor, ManagedCursor)
            for _ in range(500):
                if cursor.backlog() == 0:
                    break
                await asyncio.sleep(0.01)
            assert cursor.backlog() == 0
            before = stored_cursor()
            assert before != cursor.serialize(), "the ack was persisted already: no test"
            await ops.terminate_segment(segment)
            assert await ops.segment_backlog(segment, "billing") == 0
            assert stored_cursor() == cursor.serialize()

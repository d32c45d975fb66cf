"""A disk error fences the ledger and the topic reopens on a new one by itself (issue 15),
seen through the official ``pulsar-client`` against a real broker process.

The broker's ledger files go through the fault layer; for about a second every write and
fsync fails with EIO. The send that hits it gets SEND_ERROR(PersistenceError); the
official client closes its connection and resends (upstream's rule for that code), the
broker has unloaded the topic meanwhile, and the reload recovers the old ledger (fence,
scan, close) and opens a new one. The test keeps producing through the fault and after
it, without touching the broker: every send is acknowledged in the end, later ones in a
new ledger, and a consumer reads every acknowledged message.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pulsar
import pytest

from anabranch.testing.faults.standalone import FaultyBrokerProcess

pytestmark = pytest.mark.timeout(300)

TOPIC = "persistent://public/default/eio"
MESSAGES = 300


def produce(url: str, stop_at: int, fault: threading.Event) -> list[tuple[bytes, int]]:
    """Send ``stop_at`` messages one by one (``fault`` is set after the 50th); each
    acknowledged payload with its ledger id."""
    client = pulsar.Client(url, operation_timeout_seconds=10)
    try:
        producer = client.create_producer(TOPIC, send_timeout_millis=60_000)
        acked = []
        for i in range(stop_at):
            payload = f"m-{i}".encode()
            msg_id = producer.send(payload)
            acked.append((payload, msg_id.ledger_id()))
            if i == 50:
                fault.set()
        return acked
    finally:
        client.close()


def consume(url: str) -> list[bytes]:
    client = pulsar.Client(url, operation_timeout_seconds=10)
    try:
        reader = client.create_reader(TOPIC, pulsar.MessageId.earliest)
        values = []
        while reader.has_message_available():
            values.append(reader.read_next(timeout_millis=10_000).data())
        return values
    finally:
        client.close()


async def test_sends_go_on_through_a_disk_error_on_a_new_ledger(tmp_path: Path) -> None:
    broker = FaultyBrokerProcess(tmp_path / "data")
    await broker.start()
    try:
        fault = threading.Event()
        producing = asyncio.ensure_future(
            asyncio.to_thread(produce, broker.service_url, MESSAGES, fault)
        )
        await asyncio.to_thread(fault.wait)
        await broker.set_disk_errno("EIO")
        await asyncio.sleep(1.0)  # sends hit the error, the client reconnects and resends
        await broker.set_disk_errno(None)
        acked = await producing
        stored = await asyncio.to_thread(consume, broker.service_url)
        log = broker.log_path.read_text(errors="replace")
        fenced = {p.name for p in broker.data_dir.rglob("*.fenced")}
    finally:
        await broker.stop()
    assert len(acked) == MESSAGES  # every send was acknowledged in the end
    assert "Input/output error" in log  # the fault did hit an append
    first_ledger, last_ledger = acked[0][1], acked[-1][1]
    assert last_ledger > first_ledger  # the topic moved to a new ledger by itself
    assert f"{first_ledger:020d}.fenced" in fenced  # after fencing the failed one
    missing = {p for p, _ in acked} - set(stored)
    assert not missing, f"{len(missing)} acknowledged messages lost"

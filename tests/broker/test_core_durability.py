"""Every message the broker acknowledged survives a SIGKILL: produce with the official
client to a real broker process, kill it mid-stream, restart, read the ledger."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pulsar

from anabranch.broker.service import managed_ledger_name
from anabranch.broker.standalone import open_store
from anabranch.core.names import TopicName
from anabranch.storage.api import EARLIEST
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.testing.broker import BrokerProcess
from tests.interop.test_official_produce import messages_of

TOPIC = "persistent://public/default/durable"


def produce_until_killed(url: str, acked: list[bytes], enough: threading.Event) -> None:
    """Send forever (async, batched); record each acknowledged payload; stop on errors.
    ``enough`` is set after 2000 acknowledgements or when the stream ends."""
    client = pulsar.Client(url, operation_timeout_seconds=5)
    failed = threading.Event()
    try:
        producer = client.create_producer(
            TOPIC,
            batching_enabled=True,
            batching_max_publish_delay_ms=2,
            send_timeout_millis=3000,
            # Wait for room rather than fail a send with ProducerQueueIsFull when the broker
            # is slower than this loop (a busy machine): only the kill may end the stream.
            block_if_queue_full=True,
        )

        def on_sent(payload: bytes, result: pulsar.Result) -> None:
            if result == pulsar.Result.Ok:
                acked.append(payload)
                if len(acked) >= 2000:
                    enough.set()
            else:
                failed.set()

        i = 0
        while not failed.is_set() and i < 1_000_000:
            payload = f"m-{i}".encode()
            producer.send_async(payload, lambda r, _m, p=payload: on_sent(p, r))
            i += 1
            if i % 500 == 0:
                failed.wait(0.01)  # let the broker keep up a little
    finally:
        enough.set()  # a stream that failed early ends the wait too (the count is asserted)
        client.close()


async def test_acknowledged_messages_survive_sigkill(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = BrokerProcess(data)
    acked: list[bytes] = []
    enough = threading.Event()
    try:
        await proc.start()
        producer = asyncio.ensure_future(
            asyncio.to_thread(produce_until_killed, proc.service_url, acked, enough)
        )
        await asyncio.to_thread(enough.wait)
        proc.kill()  # mid-stream: sends are in flight
        await producer
        snapshot = list(acked)
        await proc.start()  # recovery on restart
        await proc.stop()
    finally:
        proc.kill()
    store = await open_store(f"sqlite:///{data.resolve() / 'metadata.db'}")
    try:
        factory = FileManagedLedgerFactory(data / "ledgers", store)
        ledger = await factory.open(managed_ledger_name(TopicName.parse(TOPIC)))
        stored = [m for e in await ledger.read(EARLIEST, 1_000_000) for m in messages_of(e.data)]
        await factory.close()
    finally:
        await store.close()
    assert len(snapshot) >= 2000
    missing = set(snapshot) - set(stored)
    assert not missing, f"{len(missing)} acknowledged messages lost"
    assert len(stored) == len(set(stored))  # nothing stored twice

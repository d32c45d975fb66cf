"""Broker restarts (same port and data, SQLite metadata) and the blocking facade."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import anabranch
from anabranch.aio import Client
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.ports import free_port

TOPIC = "persistent://public/default/restart"


async def test_reconnect_after_broker_restart_loses_no_acked_message(tmp_path: Path) -> None:
    port = free_port()

    def make() -> InProcessBroker:
        return InProcessBroker(tmp_path, metadata="sqlite", port=port)

    first = make()
    await first.__aenter__()
    async with Client(first.service_url, random=lambda: 0.0) as client:
        consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
        producer = await client.create_producer(TOPIC, batch_delay_s=0.005)
        before = [await producer.send(b"a%d" % i) for i in range(20)]
        await first.__aexit__(None, None, None)
        # Sends during the outage wait in the pending queue and are resent in order.
        during = [await producer.send_async(b"b%d" % i) for i in range(20)]
        async with make():
            after = [await f for f in during]
            assert before == sorted(before) and after == sorted(after) and before[-1] < after[0]
            received: list[bytes] = []
            while len(set(received)) < 40:
                msg = await consumer.receive(timeout=30)
                assert msg is not None, f"only got {sorted(set(received))}"
                received.append(msg.value)
                await consumer.acknowledge(msg)
            expected = {b"a%d" % i for i in range(20)} | {b"b%d" % i for i in range(20)}
            assert set(received) == expected
            firsts = list(dict.fromkeys(received))
            assert [v for v in firsts if v.startswith(b"b")] == [b"b%d" % i for i in range(20)]
            await client.close()


def test_sync_facade_end_to_end(tmp_path: Path) -> None:
    # The broker runs on its own loop thread; the sync client has its own portal thread.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = InProcessBroker(tmp_path)
    asyncio.run_coroutine_threadsafe(broker.__aenter__(), loop).result()
    try:
        with anabranch.Client(broker.service_url) as client:
            consumer = client.subscribe(TOPIC, "sync", initial_position="earliest")
            producer = client.create_producer(TOPIC)
            first = producer.send(b"one", key="k", properties={"p": "1"})
            future = producer.send_async(b"two")
            producer.flush()
            assert future.result(timeout=10) > first
            msg = consumer.receive(timeout=10)
            assert msg is not None and (msg.value, msg.key, msg.properties) == (
                b"one", "k", {"p": "1"},
            )  # fmt: skip
            consumer.acknowledge(msg)
            second = consumer.receive(timeout=10)
            assert second is not None and second.value == b"two"
            consumer.acknowledge_cumulative(second)
            assert consumer.receive(timeout=0.2) is None
            reader = client.create_reader(TOPIC, "earliest")
            assert reader.has_message_available()
            got = reader.read_next(timeout=10)
            assert got is not None and got.message_id == first
            reader.close()
        client.close()  # idempotent
    finally:
        asyncio.run_coroutine_threadsafe(broker.__aexit__(None, None, None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

"""Retention that deletes every ledger holding entries keeps the topic's last position.

Before, a trim that left only the empty open ledger reset the last confirmed position to
EARLIEST: GET_LAST_MESSAGE_ID answered (-1, -1), below ids already handed out. Upstream's
managed ledger answers (current ledger, -1) then: after every id handed out, before the
next one. That must hold for our client, the official client and after a restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pulsar

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.client.consumer import Consumer
from anabranch.testing.broker import InProcessBroker

NS = "public/default"
TOPIC = f"persistent://{NS}/trimmed-all"
PER_LEDGER = 5
RECEIVE_S = 10.0


def broker_at(data: Path) -> InProcessBroker:
    return InProcessBroker(
        data,
        metadata="sqlite",
        managed_ledger_max_entries_per_ledger=PER_LEDGER,
        retention_check_interval_s=3600.0,
    )


def pair(message_id: Any) -> tuple[int, int]:
    return (message_id.ledger_id, message_id.entry_id)


def official_view(url: str) -> tuple[tuple[int, int], bool]:
    """The official client's last message id and whether a reader from earliest sees more."""
    client = pulsar.Client(url, operation_timeout_seconds=15)
    try:
        consumer = client.subscribe(TOPIC, "official")
        last = consumer.get_last_message_id()
        reader = client.create_reader(TOPIC, pulsar.MessageId.earliest)
        return (last.ledger_id(), last.entry_id()), reader.has_message_available()
    finally:
        client.close()


async def test_the_last_position_survives_a_trim_of_every_ledger(tmp_path: Path) -> None:
    async with broker_at(tmp_path / "data") as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
            assert isinstance(consumer, Consumer)
            producer = await client.create_producer(TOPIC, batching=False)
            ids = [await producer.send(b"m%d" % i) for i in range(2 * PER_LEDGER)]
            last_sent = pair(ids[-1])
            for _ in ids:
                msg = await consumer.receive(timeout=RECEIVE_S)
                assert msg is not None
                await consumer.acknowledge(msg)
            await admin.set_retention(NS, 0, 0)
            # The ack reaches the cursor asynchronously: trim until nothing with entries is left.
            for _ in range(500):
                await broker.service.sweeps.sweep_retention()
                ledgers = (await admin.internal_stats(TOPIC))["ledgers"]
                if all(ledger["entries"] == 0 for ledger in ledgers):
                    break
                await asyncio.sleep(0.01)
            assert all(ledger["entries"] == 0 for ledger in ledgers), ledgers

            last = pair(await consumer.get_last_message_id())
            assert last >= last_sent
            assert last[1] == -1  # no entry left to point at
            assert not await (await client.create_reader(TOPIC, "earliest")).has_message_available()
            official_last, official_more = await asyncio.to_thread(
                official_view, broker.service_url
            )
            assert official_last == last
            assert not official_more
            await producer.close()
            await consumer.close()

    async with broker_at(tmp_path / "data") as broker, Client(broker.service_url) as client:
        consumer = await client.subscribe(TOPIC, "s")
        assert isinstance(consumer, Consumer)
        assert pair(await consumer.get_last_message_id()) >= last_sent
        producer = await client.create_producer(TOPIC, batching=False)
        after = pair(await producer.send(b"after"))
        assert after > last
        assert pair(await consumer.get_last_message_id()) == after
        msg = await consumer.receive(timeout=RECEIVE_S)
        assert msg is not None and msg.value == b"after"

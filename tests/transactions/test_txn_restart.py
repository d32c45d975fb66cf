"""Transactions across broker restarts and crashes (a real broker process, SQLite, files).

A restart replays no transaction log: the coordinator's state is the metadata store, and
each topic rebuilds its open/aborted transactions from its op records and aborted records
when it loads. After a clean stop or a SIGKILL — even one between a commit's header CAS
and its participants' apply (the ``txn-hold-outcomes`` failpoint holds every apply) —
every transaction is all-or-nothing on every participant.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from anabranch.aio import Client
from anabranch.failpoints import TXN_HOLD_OUTCOMES
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.broker import BrokerProcess
from tests.scalable.wire import RawClient

QUIET_S = 0.5
RESTART_GAP_S = 2.0
"""How long the broker stays down under a commit (longer than a few quick retries)."""
RECEIVE_S = 10.0
TOPICS = [f"persistent://public/default/restart-{i}" for i in range(3)]


async def drain(consumer: Any) -> list[bytes]:
    out: list[bytes] = []
    while (msg := await consumer.receive(timeout=QUIET_S)) is not None:
        out.append(msg.value)
    return out


async def take(consumer: Any, count: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(count):
        msg = await consumer.receive(timeout=RECEIVE_S)
        assert msg is not None, f"only {len(out)} of {count} messages arrived"
        out.append(msg)
    return out


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_restart_keeps_committed_filters_aborted_and_keeps_txn_acks(
    tmp_path: Path, how: str
) -> None:
    broker = BrokerProcess(tmp_path / "data")
    await broker.start()
    try:
        client = Client(broker.service_url)
        topic = TOPICS[0]
        producer = await client.create_producer(topic)
        committed = await client.new_transaction(timeout=60)
        for i in range(4):
            await producer.send(f"c{i}".encode(), txn=committed)
        await committed.commit()
        aborted = await client.new_transaction(timeout=60)
        for i in range(4):
            await producer.send(f"a{i}".encode(), txn=aborted)
        await aborted.abort()
        await producer.send(b"sentinel")
        consumer = await client.subscribe(topic, "s", initial_position="earliest")
        msgs = await take(consumer, 5)
        assert [m.value for m in msgs] == [b"c0", b"c1", b"c2", b"c3", b"sentinel"]
        acking = await client.new_transaction(timeout=60)
        await consumer.acknowledge_cumulative(msgs[1], txn=acking)
        await acking.commit()
        await client.close()

        if how == "kill":
            broker.kill()
            await broker.start()
        else:
            await broker.restart()

        client = Client(broker.service_url)
        consumer = await client.subscribe(topic, "s", initial_position="earliest")
        assert await drain(consumer) == [b"c2", b"c3", b"sentinel"]
        reader = await client.subscribe(topic, "fresh", initial_position="earliest")
        assert await drain(reader) == [b"c0", b"c1", b"c2", b"c3", b"sentinel"]
        await client.close()
    finally:
        await broker.stop()


@pytest.mark.parametrize("outcome", ["commit", "abort"])
async def test_sigkill_between_the_header_cas_and_the_apply(tmp_path: Path, outcome: str) -> None:
    broker = BrokerProcess(tmp_path / "data")
    broker.failpoints = TXN_HOLD_OUTCOMES
    await broker.start()
    try:
        client = Client(broker.service_url)
        producers = [await client.create_producer(t) for t in TOPICS]
        consumers = [await client.subscribe(t, "s", initial_position="earliest") for t in TOPICS]
        for producer in producers:
            await producer.send(b"first")
        for consumer in consumers:
            (first,) = await take(consumer, 1)
            assert first.value == b"first"
            await consumer.acknowledge(first)
        txn = await client.new_transaction(timeout=60)
        for producer in producers:
            for i in range(3):
                await producer.send(f"t{i}".encode(), txn=txn)
        for producer in producers:
            await producer.send(b"sentinel")
        if outcome == "commit":
            await txn.commit()  # the header says COMMITTED; no participant applied it
        else:
            await txn.abort()
        for consumer in consumers:
            assert await drain(consumer) == []  # still pinned: the outcome is held
        await client.close()
        broker.kill()
        broker.failpoints = ""
        await broker.start()
        client = Client(broker.service_url)
        expected = [b"t0", b"t1", b"t2", b"sentinel"] if outcome == "commit" else [b"sentinel"]
        for t in TOPICS:
            consumer = await client.subscribe(t, "s", initial_position="earliest")
            assert await drain(consumer) == expected, t
        await client.close()
    finally:
        await broker.stop()


@pytest.mark.parametrize("outcome", ["commit", "abort"])
async def test_an_open_transaction_survives_a_crash_and_ends_after_it(
    tmp_path: Path, outcome: str
) -> None:
    broker = BrokerProcess(tmp_path / "data")
    await broker.start()
    try:
        client = Client(broker.service_url)
        producers = [await client.create_producer(t) for t in TOPICS]
        txn = await client.new_transaction(timeout=120)
        for producer in producers:
            await producer.send(b"in-txn", txn=txn)
            await producer.send(b"after")
        txn_id = txn.id
        await client.close()
        broker.kill()
        await broker.start()
        client = Client(broker.service_url)
        consumers = [await client.subscribe(t, "s", initial_position="earliest") for t in TOPICS]
        for consumer in consumers:
            assert await drain(consumer) == []  # recovered OPEN: pinned at its first entry
        # The transaction lives in the metadata store, not in the dead connection.
        raw = await RawClient.connect(broker.port)
        action = pb.COMMIT if outcome == "commit" else pb.ABORT
        body = pb.CommandEndTxn(
            request_id=1,
            txnid_most_bits=txn_id[0],
            txnid_least_bits=txn_id[1],
            txn_action=action,
        )
        await raw.send(pb.BaseCommand(type=pb.BaseCommand.END_TXN, endTxn=body))
        reply = await raw.next(lambda f: f.type == pb.BaseCommand.END_TXN_RESPONSE)
        assert not reply.command.endTxnResponse.HasField("error")
        await raw.close()
        expected = [b"in-txn", b"after"] if outcome == "commit" else [b"after"]
        for consumer in consumers:
            assert [m.value for m in await take(consumer, len(expected))] == expected
        await client.close()
    finally:
        await broker.stop()


async def test_a_commit_rides_out_a_broker_restart(tmp_path: Path) -> None:
    # The coordinator's broker is down when the application commits and comes back a few
    # seconds later: the client keeps resending END_TXN within its operation timeout
    # (not a fixed few attempts, which a restart outlasts) and the commit lands.
    broker = BrokerProcess(tmp_path / "data")
    await broker.start()
    try:
        client = Client(broker.service_url)
        producers = [await client.create_producer(t) for t in TOPICS]
        txn = await client.new_transaction(timeout=120)
        for producer in producers:
            await producer.send(b"in-txn", txn=txn)
        broker.kill()
        committing = asyncio.ensure_future(txn.commit())
        await asyncio.sleep(RESTART_GAP_S)
        assert not committing.done()  # still trying, not failed
        await broker.start()
        await committing
        assert str(txn.state).endswith("COMMITTED")
        for topic in TOPICS:
            consumer = await client.subscribe(topic, "s", initial_position="earliest")
            assert [m.value for m in await take(consumer, 1)] == [b"in-txn"]
        await client.close()
    finally:
        await broker.stop()

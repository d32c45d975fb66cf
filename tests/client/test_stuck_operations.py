"""Operations stuck on a broker that keeps TCP open but answers nothing (paused): the
client probes, leaves a broker that does not answer, and stays with one that does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from anabranch.aio import Client, Producer
from anabranch.client.connection import ConnectionPool
from anabranch.client.errors import BrokerUnresponsive
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from tests.client.fake_broker import FakeBroker

T = pb.BaseCommand
TOPIC = "persistent://public/default/stuck"
STUCK_S = 0.2
PROBE_S = 0.2
DEADLINE_S = 10.0
"""Generous bound on what takes about STUCK_S + PROBE_S (the keepalive would take 60 s)."""


@pytest.fixture
async def pair() -> AsyncIterator[tuple[FakeBroker, FakeBroker]]:
    """Two fake brokers; each answers lookups with itself."""
    first, second = await FakeBroker().start(), await FakeBroker().start()
    yield first, second
    first.paused = second.paused = False
    await first.stop()
    await second.stop()


def client_of(*brokers: FakeBroker) -> Client:
    url = "pulsar://" + ",".join(f"127.0.0.1:{b.port}" for b in brokers)
    return Client(url, operation_stuck_s=STUCK_S, probe_timeout_s=PROBE_S, random=lambda: 0.0)


async def test_sends_stuck_on_a_paused_broker_move_and_keep_their_sequence_ids(
    pair: tuple[FakeBroker, FakeBroker],
) -> None:
    paused, other = pair
    async with client_of(paused, other) as client:
        producer = await client.create_producer(TOPIC, batching=False, producer_name="p1")
        assert isinstance(producer, Producer)
        await producer.send(b"before")
        paused.paused = True
        futures = [await producer.send_async(b"m%d" % i) for i in range(3)]
        ids = await asyncio.wait_for(asyncio.gather(*futures), DEADLINE_S)
    assert all(i.entry_id >= 0 for i in ids)
    # The paused broker got the SENDs and never answered; the other one got them again,
    # under the same producer name and sequence ids, so its dedup would drop a repeat.
    stuck = [f.command.send.sequence_id for f in paused.of_type(T.SEND)]
    moved = [f.command.send.sequence_id for f in other.of_type(T.SEND)]
    assert stuck == [0, 1, 2, 3] and moved == [1, 2, 3]
    assert [f.command.producer.producer_name for f in other.of_type(T.PRODUCER)] == ["p1"]
    assert [f.metadata.producer_name for f in other.of_type(T.SEND) if f.metadata] == ["p1"] * 3
    # It was told so by a probe: a PING it did not answer.
    assert paused.of_type(T.PING)


async def test_a_slow_broker_that_answers_pings_keeps_its_producer(fake: FakeBroker) -> None:
    fake.answer_sends = False
    async with client_of(fake) as client:
        producer = await client.create_producer(TOPIC, batching=False)
        future = await producer.send_async(b"slow")
        await asyncio.wait_for(fake.wait_for(T.PING, 2), DEADLINE_S)  # probed twice, answered
        assert not future.done()
        assert len(fake.of_type(T.PRODUCER)) == 1 and len(fake.of_type(T.CONNECT)) == 1
        fake.answer_sends = True
        await fake.drop_connections()  # the broker closes: the resend is answered
        assert (await asyncio.wait_for(future, DEADLINE_S)).entry_id >= 0


async def test_a_lookup_at_a_paused_broker_fails_fast_then_goes_elsewhere(
    pair: tuple[FakeBroker, FakeBroker],
) -> None:
    paused, other = pair
    pool = ConnectionPool(
        f"pulsar://127.0.0.1:{paused.port},127.0.0.1:{other.port}",
        operation_stuck_s=STUCK_S,
        probe_timeout_s=PROBE_S,
    )
    try:
        assert await pool.lookup(TOPIC) == ("127.0.0.1", paused.port)
        paused.paused = True
        with pytest.raises(BrokerUnresponsive):
            await asyncio.wait_for(pool.lookup(TOPIC), DEADLINE_S)
        assert pool.unresponsive(("127.0.0.1", paused.port))
        assert await asyncio.wait_for(pool.lookup(TOPIC), DEADLINE_S) == ("127.0.0.1", other.port)
        # A new connection to it must answer within the probe timeout...
        with pytest.raises(BrokerUnresponsive):
            await asyncio.wait_for(pool.get(("127.0.0.1", paused.port)), DEADLINE_S)
        # ...and once it does, it is trusted again.
        paused.paused = False
        conn = await pool.get(("127.0.0.1", paused.port))
        assert conn.is_open and not pool.unresponsive(("127.0.0.1", paused.port))
    finally:
        await pool.close()


async def test_a_broker_silent_from_the_start_fails_the_handshake_fast(fake: FakeBroker) -> None:
    fake.paused = True
    pool = ConnectionPool(fake.url, operation_stuck_s=STUCK_S, probe_timeout_s=PROBE_S)
    try:
        with pytest.raises(BrokerUnresponsive):
            await asyncio.wait_for(pool.get(), DEADLINE_S)
        assert pool.unresponsive(("127.0.0.1", fake.port))
    finally:
        await pool.close()

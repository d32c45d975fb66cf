"""Our client's regex subscriptions against the in-process broker: existing topics, topics
created and deleted later (the topic-list watcher, and polling with the hash), acks routed
to the right topic, the blocking facade."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from anabranch.aio import Client
from anabranch.client.pattern_consumer import PatternConsumer, pattern_namespace
from anabranch.client.sync import Client as SyncClient
from anabranch.errors import InvalidArgument
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.ports import free_port

P = "persistent://public/default"
ORDERS = re.compile(f"{P}/orders-.*")


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


@pytest.fixture
async def client(broker: InProcessBroker) -> AsyncIterator[Client]:
    async with Client(broker.service_url) as c:
        yield c


async def eventually(check: Callable[[], bool], what: str) -> None:
    for _ in range(300):  # hang guard (~6 s); the watcher answers in milliseconds
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


async def send(client: Client, topic: str, *values: bytes) -> None:
    producer = await client.create_producer(topic)
    for value in values:
        await producer.send(value)
    await producer.close()


async def receive_all(consumer: PatternConsumer, count: int) -> dict[str, list[bytes]]:
    got: dict[str, list[bytes]] = {}
    for _ in range(count):
        msg = await consumer.receive(timeout=10)
        assert msg is not None, f"only {got} arrived"
        got.setdefault(msg.topic, []).append(msg.value)
        await consumer.acknowledge(msg)
    return got


async def test_the_watcher_picks_up_new_topics_and_drops_deleted_ones(
    broker: InProcessBroker, client: Client
) -> None:
    await send(client, f"{P}/orders-1", b"a")
    await send(client, f"{P}/audit", b"x")
    consumer = await client.subscribe(
        ORDERS, "billing", initial_position="earliest", pattern_auto_discovery_period_s=3600
    )
    assert isinstance(consumer, PatternConsumer)
    assert consumer.topics == [f"{P}/orders-1"]
    assert await receive_all(consumer, 1) == {f"{P}/orders-1": [b"a"]}

    # Created after the subscription: pushed by the watcher (polling is an hour away).
    await send(client, f"{P}/orders-2", b"b", b"c")
    await eventually(lambda: f"{P}/orders-2" in consumer.topics, "orders-2 subscribed")
    assert await receive_all(consumer, 2) == {f"{P}/orders-2": [b"b", b"c"]}
    assert f"{P}/audit" not in consumer.topics

    await broker.service.delete_topic(f"{P}/orders-1")
    await eventually(lambda: consumer.topics == [f"{P}/orders-2"], "orders-1 dropped")
    # The dropped topic's consumer did not re-create it.
    assert not await broker.service.policies.topic_exists(f"{P}/orders-1")
    # Acks went to the right topics: nothing comes again.
    assert await consumer.receive(timeout=0.3) is None
    await consumer.close()
    sub = await broker.service.get_topic(f"{P}/orders-2", create=False)
    assert sub is not None


async def test_polling_with_the_hash_when_no_watcher_is_used(
    broker: InProcessBroker, client: Client
) -> None:
    consumer = await client.subscribe(
        re.compile("public/default/orders-.*"),  # no domain: persistent://
        "poll",
        initial_position="earliest",
        regex_subscription_mode="all",  # watchers cover persistent-only subscriptions
        pattern_auto_discovery_period_s=0.2,
    )
    assert consumer.topics == [] and consumer._watch_conn is None
    await send(client, f"{P}/orders-9", b"z")
    await eventually(lambda: consumer.topics == [f"{P}/orders-9"], "orders-9 by polling")
    assert await receive_all(consumer, 1) == {f"{P}/orders-9": [b"z"]}
    hash_before = consumer._hash
    await asyncio.sleep(0.5)  # a few unchanged polls: the hash stays, nothing moves
    assert consumer._hash == hash_before and consumer.topics == [f"{P}/orders-9"]
    await broker.service.delete_topic(f"{P}/orders-9")
    await eventually(lambda: consumer.topics == [], "orders-9 dropped by polling")
    await consumer.close()


async def test_partitioned_topics_and_bad_arguments(
    client: Client, broker: InProcessBroker
) -> None:
    await broker.service.policies.create_partitioned_topic(f"{P}/orders-p", 2)
    await send(client, f"{P}/orders-p", b"1", b"2", b"3", b"4")
    consumer = await client.subscribe(ORDERS, "parts", initial_position="earliest")
    assert consumer.topics == [f"{P}/orders-p-partition-0", f"{P}/orders-p-partition-1"]
    got = await receive_all(consumer, 4)
    assert sorted(v for values in got.values() for v in values) == [b"1", b"2", b"3", b"4"]
    msg_ids = {m for m in got}  # both partitions delivered
    assert len(msg_ids) == 2
    with pytest.raises(InvalidArgument):
        await client.subscribe(re.compile("orders-.*"), "s")  # names no namespace
    with pytest.raises(InvalidArgument):
        await client.subscribe(ORDERS, "s", regex_subscription_mode="sometimes")
    assert str(pattern_namespace("persistent://acme/ns/x")) == "acme/ns"
    await consumer.close()


def test_the_blocking_client_subscribes_to_a_pattern(tmp_path: Path) -> None:
    # The broker runs on its own loop thread; the sync client has its own portal thread.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = InProcessBroker(tmp_path, ledgers="memory")
    asyncio.run_coroutine_threadsafe(broker.__aenter__(), loop).result()
    try:
        with SyncClient(broker.service_url) as client:
            producer = client.create_producer(f"{P}/orders-s")
            producer.send(b"s")
            consumer = client.subscribe(ORDERS, "sync", initial_position="earliest")
            msg = consumer.receive(timeout=10)
            assert msg is not None and (msg.value, msg.topic) == (b"s", f"{P}/orders-s")
            consumer.acknowledge(msg)
            assert consumer.receive(timeout=0.2) is None
            consumer.close()
    finally:
        asyncio.run_coroutine_threadsafe(broker.__aexit__(None, None, None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def test_the_watcher_is_recreated_after_a_broker_restart(tmp_path: Path) -> None:
    port = free_port()

    def broker() -> InProcessBroker:
        return InProcessBroker(tmp_path, metadata="sqlite", port=port)

    async with Client(f"pulsar://127.0.0.1:{port}") as client:
        async with broker():
            await send(client, f"{P}/orders-a", b"a")
            consumer = await client.subscribe(
                ORDERS, "restart", initial_position="earliest", pattern_auto_discovery_period_s=3600
            )
            assert await receive_all(consumer, 1) == {f"{P}/orders-a": [b"a"]}
        async with broker(), Client(f"pulsar://127.0.0.1:{port}") as other:
            # Created while the client reconnects: the re-created watcher's list has it.
            await send(other, f"{P}/orders-b", b"b")
            await eventually(lambda: f"{P}/orders-b" in consumer.topics, "orders-b after restart")
            got: dict[str, list[bytes]] = {}
            while f"{P}/orders-b" not in got:  # an ack the restart lost redelivers "a" first
                got.update(await receive_all(consumer, 1))
            assert got[f"{P}/orders-b"] == [b"b"] and set(got) <= {f"{P}/orders-a", f"{P}/orders-b"}
            await consumer.close()

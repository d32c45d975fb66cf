"""Non-persistent topics with the official pulsar-client (C++ core) and with ours.

As Pulsar documents them: messages go to the consumers connected now and are then
forgotten (a later subscriber gets none of them, nothing is redelivered), every
subscription type dispatches as its type says, a consumer that does not keep up loses
messages and the topic's stats count them, a broker restart loses everything and leaves
no file behind, and transactions refuse the topic.

The broker runs on the test's event loop; the official client has its own threads, so
its calls run in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pulsar
import pytest
from typer.testing import CliRunner

from anabranch import limits
from anabranch.aio import Client
from anabranch.broker.dispatcher_entries import hash_slot
from anabranch.cli.main import app
from anabranch.errors import AnabranchError
from anabranch.testing.broker import BrokerProcess, InProcessBroker

R = TypeVar("R")
RECEIVE_MS = 5000
READY_S = 10.0
"""Hang guard: how long a consumer may take to be attached with permits."""


def np(name: str) -> str:
    return f"non-persistent://public/default/{name}"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


@asynccontextmanager
async def client(url: str) -> AsyncIterator[pulsar.Client]:
    """An official client, closed off the event loop (the broker runs on it)."""
    # The client's own C++ logger: a Python logger is called from the client's threads,
    # which can crash the interpreter when they log while an event loop is torn down.
    logger = pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn)
    c = await run(lambda: pulsar.Client(url, operation_timeout_seconds=15, logger=logger))
    try:
        yield c
    finally:
        await run(c.close)


async def run(fn: Callable[[], R]) -> R:
    return await asyncio.to_thread(fn)


def drain(consumer: pulsar.Consumer, timeout_ms: int = 500) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(consumer.receive(timeout_ms).data())
        except pulsar.Timeout:
            return out


def http(url: str, method: str = "GET") -> tuple[int, bytes]:
    """``(status, body)`` of one request (made off the event loop: the broker is on it)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


async def get_json(url: str) -> Any:
    status, body = await run(lambda: http(url))
    assert status == 200, (url, status, body)
    return json.loads(body)


async def stats(b: InProcessBroker, topic: str) -> dict[str, Any]:
    local = topic.removeprefix("non-persistent://")
    return dict(await get_json(f"{b.http_url}/admin/v2/non-persistent/{local}/stats"))


async def ready(b: InProcessBroker, topic: str, subscription: str, consumers: int) -> None:
    """Wait until ``consumers`` consumers of ``subscription`` are attached with permits (the
    client's FLOW follows its SUBSCRIBE): messages published before would be dropped."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_S
    while True:
        np_topic = b.service.loaded_non_persistent_topic(topic)
        sub = np_topic.subscriptions.get(subscription) if np_topic is not None else None
        attached = sub.consumers if sub is not None else []
        if len(attached) == consumers and all(c.permits > 0 for c in attached):
            return
        assert loop.time() < deadline, f"{subscription}: consumers never got ready"
        await asyncio.sleep(0.02)


async def test_live_delivery_only_later_subscribers_get_none_no_redelivery(
    broker: InProcessBroker,
) -> None:
    topic = np("live")
    async with client(broker.service_url) as c:
        early = await run(lambda: c.subscribe(
            topic, "early", negative_ack_redelivery_delay_ms=100))  # fmt: skip
        producer = await run(lambda: c.create_producer(topic, batching_enabled=False))
        await ready(broker, topic, "early", 1)
        ids = await run(lambda: [producer.send(b"a%d" % i) for i in range(10)])
        got = await run(lambda: [early.receive(RECEIVE_MS) for _ in range(10)])
        assert [m.data() for m in got] == [b"a%d" % i for i in range(10)]
        entries = [i.entry_id() for i in ids]
        assert entries == sorted(entries) and len(set(entries)) == 10
        assert [m.message_id().entry_id() for m in got] == entries
        # A subscription made afterwards gets none of what was sent before, even from
        # "earliest": nothing was kept.
        late = await run(lambda: c.subscribe(
            topic, "late", initial_position=pulsar.InitialPosition.Earliest))  # fmt: skip
        await ready(broker, topic, "late", 1)
        assert await run(lambda: drain(late, 300)) == []
        await run(lambda: [producer.send(b"b%d" % i) for i in range(3)])
        assert await run(lambda: [late.receive(RECEIVE_MS).data() for _ in range(3)]) == [
            b"b0", b"b1", b"b2"]  # fmt: skip
        # Acks are accepted, nacks and a resubscription bring nothing back.
        first = await run(lambda: early.receive(RECEIVE_MS))
        await run(lambda: early.acknowledge(first))
        others = await run(lambda: [early.receive(RECEIVE_MS) for _ in range(2)])
        await run(lambda: [early.negative_acknowledge(m) for m in others])
        assert await run(lambda: drain(early, 600)) == []
        await run(early.close)
        again = await run(lambda: c.subscribe(topic, "early"))
        await ready(broker, topic, "early", 1)
        assert await run(lambda: drain(again, 300)) == []
        assert (await stats(broker, topic))["subscriptions"]["early"]["msgBacklog"] == 0


async def test_shared_consumers_split_the_stream(broker: InProcessBroker) -> None:
    topic = np("shared")

    def subscribe(c: pulsar.Client) -> pulsar.Consumer:
        return c.subscribe(topic, "sh", consumer_type=pulsar.ConsumerType.Shared)

    async with client(broker.service_url) as c:
        a, b = await run(lambda: subscribe(c)), await run(lambda: subscribe(c))
        producer = await run(lambda: c.create_producer(topic, batching_enabled=False))
        await ready(broker, topic, "sh", 2)
        sent = [b"m%d" % i for i in range(40)]
        await run(lambda: [producer.send(m) for m in sent])
        got_a, got_b = await run(lambda: drain(a)), await run(lambda: drain(b))
    assert got_a and got_b
    assert sorted(got_a + got_b) == sorted(sent)  # each message once, none lost


async def test_failover_active_consumer_gets_everything_then_the_next(
    broker: InProcessBroker,
) -> None:
    topic = np("failover")
    kind = pulsar.ConsumerType.Failover
    async with client(broker.service_url) as c:
        a = await run(lambda: c.subscribe(topic, "fo", consumer_type=kind, consumer_name="a"))
        b = await run(lambda: c.subscribe(topic, "fo", consumer_type=kind, consumer_name="b"))
        producer = await run(lambda: c.create_producer(topic, batching_enabled=False))
        await ready(broker, topic, "fo", 2)
        await run(lambda: [producer.send(b"x%d" % i) for i in range(10)])
        got = {"a": await run(lambda: drain(a)), "b": await run(lambda: drain(b))}
        active = "a" if got["a"] else "b"
        assert got[active] == [b"x%d" % i for i in range(10)]
        assert got["b" if active == "a" else "a"] == []
        standby = b if active == "a" else a
        await run((a if active == "a" else b).close)
        await ready(broker, topic, "fo", 1)
        await run(lambda: [producer.send(b"y%d" % i) for i in range(5)])
        assert await run(lambda: drain(standby)) == [b"y%d" % i for i in range(5)]


async def test_key_shared_keeps_each_key_on_one_consumer(broker: InProcessBroker) -> None:
    topic = np("keyed")
    # Keys on both halves of the hash range, so both auto-split consumers get some.
    low = [k for k in (f"k{i}" for i in range(200)) if hash_slot(k.encode()) < 32768][:5]
    high = [k for k in (f"k{i}" for i in range(200)) if hash_slot(k.encode()) >= 32768][:5]
    keys = low + high
    kind = pulsar.ConsumerType.KeyShared
    async with client(broker.service_url) as c:
        a = await run(lambda: c.subscribe(topic, "ks", consumer_type=kind))
        b = await run(lambda: c.subscribe(topic, "ks", consumer_type=kind))
        producer = await run(lambda: c.create_producer(topic, batching_enabled=False))
        await ready(broker, topic, "ks", 2)

        def send_all() -> None:
            for i in range(60):
                key = keys[i % len(keys)]
                producer.send(f"{key}:{i}".encode(), partition_key=key)

        await run(send_all)
        got_a, got_b = await run(lambda: drain(a)), await run(lambda: drain(b))
    keys_a = {m.split(b":")[0] for m in got_a}
    keys_b = {m.split(b":")[0] for m in got_b}
    assert keys_a and keys_b and not keys_a & keys_b  # a key goes to one consumer only
    assert len(got_a) + len(got_b) == 60
    for got in (got_a, got_b):  # and in order
        for key in {m.split(b":")[0] for m in got}:
            seq = [int(m.split(b":")[1]) for m in got if m.split(b":")[0] == key]
            assert seq == sorted(seq)


async def test_a_slow_consumer_loses_messages_counted_in_stats(broker: InProcessBroker) -> None:
    topic = np("slow")
    async with client(broker.service_url) as c:
        fast = await run(lambda: c.subscribe(topic, "fast"))
        slow = await run(lambda: c.subscribe(topic, "slow", receiver_queue_size=1))
        producer = await run(lambda: c.create_producer(topic, batching_enabled=False))
        await ready(broker, topic, "fast", 1)
        await ready(broker, topic, "slow", 1)
        sent = [b"m%d" % i for i in range(50)]
        await run(lambda: [producer.send(m) for m in sent])
        assert await run(lambda: drain(fast)) == sent
        topic_stats = await stats(broker, topic)
        subs = topic_stats["subscriptions"]
        assert subs["fast"]["msgDropCounter"] == 0 and subs["fast"]["msgOutCounter"] == 50
        # The slow one's receiver queue (1, plus what the client buffers) filled at once.
        assert subs["slow"]["msgDropCounter"] >= 45
        assert subs["slow"]["msgDropRate"] > 0
        assert subs["slow"]["msgOutCounter"] + subs["slow"]["msgDropCounter"] == 50
        assert topic_stats["msgInCounter"] == 50 and topic_stats["msgRateIn"] > 0
        assert topic_stats["msgDropCounter"] == subs["slow"]["msgDropCounter"]
        assert topic_stats["msgDropRate"] > 0 and topic_stats["msgRateOut"] > 0
        assert [p["msgInCounter"] for p in topic_stats["publishers"]] == [50]
        assert {c["consumerName"] for c in subs["slow"]["consumers"]} != set()
        # The CLI shows the same through the existing command, and /metrics counts drops.
        runner = CliRunner()
        assert broker.http_url is not None
        args = ["admin", "--admin-url", broker.http_url, "topics", "stats", topic]
        result = await run(lambda: runner.invoke(app, [*args, "--output", "json"]))
        assert result.exit_code == 0, result.stdout
        assert json.loads(result.stdout)["subscriptions"]["slow"]["msgDropCounter"] >= 45
        metrics = (await run(lambda: http(f"{broker.http_url}/metrics")))[1].decode()
        line = next(
            m for m in metrics.splitlines()
            if m.startswith("anabranch_nonpersistent_subscription_dropped_messages_total")
            and 'subscription="slow"' in m
        )  # fmt: skip
        assert float(line.rsplit(" ", 1)[1]) >= 45
        await run(slow.close)


async def test_admin_lists_deletes_and_binary_listing(broker: InProcessBroker) -> None:
    topic = np("listed")
    base = broker.http_url
    async with client(broker.service_url) as c:
        producer = await run(lambda: c.create_producer(topic))
        ns_url = f"{base}/admin/v2/non-persistent/public/default"
        assert await get_json(ns_url) == [topic]
        every = await get_json(f"{base}/admin/v2/namespaces/public/default/topics?mode=ALL")
        assert topic in every
        persistent = await get_json(f"{base}/admin/v2/namespaces/public/default/topics")
        assert topic not in persistent
        assert await get_json(f"{ns_url}/listed/partitions") == {"partitions": 0}
        assert await get_json(f"{ns_url}/listed/subscriptions") == []
        assert broker.http_url is not None
        args = ["admin", "--admin-url", broker.http_url, "topics", "list", "public/default"]
        listed = await run(lambda: CliRunner().invoke(app, [*args, "-o", "json"]))
        assert listed.exit_code == 0 and topic in json.loads(listed.stdout)
        status, _ = await run(lambda: http(f"{ns_url}/listed", "DELETE"))
        assert status == 409  # a producer is connected
        await run(producer.close)
    status, _ = await run(lambda: http(f"{ns_url}/listed", "DELETE"))
    assert status == 204
    assert await get_json(ns_url) == []
    assert (await run(lambda: http(f"{ns_url}/listed/stats")))[0] == 404
    # The official client's regex subscription asks GET_TOPICS_OF_NAMESPACE in
    # NON_PERSISTENT mode and finds the loaded topic.
    import re

    async with client(broker.service_url) as c:
        producer = await run(lambda: c.create_producer(np("pattern-1"), batching_enabled=False))
        pattern = re.compile(r"public/default/pattern-.*")
        mode = pulsar.RegexSubscriptionMode.NonPersistentOnly
        consumer = await run(lambda: c.subscribe(pattern, "pat", regex_subscription_mode=mode))
        await ready(broker, np("pattern-1"), "pat", 1)
        await run(lambda: producer.send(b"found"))
        assert await run(lambda: consumer.receive(RECEIVE_MS).data()) == b"found"


async def test_restart_loses_everything_leaves_no_files_clients_carry_on(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    proc = BrokerProcess(data)
    await proc.start()
    topic = np("restarted-xyz")
    c = await run(lambda: pulsar.Client(proc.service_url, operation_timeout_seconds=30))
    try:
        consumer = await run(lambda: c.subscribe(topic, "s"))
        producer = await run(lambda: c.create_producer(topic, batching_enabled=False))

        def first() -> list[bytes]:
            for attempt in range(200):  # until the consumer's FLOW is in (hang guard)
                producer.send(b"before%d" % attempt)
                try:
                    return [consumer.receive(100).data()]
                except pulsar.Timeout:
                    continue
            return []

        assert (await run(first))[0].startswith(b"before")
        await proc.stop()
        # Nothing of the topic reached the disk: no file names it, no file contains it.
        for path in data.rglob("*"):
            assert "restarted-xyz" not in str(path)
            if path.is_file():
                assert b"restarted-xyz" not in path.read_bytes(), path
        await proc.start()

        def after() -> list[bytes]:
            for attempt in range(300):  # clients reconnect on their own and keep going
                producer.send(b"after%d" % attempt)
                try:
                    return [consumer.receive(100).data(), *drain(consumer, 300)]
                except pulsar.Timeout:
                    continue
            return []

        got = await run(after)
        assert got and all(m.startswith(b"after") for m in got), got
    finally:
        await run(c.close)
        await proc.stop()


async def test_our_client_produces_consumes_and_transactions_are_refused(
    tmp_path: Path,
) -> None:
    topic = np("ours")
    async with InProcessBroker(tmp_path, ledgers="memory", transactions_enabled=True) as b:
        ours = Client(b.service_url)
        try:
            consumer = await ours.subscribe(topic, "s", subscription_type="shared")
            producer = await ours.create_producer(topic)
            await ready(b, topic, "s", 1)
            for i in range(5):
                await producer.send(b"o%d" % i)
            got = [await consumer.receive(timeout=5) for _ in range(5)]
            assert [m.value for m in got if m is not None] == [b"o%d" % i for i in range(5)]
            txn = await ours.new_transaction(timeout=30)
            with pytest.raises(AnabranchError, match="non-persistent"):
                await producer.send(b"in-txn", txn=txn)
            await txn.abort()
        finally:
            await ours.close()


async def test_topic_and_subscription_counts_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "NON_PERSISTENT_SUBSCRIPTIONS_MAX", 2)
    async with (
        InProcessBroker(tmp_path, ledgers="memory", max_topics_per_broker=3) as b,
        client(b.service_url) as c,
    ):
        producers = await run(lambda: [c.create_producer(np(f"cap{i}")) for i in range(3)])
        with pytest.raises(pulsar.PulsarException):
            await run(lambda: c.create_producer(np("cap-over")))
        assert b.service.counters.topics_refused >= 1
        subs = await run(lambda: [c.subscribe(np("cap0"), f"s{i}") for i in range(2)])
        with pytest.raises(pulsar.PulsarException):
            await run(lambda: c.subscribe(np("cap0"), "s-over"))
        # A subscription that ends frees its place.
        await run(subs[0].close)
        await run(lambda: c.subscribe(np("cap0"), "s-again"))
        assert len(producers) == 3


async def test_a_burst_over_the_inflight_bound_is_dropped_and_counted(
    broker: InProcessBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Room for a few messages per event-loop iteration: a pipelined burst overflows it.
    monkeypatch.setattr(limits, "NON_PERSISTENT_INFLIGHT_BYTES_MAX", 300)
    topic = np("burst")
    async with client(broker.service_url) as c:
        consumer = await run(lambda: c.subscribe(topic, "s"))
        producer = await run(lambda: c.create_producer(
            topic, batching_enabled=False, max_pending_messages=1000))  # fmt: skip
        await ready(broker, topic, "s", 1)

        def burst() -> list[Any]:
            receipts: list[Any] = []
            for i in range(200):
                producer.send_async(b"b%03d" % i, lambda _res, msg_id: receipts.append(msg_id))
            producer.flush()
            return receipts

        receipts = await run(burst)
        got = await run(lambda: drain(consumer))
        topic_stats = await stats(broker, topic)
    dropped = [r for r in receipts if r.entry_id() == -1]
    assert len(receipts) == 200 and dropped, "every send is answered, some with (-1, -1)"
    assert len(got) == 200 - len(dropped)  # what was not dropped was delivered
    assert topic_stats["publishers"][0]["msgDropCounter"] == len(dropped)
    assert topic_stats["publishers"][0]["msgDropRate"] > 0
    assert topic_stats["msgDropCounter"] == len(dropped)


async def test_schemas_work_on_non_persistent_topics(broker: InProcessBroker) -> None:
    topic = np("typed")
    async with client(broker.service_url) as c:
        consumer = await run(lambda: c.subscribe(topic, "s", schema=pulsar.schema.StringSchema()))
        producer = await run(lambda: c.create_producer(
            topic, schema=pulsar.schema.StringSchema(), batching_enabled=False))  # fmt: skip
        await ready(broker, topic, "s", 1)
        await run(lambda: producer.send("héllo"))
        assert await run(lambda: consumer.receive(RECEIVE_MS).value()) == "héllo"
        with pytest.raises(pulsar.PulsarException):  # an incompatible schema is refused
            await run(lambda: c.create_producer(topic, schema=pulsar.schema.JsonSchema(Point)))


class Point(pulsar.schema.Record):  # type: ignore[misc]
    x = pulsar.schema.Integer()


async def test_idle_topics_are_unloaded_busy_ones_stay(
    broker: InProcessBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "NON_PERSISTENT_IDLE_S", 0.0)
    service = broker.service
    async with client(broker.service_url) as c:
        busy = await run(lambda: c.create_producer(np("busy")))
        idle = await run(lambda: c.create_producer(np("idle")))
        await run(idle.close)
        # The first sweep only notes who is idle; the next one unloads them.
        assert await service.sweep_idle_non_persistent() == 0
        assert await service.sweep_idle_non_persistent() == 1
        assert service.loaded_non_persistent_topic(np("idle")) is None
        assert service.loaded_non_persistent_topic(np("busy")) is not None
        await run(lambda: busy.send(b"still here"))  # the busy one still works


async def test_partitioned_non_persistent_topic(broker: InProcessBroker) -> None:
    topic = np("parted")
    assert broker.http_url is not None
    runner = CliRunner()
    admin = ["admin", "--admin-url", broker.http_url, "topics"]
    created = await run(lambda: runner.invoke(app, [*admin, "create", topic, "--partitions", "3"]))
    assert created.exit_code == 0, created.stdout
    base = f"{broker.http_url}/admin/v2/non-persistent/public/default"
    assert await get_json(f"{base}/parted/partitions") == {"partitions": 3}
    assert await get_json(f"{base}/partitioned") == [topic]
    async with client(broker.service_url) as c:
        consumer = await run(lambda: c.subscribe(topic, "s"))  # every partition
        producer = await run(lambda: c.create_producer(topic, batching_enabled=False))
        for index in range(3):
            await ready(broker, f"{topic}-partition-{index}", "s", 1)

        def send_all() -> None:
            for i in range(30):
                producer.send(b"p%d" % i, partition_key=f"key-{i}")

        await run(send_all)
        got = await run(lambda: drain(consumer))
        assert sorted(got) == sorted(b"p%d" % i for i in range(30))
        stats = await get_json(f"{base}/parted/partitioned-stats?perPartition=true")
        assert stats["metadata"] == {"partitions": 3} and stats["msgInCounter"] == 30
        assert sum(1 for p in stats["partitions"].values() if p["msgInCounter"]) >= 2
        result = await run(lambda: runner.invoke(app, [*admin, "stats", topic, "-o", "json"]))
        assert result.exit_code == 0 and json.loads(result.stdout)["msgOutCounter"] == 30
        # The base name is not a topic of its own; partitions past the count do not exist.
        assert (await run(lambda: http(f"{base}/parted-partition-3/stats")))[0] == 404
        assert (await run(lambda: http(f"{base}/parted/stats")))[0] == 405
        status, _ = await run(lambda: http(f"{base}/parted/partitions", "DELETE"))
        assert status == 409  # clients are connected
    status, _ = await run(lambda: http(f"{base}/parted/partitions", "DELETE"))
    assert status == 204
    assert await get_json(f"{base}/partitioned") == []
    assert broker.service.loaded_non_persistent_topics() == []

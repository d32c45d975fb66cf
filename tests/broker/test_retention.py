"""Retention, message TTL and backlog quotas on a real in-process broker (file ledgers).

The sweeps run every ``*_check_interval_s``; most tests keep the intervals long and call
the sweep themselves (deterministic), one shows the periodic task doing it alone. The
broker's clock is the system clock with a wall-time offset the test moves forward, so
"an hour later" needs no waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.clock import SystemClock
from anabranch.errors import MetadataUnavailable, NotAllowed
from anabranch.testing.broker import InProcessBroker
from anabranch.transactions import records
from anabranch.transactions.metadata_buffer import MetadataTransactionBuffer

NS = "public/default"
PAYLOAD = b"x" * 1000
EVENTUALLY_ROUNDS = 2_000
LONG_S = 3600.0


class SkewedClock(SystemClock):
    """The system clock, with wall (and monotonic) time the test can move ahead."""

    def __init__(self) -> None:
        self.offset_ms = 0
        self.monotonic_offset_s = 0.0

    def wall_ms(self) -> int:
        return super().wall_ms() + self.offset_ms

    def monotonic(self) -> float:
        return super().monotonic() + self.monotonic_offset_s


@dataclass
class World:
    broker: InProcessBroker
    admin: AdminClient
    client: Client
    clock: SkewedClock
    data_dir: Path

    def topic(self, name: str) -> str:
        return f"persistent://{NS}/{name}"

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.data_dir.rglob("*") if p.is_file())

    async def produce(self, topic: str, count: int, payload: bytes = PAYLOAD) -> None:
        producer = await self.client.create_producer(topic, batching=False)
        for _ in range(count):
            await producer.send(payload)
        await producer.close()

    async def cursor(self, topic: str, sub: str) -> None:
        """A durable subscription at the earliest position, without a connected consumer."""
        consumer = await self.client.subscribe(topic, sub, initial_position="earliest")
        await consumer.close()

    async def consume_all(self, topic: str, sub: str, count: int) -> None:
        consumer = await self.client.subscribe(topic, sub, initial_position="earliest")
        for _ in range(count):
            msg = await consumer.receive(timeout=10)
            assert msg is not None
            await consumer.acknowledge(msg)
        await consumer.close()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    clock = SkewedClock()
    async with InProcessBroker(
        tmp_path / "data",
        clock=clock,
        managed_ledger_max_entries_per_ledger=10,
        retention_check_interval_s=LONG_S,
        ttl_check_interval_s=LONG_S,
        backlog_quota_check_interval_s=LONG_S,
        backlog_quota_hold_max_s=LONG_S,
        cursor_persist_interval_ms=0,
    ) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            yield World(broker, admin, client, clock, tmp_path / "data")


async def eventually_async(check: object, what: str) -> None:
    for _ in range(EVENTUALLY_ROUNDS):
        if await check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


# --- retention -------------------------------------------------------------------------------


async def test_consumed_ledgers_are_deleted_and_disk_usage_goes_down(world: World) -> None:
    topic = world.topic("cleanup")
    await world.cursor(topic, "s")
    await world.produce(topic, 100)
    await world.consume_all(topic, "s", 100)
    await world.admin.set_retention(NS, 0, 0)
    stats = await world.admin.stats(topic)
    assert stats["storageSize"] >= 100 * len(PAYLOAD)
    before = world.disk_bytes()

    await world.broker.service.sweeps.sweep_retention()

    after_stats = await world.admin.stats(topic)
    assert after_stats["storageSize"] <= 10 * 1100  # only the open ledger's entries remain
    assert world.disk_bytes() < before - 80 * len(PAYLOAD)
    internal = await world.admin.internal_stats(topic)
    assert len(internal["ledgers"]) == 1
    assert world.broker.service.counters.ledgers_trimmed >= 9
    # The topic keeps working after its ledgers went.
    await world.produce(topic, 5, b"after")
    consumer = await world.client.subscribe(topic, "s")
    msg = await consumer.receive(timeout=10)
    assert msg is not None and msg.value == b"after"


async def test_unconsumed_and_retained_data_stays(world: World) -> None:
    topic = world.topic("kept")
    await world.cursor(topic, "slow")
    await world.cursor(topic, "fast")
    await world.produce(topic, 50)
    await world.consume_all(topic, "fast", 50)
    size = (await world.admin.stats(topic))["storageSize"]
    await world.broker.service.sweeps.sweep_retention()
    assert (await world.admin.stats(topic))["storageSize"] == size  # "slow" has not read it

    await world.consume_all(topic, "slow", 50)
    await world.admin.set_retention(NS, 60, -1)  # consumed data kept one hour
    await world.broker.service.sweeps.sweep_retention()
    assert (await world.admin.stats(topic))["storageSize"] == size
    world.clock.offset_ms += 61 * 60_000
    await world.broker.service.sweeps.sweep_retention()
    assert (await world.admin.stats(topic))["storageSize"] < size // 2


async def test_an_idle_consumed_ledger_rolls_over_and_goes(world: World) -> None:
    topic = world.topic("idle")
    await world.cursor(topic, "s")
    await world.produce(topic, 5)  # fewer than a ledger holds: it stays open
    await world.consume_all(topic, "s", 5)
    await world.broker.service.sweeps.sweep_retention()
    assert (await world.admin.stats(topic))["storageSize"] >= 5 * len(PAYLOAD)  # still open
    world.clock.monotonic_offset_s += 4 * 3600 + 1  # past the ledger rollover time
    await world.broker.service.sweeps.sweep_retention()
    assert (await world.admin.stats(topic))["storageSize"] == 0
    await world.produce(topic, 1, b"later")
    consumer = await world.client.subscribe(topic, "s")
    msg = await consumer.receive(timeout=10)
    assert msg is not None and msg.value == b"later"


async def test_the_periodic_sweep_trims_by_itself(tmp_path: Path) -> None:
    async with InProcessBroker(
        tmp_path, managed_ledger_max_entries_per_ledger=5, retention_check_interval_s=0.05
    ) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            world = World(broker, admin, client, SkewedClock(), tmp_path)
            topic = world.topic("periodic")
            await world.cursor(topic, "s")
            await world.produce(topic, 30)
            full: int = (await admin.stats(topic))["storageSize"]
            await world.consume_all(topic, "s", 30)

            async def trimmed() -> bool:
                size: int = (await admin.stats(topic))["storageSize"]
                return size < full // 2

            await eventually_async(trimmed, "the retention sweep deleted consumed ledgers")
            assert broker.service.sweeps.runs["retention"] >= 1


async def test_retention_admin_endpoints_and_validation(world: World) -> None:
    assert await world.admin.get_retention(NS) == {
        "retentionTimeInMinutes": 0,
        "retentionSizeInMB": 0,
    }
    await world.admin.set_retention(NS, 120, 1024)
    assert await world.admin.get_retention(NS) == {
        "retentionTimeInMinutes": 120,
        "retentionSizeInMB": 1024,
    }
    assert (await world.admin.request("GET", f"/admin/v2/namespaces/{NS}"))[
        "retention_policies"
    ] == {"retentionTimeInMinutes": 120, "retentionSizeInMB": 1024}
    with pytest.raises(Exception, match="400"):
        await world.admin.set_retention(NS, -2, 0)
    # Pulsar's rule: a backlog quota stays under positive retention bounds (412).
    with pytest.raises(Exception, match="412"):
        await world.admin.set_backlog_quota(NS, limit_size=2 * 1024**3, policy="producer_exception")
    await world.admin.set_backlog_quota(NS, limit_size=100 * 1024**2, policy="producer_exception")
    with pytest.raises(Exception, match="412"):
        await world.admin.set_retention(NS, 120, 50)
    with pytest.raises(Exception, match="412"):
        await world.admin.set_backlog_quota(
            NS, limit_time_s=3 * 3600, policy="producer_exception", quota_type="message_age"
        )
    await world.admin.remove_backlog_quota(NS)
    await world.admin.remove_retention(NS)
    assert await world.admin.get_retention(NS) == {
        "retentionTimeInMinutes": 0,
        "retentionSizeInMB": 0,
    }
    with pytest.raises(Exception, match="404"):
        await world.admin.set_retention("public/nope", 1, 1)


# --- message TTL ---------------------------------------------------------------------------------


async def test_message_ttl_acknowledges_expired_messages(world: World) -> None:
    topic = world.topic("ttl")
    await world.cursor(topic, "s")
    await world.produce(topic, 20)
    await world.admin.set_message_ttl(NS, 60)
    assert await world.admin.get_message_ttl(NS) == 60
    await world.broker.service.sweeps.sweep_ttl()
    stats = await world.admin.stats(topic)
    assert stats["backlogEntries"] == 20  # not yet expired

    world.clock.offset_ms += 61_000
    await world.broker.service.sweeps.sweep_ttl()
    assert (await world.admin.stats(topic))["backlogEntries"] == 0
    assert world.broker.service.counters.entries_expired == 20
    # Newer messages are kept; expired ones are then deleted by retention.
    world.clock.offset_ms = 0
    await world.produce(topic, 3, b"fresh")
    await world.broker.service.sweeps.sweep_ttl()
    assert (await world.admin.stats(topic))["backlogEntries"] == 3
    await world.broker.service.sweeps.sweep_retention()
    assert (await world.admin.stats(topic))["storageSize"] < 10 * 1100
    consumer = await world.client.subscribe(topic, "s")
    msg = await consumer.receive(timeout=10)
    assert msg is not None and msg.value == b"fresh"
    await world.admin.remove_message_ttl(NS)
    assert await world.admin.get_message_ttl(NS) is None


async def test_ttl_never_expires_an_open_transactions_messages(world: World) -> None:
    topic = world.topic("ttl-txn")
    await world.cursor(topic, "s")
    producer = await world.client.create_producer(topic, batching=False)
    await producer.send(b"before")
    txn = await world.client.new_transaction(timeout=3600)
    await producer.send(b"in-txn", txn=txn)
    await producer.send(b"after")
    await world.admin.set_message_ttl(NS, 60)
    world.clock.offset_ms += 61_000
    await world.broker.service.sweeps.sweep_ttl()
    # Only what precedes the open transaction expired: the rest waits for its outcome.
    assert (await world.admin.stats(topic))["backlogEntries"] == 2
    await txn.commit()
    world.clock.offset_ms = 0
    consumer = await world.client.subscribe(topic, "s")
    got = [
        m.value
        for m in [await consumer.receive(timeout=10), await consumer.receive(timeout=10)]
        if m
    ]
    assert got == [b"in-txn", b"after"]


async def test_aborted_records_go_with_the_ledgers_retention_deletes(world: World) -> None:
    """An aborted transaction's record (the positions readers skip) outlived the ledger
    holding its entries: retention deleted the entries and the record stayed in the
    metadata store, and in the buffer's memory, for good."""
    topic = world.topic("aborted-trim")
    await world.cursor(topic, "s")
    producer = await world.client.create_producer(topic, batching=False)
    txn = await world.client.new_transaction(timeout=3600)
    for _ in range(3):
        await producer.send(b"aborted", txn=txn)
    await txn.abort()
    await producer.close()
    await world.produce(topic, 30)  # rolls the aborted entries' ledger over
    await world.consume_all(topic, "s", 30)
    loaded = await world.broker.service.get_topic(topic, create=False)
    assert loaded is not None
    buffer = loaded.transaction_buffer
    assert isinstance(buffer, MetadataTransactionBuffer)
    await buffer.wait_persisted()
    store = world.broker.service.store
    prefix = records.aborted_prefix(loaded.name)
    assert len((await store.list_prefix(prefix)).records) == 1
    assert buffer.stats()["abortedTxnCount"] == 1
    await world.admin.set_retention(NS, 0, 0)

    await world.broker.service.sweeps.sweep_retention()

    assert world.broker.service.counters.ledgers_trimmed >= 3
    assert (await store.list_prefix(prefix)).records == []
    assert buffer.stats()["abortedTxnCount"] == 0


# --- backlog quotas ----------------------------------------------------------------------------


async def test_producer_exception_refuses_producers_until_the_backlog_shrinks(
    world: World,
) -> None:
    topic = world.topic("quota-exception")
    await world.cursor(topic, "s")
    await world.admin.set_backlog_quota(NS, limit_size=5_000, policy="producer_exception")
    assert (await world.admin.get_backlog_quotas(NS))["destination_storage"] == {
        "limitSize": 5_000,
        "limitTime": -1,
        "policy": "producer_exception",
    }
    producer = await world.client.create_producer(topic, batching=False)
    for _ in range(10):
        await producer.send(PAYLOAD)
    await world.broker.service.sweeps.sweep_backlog_quotas()

    with pytest.raises(NotAllowed, match="quota"):
        await producer.send(PAYLOAD)
    with pytest.raises(NotAllowed, match="quota"):
        await world.client.create_producer(topic)

    await world.consume_all(topic, "s", 10)
    await world.broker.service.sweeps.sweep_backlog_quotas()
    second = await world.client.create_producer(topic, batching=False)
    await second.send(b"ok")
    await world.admin.remove_backlog_quota(NS)
    assert await world.admin.get_backlog_quotas(NS) == {}


async def test_producer_request_hold_holds_sends_until_consumed(world: World) -> None:
    topic = world.topic("quota-hold")
    await world.cursor(topic, "s")
    await world.admin.set_backlog_quota(NS, limit_size=5_000, policy="producer_request_hold")
    await world.produce(topic, 10)
    await world.broker.service.sweeps.sweep_backlog_quotas()
    loaded = world.broker.service.loaded_topic(topic)
    assert loaded is not None

    producer = await world.client.create_producer(topic, batching=False)
    held = asyncio.ensure_future(producer.send(b"held"))

    async def is_held() -> bool:
        return loaded.quota.held == 1

    await eventually_async(is_held, "the send is held")
    assert not held.done()
    await world.consume_all(topic, "s", 10)
    await world.broker.service.sweeps.sweep_backlog_quotas()
    message_id = await held
    assert message_id is not None
    assert loaded.quota.held == 0


async def test_producer_request_hold_gives_up_after_the_hold_bound(tmp_path: Path) -> None:
    async with InProcessBroker(
        tmp_path, backlog_quota_check_interval_s=LONG_S, backlog_quota_hold_max_s=0.2
    ) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            world = World(broker, admin, client, SkewedClock(), tmp_path)
            topic = world.topic("quota-hold-bound")
            await world.cursor(topic, "s")
            await admin.set_backlog_quota(NS, limit_size=1_000, policy="producer_request_hold")
            await world.produce(topic, 3)
            await broker.service.sweeps.sweep_backlog_quotas()
            producer = await client.create_producer(topic, batching=False)
            with pytest.raises(NotAllowed, match="held"):
                await producer.send(b"never")


async def test_consumer_backlog_eviction_moves_the_slowest_cursor(world: World) -> None:
    topic = world.topic("quota-evict")
    await world.cursor(topic, "slow")
    await world.admin.set_backlog_quota(NS, limit_size=5_000, policy="consumer_backlog_eviction")
    await world.produce(topic, 20)
    assert (await world.admin.stats(topic))["backlogEntries"] == 20
    await world.broker.service.sweeps.sweep_backlog_quotas()
    backlog = (await world.admin.stats(topic))["backlogEntries"]
    assert 0 < backlog <= 4  # 90% of 5,000 bytes of 1,000-byte messages
    consumer = await world.client.subscribe(topic, "slow")
    received = 0
    while await consumer.receive(timeout=0.5) is not None:
        received += 1
    assert received == backlog
    # Producers are never blocked by an eviction policy.
    await world.produce(topic, 1)


async def test_message_age_quota_evicts_old_messages(world: World) -> None:
    topic = world.topic("quota-age")
    await world.cursor(topic, "s")
    await world.admin.set_backlog_quota(
        NS, limit_time_s=30, policy="consumer_backlog_eviction", quota_type="message_age"
    )
    await world.produce(topic, 5)
    await world.broker.service.sweeps.sweep_backlog_quotas()
    assert (await world.admin.stats(topic))["backlogEntries"] == 5
    world.clock.offset_ms += 31_000
    await world.broker.service.sweeps.sweep_backlog_quotas()
    assert (await world.admin.stats(topic))["backlogEntries"] == 0
    assert "message_age" in await world.admin.get_backlog_quotas(NS)


async def test_a_failing_sweep_is_logged_and_the_task_keeps_running(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, ttl_check_interval_s=0.02) as broker:
        sweeps = broker.service.sweeps
        calls = 0

        def broken() -> list[object]:
            nonlocal calls
            calls += 1
            raise RuntimeError("boom")

        broker.service.loaded_topics = broken  # type: ignore[method-assign,assignment]
        for _ in range(EVENTUALLY_ROUNDS):
            if calls >= 3:
                break
            await asyncio.sleep(0.01)
        assert calls >= 3
        assert broker.service.counters.cleanup_failures >= 3
        assert sweeps.runs["ttl"] >= 3


async def test_a_topic_unloaded_while_the_sweep_runs_is_skipped_not_a_failure(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    # A broker losing its metadata session unloads its topics while a sweep may be walking
    # its list of them: the sweep then meets closed ledgers, which is no failure to log
    # with a traceback (the fault driver flagged these ERROR lines).
    topic = world.topic("unloaded-mid-sweep")
    await world.produce(topic, 1)
    service = world.broker.service
    listed = service.loaded_topics()
    assert [t.name for t in listed] == [topic]
    assert await service.unload_topic(topic)
    service.loaded_topics = lambda: listed  # type: ignore[method-assign]
    with caplog.at_level("ERROR", logger="anabranch.broker.retention"):
        await service.sweeps.sweep_retention()
    assert service.counters.cleanup_failures == 0
    assert not caplog.records


async def test_an_unreachable_store_ends_the_sweep_pass_with_one_line(
    world: World, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With etcd out of reach, every topic's step failed with an ERROR traceback, once per
    topic per sweep (soak logs): the pass now ends at the first, with one WARNING."""
    for name in ("outage-a", "outage-b", "outage-c"):
        await world.produce(world.topic(name), 1)
    service = world.broker.service
    failures = service.counters.cleanup_failures
    reads = 0

    async def unreachable(namespace: str) -> None:
        nonlocal reads
        reads += 1
        raise MetadataUnavailable("etcd at 127.0.0.1:1: Socket closed")

    with monkeypatch.context() as patch:
        patch.setattr(service.policies, "namespace_policies", unreachable)
        with caplog.at_level(logging.WARNING, logger="anabranch.broker.retention"):
            await service.sweeps.sweep_retention()
    assert reads == 1
    assert service.counters.cleanup_failures == failures + 1
    assert [(r.levelno, bool(r.exc_info)) for r in caplog.records] == [(logging.WARNING, False)]
    assert "Socket closed" in caplog.records[0].getMessage()


# --- topic-level overrides ----------------------------------------------------------------------


async def test_topic_level_overrides_win_over_the_namespace(world: World) -> None:
    topic = world.topic("override")
    other = world.topic("not-overridden")
    path = f"/admin/v2/persistent/{NS}/override"
    for name in (topic, other):
        await world.cursor(name, "s")
        await world.produce(name, 20)
    await world.admin.set_message_ttl(NS, 3600)
    await world.admin.request("POST", f"{path}/messageTTL?messageTTL=10")
    assert await world.admin.request("GET", f"{path}/messageTTL") == 10
    assert (
        await world.admin.request("GET", f"/admin/v2/persistent/{NS}/not-overridden/messageTTL")
        is None
    )
    world.clock.offset_ms += 11_000
    await world.broker.service.sweeps.sweep_ttl()
    assert (await world.admin.stats(topic))["backlogEntries"] == 0  # its own 10 s TTL
    assert (await world.admin.stats(other))["backlogEntries"] == 20  # the namespace's hour

    await world.admin.request(
        "POST", f"{path}/retention", {"retentionTimeInMinutes": -1, "retentionSizeInMB": -1}
    )
    assert await world.admin.request("GET", f"{path}/retention?applied=true") == {
        "retentionTimeInMinutes": -1,
        "retentionSizeInMB": -1,
    }
    size = (await world.admin.stats(topic))["storageSize"]
    await world.broker.service.sweeps.sweep_retention()
    assert (await world.admin.stats(topic))["storageSize"] == size  # infinite retention
    await world.admin.request("DELETE", f"{path}/retention")
    assert await world.admin.request("GET", f"{path}/retention") is None
    await world.broker.service.sweeps.sweep_retention()
    assert (await world.admin.stats(topic))["storageSize"] < size

    await world.admin.request(
        "POST",
        f"{path}/backlogQuota?backlogQuotaType=destination_storage",
        {"limitSize": 1000, "limitTime": -1, "policy": "producer_exception"},
    )
    assert (await world.admin.request("GET", f"{path}/backlogQuotaMap?applied=true"))[
        "destination_storage"
    ]["policy"] == "producer_exception"
    await world.produce(topic, 3)
    await world.broker.service.sweeps.sweep_backlog_quotas()
    with pytest.raises(NotAllowed, match="quota"):
        await world.client.create_producer(topic)
    await world.produce(other, 1)  # the namespace has no quota
    await world.admin.request("DELETE", f"{path}/backlogQuota")
    await world.broker.service.sweeps.sweep_backlog_quotas()
    await world.produce(topic, 1)
    with pytest.raises(Exception, match="404"):
        await world.admin.request("GET", f"/admin/v2/persistent/{NS}/absent/retention")


async def test_the_broker_default_quota_applies_without_a_namespace_quota(tmp_path: Path) -> None:
    async with InProcessBroker(
        tmp_path,
        backlog_quota_check_interval_s=LONG_S,
        backlog_quota_default_limit_bytes=5_000,
        backlog_quota_default_retention_policy="producer_exception",
    ) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            world = World(broker, admin, client, SkewedClock(), tmp_path)
            topic = world.topic("default-quota")
            await world.cursor(topic, "s")
            await world.produce(topic, 10)
            await broker.service.sweeps.sweep_backlog_quotas()
            with pytest.raises(NotAllowed, match="quota"):
                await client.create_producer(topic)
            # A namespace quota replaces the default.
            await admin.set_backlog_quota(NS, limit_size=50_000, policy="producer_exception")
            await broker.service.sweeps.sweep_backlog_quotas()
            await world.produce(topic, 1)

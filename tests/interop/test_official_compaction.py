"""Topic compaction with the official pulsar-client: compacted readers and consumers see
the latest value per key, tombstones delete keys, the read goes on from the compacted view
to the live tail without gaps or duplicates, the view survives a restart, the namespace
threshold compacts by itself, and Shared + read_compacted is refused.

The broker runs on the test's event loop; client work runs in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pulsar
import pytest

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.broker.metrics import broker_registry, render
from anabranch.errors import NotAllowed
from anabranch.failpoints import COMPACTION_CRASH_BEFORE_SWITCH
from anabranch.storage.api import EARLIEST
from anabranch.testing.broker import BrokerProcess, InProcessBroker
from anabranch.testing.nats import NatsCluster

R = TypeVar("R")
TOPIC = "persistent://public/default/compacted"
HANG_GUARD_S = 60


@contextmanager
def client(url: str) -> Iterator[pulsar.Client]:
    # The client's own C++ logger: a Python logger is called from the client's threads,
    # which can crash the interpreter when they log while an event loop is torn down.
    logger = pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn)
    c = pulsar.Client(url, operation_timeout_seconds=15, logger=logger)
    try:
        yield c
    finally:
        c.close()


def http(broker: InProcessBroker) -> str:
    assert broker.http_url is not None
    return broker.http_url


async def run(fn: Callable[[], R]) -> R:
    return await asyncio.to_thread(fn)


def produce(
    c: pulsar.Client, pairs: list[tuple[str, bytes]], *, batching: bool = False, lz4: bool = False
) -> None:
    producer = c.create_producer(
        TOPIC, batching_enabled=batching, batching_max_messages=7,
        compression_type=pulsar.CompressionType.LZ4 if lz4 else pulsar.CompressionType.NONE,
    )  # fmt: skip
    for key, value in pairs:
        if key:
            producer.send_async(value, None, partition_key=key)
        else:
            producer.send_async(value, None)  # keyless: not in the compacted view
    producer.flush()
    producer.close()


def read_all(c: pulsar.Client, *, compacted: bool = True) -> list[tuple[str, bytes]]:
    reader = c.create_reader(TOPIC, pulsar.MessageId.earliest, is_read_compacted=compacted)
    out = []
    while reader.has_message_available():
        msg = reader.read_next(5000)
        out.append((msg.partition_key(), msg.data()))
    reader.close()
    return out


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``check`` (a hang guard, not a time limit on the behaviour)."""
    for _ in range(HANG_GUARD_S * 20):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: still not after {HANG_GUARD_S}s")


async def compact(admin: AdminClient, topic: str = TOPIC) -> None:
    await admin.compact(topic)

    async def done() -> bool:
        return (await admin.compaction_status(topic))["status"] != "RUNNING"

    await until(done, "compaction finished")
    assert await admin.compaction_status(topic) == {"status": "SUCCESS", "lastError": ""}


def history() -> list[tuple[str, bytes]]:
    """Ten keys written three times each; k3 deleted by a tombstone; k5 deleted then
    written again."""
    pairs = [(f"k{i}", b"v%d-%d" % (i, r)) for r in range(3) for i in range(10)]
    pairs += [("k3", b""), ("k5", b""), ("k5", b"v5-again")]
    return pairs


def expected(pairs: list[tuple[str, bytes]]) -> dict[str, bytes]:
    state: dict[str, bytes] = {}
    for key, value in pairs:
        if not key:
            continue
        if value:
            state[key] = value
        else:
            state.pop(key, None)
    return state


@pytest.mark.parametrize("mode", ["plain", "batched", "batched-lz4"])
async def test_latest_value_per_key_and_tombstones_delete(tmp_path: Path, mode: str) -> None:
    pairs = history()
    pairs.insert(5, ("", b"keyless"))
    async with InProcessBroker(tmp_path) as broker, AdminClient(http(broker)) as admin:
        with pytest.raises(AdminHttpError):
            await admin.compaction_status(TOPIC)  # no such topic yet: 404
        await run(lambda: _produce_at(broker.service_url, pairs, mode))
        assert (await admin.compaction_status(TOPIC))["status"] == "NOT_RUN"
        await compact(admin)

        def reads() -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
            with client(broker.service_url) as c:
                return read_all(c), read_all(c, compacted=False)

        compacted, full = await run(reads)
        metrics = render(broker_registry(broker.service)).decode()
    assert 'anabranch_compaction_succeeded_total{cluster="standalone"} 1.0' in metrics
    removed = len(pairs) - len(expected(pairs))
    assert f'anabranch_compaction_removed_messages_total{{cluster="standalone"}} {removed}.0' in (
        metrics
    )
    assert dict(compacted) == expected(pairs)
    assert len(compacted) == len(expected(pairs))  # one message per live key
    assert full == pairs  # readers without read_compacted see the whole topic


def _produce_at(url: str, pairs: list[tuple[str, bytes]], mode: str = "plain") -> None:
    with client(url) as c:
        produce(c, pairs, batching=mode != "plain", lz4=mode.endswith("lz4"))


async def test_compacted_view_then_live_tail_without_gaps_or_duplicates(tmp_path: Path) -> None:
    first = history()
    later = [(f"k{i % 4}", b"tail-%d" % i) for i in range(40)]
    async with InProcessBroker(tmp_path) as broker, AdminClient(http(broker)) as admin:
        await run(lambda: _produce_at(broker.service_url, first))
        await compact(admin)

        def work() -> tuple[list[tuple[str, bytes]], list[Any]]:
            with client(broker.service_url) as c:
                consumer = c.subscribe(
                    TOPIC, "table", is_read_compacted=True,
                    initial_position=pulsar.InitialPosition.Earliest,
                    consumer_type=pulsar.ConsumerType.Exclusive, receiver_queue_size=5,
                )  # fmt: skip
                got: list[tuple[str, bytes]] = []
                ids: list[Any] = []
                for _ in range(len(expected(first))):
                    msg = consumer.receive(5000)
                    got.append((msg.partition_key(), msg.data()))
                    ids.append(msg.message_id())
                    consumer.acknowledge_cumulative(msg)
                # producing goes on while this consumer reads the tail
                produce(c, later)
                for _ in range(len(later)):
                    msg = consumer.receive(5000)
                    got.append((msg.partition_key(), msg.data()))
                    ids.append(msg.message_id())
                    consumer.acknowledge_cumulative(msg)
                try:
                    extra = consumer.receive(300)
                    got.append((extra.partition_key(), extra.data()))
                except pulsar.Timeout:
                    pass
                consumer.close()
                return got, ids

        got, ids = await run(work)
        stats = await admin.stats(TOPIC)
    head = len(expected(first))
    assert dict(got[:head]) == expected(first)
    assert got[head:] == later  # the tail in order, nothing missing, nothing twice
    assert len(got) == head + len(later)
    order = [(i.ledger_id(), i.entry_id(), i.batch_index()) for i in ids]
    assert order == sorted(order) and len(set(order)) == len(order)
    assert stats["subscriptions"]["table"]["msgBacklog"] == 0
    assert stats["compaction"]["lastCompactionRemovedEventCount"] == len(first) - head
    assert stats["compaction"]["lastCompactionSucceedTimestamp"] > 0
    assert "__compaction" in stats["subscriptions"]


async def test_compacted_view_survives_a_restart(tmp_path: Path) -> None:
    pairs = history()
    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        AdminClient(http(broker)) as admin,
    ):
        await run(lambda: _produce_at(broker.service_url, pairs))
        await compact(admin)
        await run(lambda: _produce_at(broker.service_url, [("k1", b"after")]))
    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        AdminClient(http(broker)) as admin,
    ):
        status = await admin.compaction_status(TOPIC)

        def reads() -> list[tuple[str, bytes]]:
            with client(broker.service_url) as c:
                return read_all(c)

        compacted = await run(reads)
        # a second compaction builds on the first one's view
        await compact(admin)
        again = await run(reads)
    assert status["status"] == "SUCCESS"
    want = expected(pairs)
    assert compacted[-1] == ("k1", b"after")  # the tail after the horizon follows the view
    assert dict(compacted[:-1]) == want
    assert len(compacted) == len(want) + 1
    assert dict(again) == want | {"k1": b"after"}
    assert len(again) == len(want)


async def test_namespace_threshold_compacts_automatically(tmp_path: Path) -> None:
    async with (
        InProcessBroker(tmp_path, compaction_check_interval_s=0.1) as broker,
        AdminClient(http(broker)) as admin,
    ):
        assert await admin.get_compaction_threshold("public/default") is None
        await admin.set_compaction_threshold("public/default", 1_000_000)
        await run(lambda: _produce_at(broker.service_url, [("a", b"x" * 100)] * 5))
        assert await broker.service.compactions.check() == []  # under the threshold
        assert (await admin.compaction_status(TOPIC))["status"] == "NOT_RUN"
        await admin.set_compaction_threshold("public/default", 300)
        assert await admin.get_compaction_threshold("public/default") == 300

        async def succeeded() -> bool:
            return (await admin.compaction_status(TOPIC))["status"] == "SUCCESS"

        await until(succeeded, "automatic compaction")
        await admin.remove_compaction_threshold("public/default")
        assert await admin.get_compaction_threshold("public/default") is None

        def reads() -> list[tuple[str, bytes]]:
            with client(broker.service_url) as c:
                return read_all(c)

        assert await run(reads) == [("a", b"x" * 100)]
        # a topic-level override wins over the namespace: off there, on here
        await admin.set_compaction_threshold("public/default", 0)
        await admin.set_compaction_threshold(TOPIC, 5)
        assert await admin.get_compaction_threshold(TOPIC) == 5
        assert await admin.get_compaction_threshold(TOPIC, applied=True) == 5
        await run(lambda: _produce_at(broker.service_url, [("b", b"y")]))
        counters = broker.service.compactions.counters
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None
        compaction = broker.service.compactions.of(topic)

        async def ran_again() -> bool:
            return counters.runs >= 2 and not compaction.running

        await until(ran_again, "automatic compaction by the topic's threshold")
        assert await run(reads) == [("a", b"x" * 100), ("b", b"y")]
        await admin.remove_compaction_threshold(TOPIC)
        assert await admin.get_compaction_threshold(TOPIC) is None


async def test_shared_read_compacted_is_refused_and_a_second_run_conflicts(
    tmp_path: Path,
) -> None:
    async with InProcessBroker(tmp_path) as broker, AdminClient(http(broker)) as admin:

        def shared() -> str:
            with client(broker.service_url) as c:
                try:
                    c.subscribe(
                        TOPIC, "s", consumer_type=pulsar.ConsumerType.Shared,
                        is_read_compacted=True,
                    )  # fmt: skip
                except Exception as err:
                    return type(err).__name__
            return "subscribed"

        official = await run(shared)
        pairs = [(f"k{i % 50}", b"v%d" % i) for i in range(500)]
        await run(lambda: _produce_at(broker.service_url, pairs))
        async with Client(broker.service_url) as ours:
            # the official client refuses this itself; the broker refuses it too
            with pytest.raises(NotAllowed):
                await ours.subscribe(TOPIC, "s", subscription_type="shared", read_compacted=True)
            topic = broker.service.loaded_topic(TOPIC)
            assert topic is not None
            running = broker.service.compactions.of(topic)
            await running.trigger()
            with pytest.raises(AdminHttpError) as err:
                await admin.compact(TOPIC)
            await running.wait()
            assert running.status == "SUCCESS"
            # our client's compacted reader: one message per key, the latest
            reader = await ours.create_reader(TOPIC, "earliest", read_compacted=True)
            seen = [await reader.read_next(timeout=5) for _ in range(50)]
            await reader.close()
    assert official == "InvalidConfiguration"  # as the client does against Pulsar
    assert err.value.status == 409
    assert all(m is not None for m in seen)
    assert {m.key: m.value for m in seen if m is not None} == dict(pairs)


async def test_a_crash_mid_compaction_leaves_the_previous_view_in_force(tmp_path: Path) -> None:
    """SIGKILL after the next compacted ledger is written and before the switch: after a
    restart the first compaction's view (and then the tail) is what compacted readers
    see, and the next run succeeds over the leftover ledger."""
    first = history()
    second = [(f"k{i}", b"second-%d" % i) for i in range(4)]
    broker = BrokerProcess(tmp_path / "data")
    await broker.start()
    try:
        async with AdminClient(f"http://127.0.0.1:{broker.http_port}") as admin:
            await run(lambda: _produce_at(broker.service_url, first))
            await compact(admin)
            await run(lambda: _produce_at(broker.service_url, second))
        broker.kill()
        broker.failpoints = COMPACTION_CRASH_BEFORE_SWITCH
        await broker.start()
        async with AdminClient(f"http://127.0.0.1:{broker.http_port}") as admin:
            await admin.compact(TOPIC)
            assert broker.process is not None
            code = await asyncio.to_thread(broker.process.wait, HANG_GUARD_S)
        assert code == -signal.SIGKILL  # the failpoint's crash, before the switch
        broker.failpoints = ""
        await broker.start()

        def reads() -> list[tuple[str, bytes]]:
            with client(broker.service_url) as c:
                return read_all(c)

        after_crash = await run(reads)
        async with AdminClient(f"http://127.0.0.1:{broker.http_port}") as admin:
            assert (await admin.compaction_status(TOPIC))["status"] == "SUCCESS"
            await compact(admin)
        recompacted = await run(reads)
    finally:
        await broker.stop()
    view = expected(first)
    assert dict(after_crash[: len(view)]) == view  # the first view, whole
    assert after_crash[len(view) :] == second  # then the tail after its horizon
    assert dict(recompacted) == view | dict(second)
    assert len(recompacted) == len(view | dict(second))


async def test_a_durable_compacted_subscription_resumes_after_a_restart(tmp_path: Path) -> None:
    """A Failover consumer acknowledges part of the compacted view; after a broker restart
    the subscription goes on from there through the rest of the view and the tail."""
    pairs = history()
    tail = [("k2", b"tail-1"), ("k9", b"tail-2")]

    def consume(url: str, count: int, ack_upto: int) -> list[tuple[str, bytes]]:
        with client(url) as c:
            consumer = c.subscribe(
                TOPIC, "table", is_read_compacted=True,
                initial_position=pulsar.InitialPosition.Earliest,
                consumer_type=pulsar.ConsumerType.Failover,
            )  # fmt: skip
            got = []
            for i in range(count):
                msg = consumer.receive(5000)
                got.append((msg.partition_key(), msg.data()))
                if i + 1 == ack_upto:
                    consumer.acknowledge_cumulative(msg)
            consumer.close()
            return got

    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        AdminClient(http(broker)) as admin,
    ):
        await run(lambda: _produce_at(broker.service_url, pairs))
        await compact(admin)
        await run(lambda: _produce_at(broker.service_url, tail))
        head = await run(lambda: consume(broker.service_url, 4, 4))
    view = len(expected(pairs))
    async with InProcessBroker(tmp_path, metadata="sqlite") as broker:
        rest = await run(lambda: consume(broker.service_url, view - 4 + len(tail), 0))
    assert dict(head + rest[: view - 4]) == expected(pairs)
    assert len(head + rest) == view + len(tail)  # nothing twice, nothing missing
    assert rest[view - 4 :] == tail


CHUNK_MAX = 64 * 1024
"""The broker's max_message_size in the chunking test: the client cuts chunks of this."""


async def test_chunked_messages_are_compacted_whole(tmp_path: Path) -> None:
    """A chunked message is one message: the latest value of a key survives with every
    one of its chunks, an older one goes with all of its chunks."""
    big = {tag: bytes([tag]) * (3 * CHUNK_MAX + 77) for tag in range(3)}
    pairs = [("k1", big[0]), ("k2", big[1]), ("k3", b"small"), ("k1", big[2])]

    def produce_chunked(url: str) -> None:
        with client(url) as c:
            producer = c.create_producer(TOPIC, chunking_enabled=True, batching_enabled=False)
            for key, value in pairs:
                producer.send(value, partition_key=key)
            producer.close()

    async with (
        InProcessBroker(tmp_path, max_message_size=CHUNK_MAX) as broker,
        AdminClient(http(broker)) as admin,
    ):
        await run(lambda: produce_chunked(broker.service_url))
        await compact(admin)

        def reads() -> list[tuple[str, bytes]]:
            with client(broker.service_url) as c:
                return read_all(c)

        compacted = await run(reads)
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None and topic.compaction is not None
        view = await topic.compaction.view()
    assert compacted == [("k2", big[1]), ("k3", b"small"), ("k1", big[2])]
    assert view is not None and view.entries == 4 + 4 + 1  # two 4-chunk messages + one


async def test_a_partitioned_topic_compacts_each_partition(tmp_path: Path) -> None:
    name = "persistent://public/default/parted"
    pairs = [(f"k{i % 6}", b"v%d" % i) for i in range(60)]

    def work(url: str) -> list[tuple[str, bytes]]:
        with client(url) as c:
            consumer = c.subscribe(
                name, "table", is_read_compacted=True,
                initial_position=pulsar.InitialPosition.Earliest,
            )  # fmt: skip
            got = []
            for _ in range(6):
                msg = consumer.receive(5000)
                got.append((msg.partition_key(), msg.data()))
            consumer.close()
            return got

    def produce_parted(url: str) -> None:
        with client(url) as c:
            producer = c.create_producer(name, batching_enabled=False)
            for key, value in pairs:
                producer.send(value, partition_key=key)
            producer.close()

    async with InProcessBroker(tmp_path) as broker, AdminClient(http(broker)) as admin:
        await admin.create_partitioned_topic(name, 2)
        await run(lambda: produce_parted(broker.service_url))
        await admin.compact(name)  # each partition

        async def both_done() -> bool:
            states = [
                (await admin.compaction_status(f"{name}-partition-{i}"))["status"] for i in range(2)
            ]
            return states == ["SUCCESS", "SUCCESS"]

        await until(both_done, "both partitions compacted")
        got = await run(lambda: work(broker.service_url))
    assert sorted(got) == sorted(expected(pairs).items())


async def test_deleting_a_topic_deletes_its_compacted_view(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker, AdminClient(http(broker)) as admin:
        await run(lambda: _produce_at(broker.service_url, history()))
        await compact(admin)
        records = await broker.service.store.list_children("/compaction")
        before = await broker.service.store.list_children("/managed-ledgers")
        await admin.delete_topic(TOPIC, force=True)
        after = await broker.service.store.list_children("/compaction")
        ledgers = await broker.service.store.list_children("/managed-ledgers")
        await run(lambda: _produce_at(broker.service_url, [("k1", b"new life")]))
        await compact(admin)

        def reads() -> list[tuple[str, bytes]]:
            with client(broker.service_url) as c:
                return read_all(c)

        again = await run(reads)
    assert len(records) == 1 and after == []
    assert [name for name in before if "__compacted" in name]
    assert not [name for name in ledgers if "__compacted" in name]  # its ledger went too
    assert again == [("k1", b"new life")]  # a new topic of that name starts from nothing


async def test_compacted_reads_resume_over_ledgers_retention_deleted(tmp_path: Path) -> None:
    """The compacted view keeps ids of ledgers that retention deleted since: a consumer
    that reconnects, and a reader that starts from an id there, go on through the view
    without skipping to the first ledger still stored."""
    # k0's last value is the 8th message, k1's the 16th, ...: spread over many ledgers
    pairs = [(f"k{i // 8}", b"v%d" % i) for i in range(40)]
    view = expected(pairs)

    def drain_all(url: str) -> None:
        with client(url) as c:
            consumer = c.subscribe(TOPIC, "drain", initial_position=pulsar.InitialPosition.Earliest)
            for _ in range(len(pairs)):
                consumer.acknowledge(consumer.receive(5000))
            consumer.close()

    def resume(url: str) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
        with client(url) as c:

            def subscribe() -> pulsar.Consumer:
                return c.subscribe(
                    TOPIC, "table", is_read_compacted=True,
                    initial_position=pulsar.InitialPosition.Earliest,
                )  # fmt: skip

            consumer = subscribe()
            first = [consumer.receive(5000) for _ in range(2)]
            consumer.acknowledge_cumulative(first[-1])
            consumer.close()
            consumer = subscribe()  # goes on after the acknowledged one
            rest = [consumer.receive(5000) for _ in range(len(view) - 2)]
            consumer.close()
            reader = c.create_reader(TOPIC, first[0].message_id(), is_read_compacted=True)
            after_first = []
            while reader.has_message_available():
                after_first.append(reader.read_next(5000))
            reader.close()
            as_pairs = [(m.partition_key(), m.data()) for m in first + rest]
            return as_pairs, [(m.partition_key(), m.data()) for m in after_first]

    def produce_one_by_one(url: str) -> None:
        with client(url) as c:
            producer = c.create_producer(TOPIC, batching_enabled=False)
            for key, value in pairs:
                producer.send(value, partition_key=key)  # one append each: small ledgers
            producer.close()

    async with (
        InProcessBroker(tmp_path, managed_ledger_max_entries_per_ledger=5) as broker,
        AdminClient(http(broker)) as admin,
    ):
        await run(lambda: produce_one_by_one(broker.service_url))
        await compact(admin)
        await run(lambda: drain_all(broker.service_url))
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None
        await broker.service.sweeps.sweep_retention()
        kept = [i.ledger_id for i in topic.ledger.ledgers]  # type: ignore[attr-defined]
        view_ledgers = {e.position[0] for e, _ in await topic.compaction.read(EARLIEST, 100)}
        consumed, from_reader = await run(lambda: resume(broker.service_url))
    assert len(view_ledgers - set(kept)) >= 3  # the view points into deleted ledgers
    assert consumed == list(view.items())  # in order, each once, none skipped
    assert from_reader == consumed[1:]


async def test_compaction_on_the_jetstream_backend_survives_a_restart(tmp_path: Path) -> None:
    """The compacted ledger is a managed ledger of the topic's backend: on JetStream it is
    a stream too, and the view is there after a restart."""
    nats = NatsCluster.start(tmp_path / "nats", nodes=1)
    try:
        options: dict[str, Any] = {
            "metadata": "sqlite",
            "storage": "jetstream",
            "jetstream_urls": nats.urls,
            "jetstream_replicas": 1,
        }
        pairs = history()
        async with (
            InProcessBroker(tmp_path / "broker", **options) as broker,
            AdminClient(http(broker)) as admin,
        ):
            await run(lambda: _produce_at(broker.service_url, pairs, "batched"))
            await compact(admin)
        async with InProcessBroker(tmp_path / "broker", **options) as broker:

            def reads() -> list[tuple[str, bytes]]:
                with client(broker.service_url) as c:
                    return read_all(c)

            compacted = await run(reads)
    finally:
        nats.stop()
    assert dict(compacted) == expected(pairs) and len(compacted) == len(expected(pairs))
    assert not any((tmp_path / "broker" / "ledgers").rglob("*.log"))  # all in JetStream


async def test_producing_goes_on_through_compaction_and_the_compacted_read(
    tmp_path: Path,
) -> None:
    """A producer keeps sending while the topic is compacted and while a compacted consumer
    reads: the consumer gets the latest value of each key up to the horizon, then every
    message after it, in order, each once."""
    total = 1000
    sent: list[tuple[tuple[int, int], str, bytes]] = []

    def produce_all(url: str) -> None:
        with client(url) as c:
            producer = c.create_producer(TOPIC, batching_enabled=False)
            for i in range(total):
                key, value = f"k{i % 7}", b"%d" % i
                mid = producer.send(value, partition_key=key)
                sent.append(((mid.ledger_id(), mid.entry_id()), key, value))
            producer.close()

    def consume_all(url: str) -> list[tuple[str, bytes]]:
        with client(url) as c:
            consumer = c.subscribe(
                TOPIC, "table", is_read_compacted=True,
                initial_position=pulsar.InitialPosition.Earliest,
            )  # fmt: skip
            got: list[tuple[str, bytes]] = []
            while not got or got[-1][1] != b"%d" % (total - 1):
                msg = consumer.receive(10_000)
                got.append((msg.partition_key(), msg.data()))
                consumer.acknowledge_cumulative(msg)
            consumer.close()
            return got

    async with InProcessBroker(tmp_path) as broker, AdminClient(http(broker)) as admin:
        producing = asyncio.ensure_future(run(lambda: produce_all(broker.service_url)))

        async def some_sent() -> bool:
            return len(sent) >= 100

        await until(some_sent, "the producer got going")
        await compact(admin)  # while producing goes on
        sent_at_switch = len(sent)
        consumed = await run(lambda: consume_all(broker.service_url))
        await producing
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None and topic.compaction is not None
        horizon = await topic.compaction.horizon()
    assert horizon is not None and sent_at_switch < total  # compacted mid-stream
    latest: dict[str, tuple[tuple[int, int], bytes]] = {}
    for position, key, value in sent:
        if position <= tuple(horizon):
            latest[key] = (position, value)
    view = [(k, v) for k, (_, v) in sorted(latest.items(), key=lambda kv: kv[1][0])]
    tail = [(k, v) for position, k, v in sent if position > tuple(horizon)]
    assert len(view) == 7 and len(tail) > 0
    assert consumed == view + tail  # the view, then the tail: no gap, nothing twice


async def test_a_reader_ends_when_the_topic_ends_with_a_tombstone(tmp_path: Path) -> None:
    """The topic's last entry is compacted away: GET_LAST_MESSAGE_ID answers a compacted
    reader with the view's last message, so hasMessageAvailable turns false once that was
    read (else the reader would wait for an entry it never gets); an empty view ends at once."""
    async with InProcessBroker(tmp_path) as broker, AdminClient(http(broker)) as admin:
        await run(lambda: _produce_at(broker.service_url, [("a", b"1"), ("b", b"2"), ("b", b"")]))
        await compact(admin)

        def reads() -> list[tuple[str, bytes]]:
            with client(broker.service_url) as c:
                return read_all(c)

        ends_with_a = await run(reads)
        await run(lambda: _produce_at(broker.service_url, [("a", b"")]))
        await compact(admin)
        empty = await run(reads)
    assert ends_with_a == [("a", b"1")]
    assert empty == []

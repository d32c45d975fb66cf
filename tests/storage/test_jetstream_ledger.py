"""The JetStream ledger backend under fencing and crashes, on real NATS clusters.

Each test that kills servers starts its own 3-node cluster (R3, ``sync_interval: always``)
in its temp dir; the fence tests share one per module.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from anabranch.errors import CorruptRecord, LedgerFenced, StorageIOError
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig, Position
from anabranch.storage.jetstream_client import (
    ApiError,
    NatsAuthError,
    ReplyTimeout,
    StreamNotFound,
)
from anabranch.storage.jetstream_ledger import (
    JetStreamManagedLedger,
    JetStreamManagedLedgerFactory,
)
from anabranch.testing.nats import NatsCluster
from anabranch.testing.ports import free_port

_prefixes = itertools.count()
BIG = ManagedLedgerConfig(ledger_entries_max=100_000)


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    cluster = NatsCluster.start(tmp_path_factory.mktemp("nats"), nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()


def _factory(
    cluster: NatsCluster, store: MemoryMetadataStore, prefix: str
) -> JetStreamManagedLedgerFactory:
    return JetStreamManagedLedgerFactory(
        cluster.urls, store, prefix=prefix, tail_cache_bytes=0, api_timeout_s=2.0
    )


async def _read_all(ml: JetStreamManagedLedger) -> dict[Position, bytes]:
    out: dict[Position, bytes] = {}
    position = EARLIEST
    while True:
        entries = await ml.read(position, max_entries=1000)
        if not entries:
            return out
        for entry in entries:
            out[entry.position] = entry.data
        position = entries[-1].position.next()


async def test_second_opener_fences_a_writer_with_appends_in_flight(
    shared_cluster: NatsCluster, store: MemoryMetadataStore
) -> None:
    prefix = f"f{next(_prefixes)}"
    first_factory = _factory(shared_cluster, store, prefix)
    second_factory = _factory(shared_cluster, store, prefix)
    try:
        first = await first_factory.open("t", BIG)
        acked: dict[Position, bytes] = {}
        failures: list[BaseException] = []
        enough = asyncio.Event()

        async def produce(worker: int) -> None:
            for i in itertools.count():
                data = f"w{worker}-{i}".encode()
                try:
                    acked[await first.append(data)] = data
                except LedgerFenced as err:
                    failures.append(err)
                    return
                if len(acked) >= 300:
                    enough.set()

        producers = [asyncio.ensure_future(produce(w)) for w in range(8)]
        await enough.wait()
        second = await second_factory.open("t", BIG)  # recovery: the fence
        await asyncio.gather(*producers)
        assert len(failures) == 8  # every producer met the fence, none hung
        stored = await _read_all(second)
        for position, data in acked.items():  # every acknowledged append survived
            assert stored[position] == data
        # Nothing unacknowledged is visible as part of the old ledger beyond what was stored
        # contiguously, and the new owner appends after it.
        assert len(stored) >= len(acked)
        new = await second.append(b"new owner")
        assert new > max(stored)
        with pytest.raises(LedgerFenced):
            await first.append(b"stale")
    finally:
        await first_factory.close()
        await second_factory.close()


async def test_concurrent_openers_one_wins(
    shared_cluster: NatsCluster, store: MemoryMetadataStore
) -> None:
    prefix = f"f{next(_prefixes)}"
    factories = [_factory(shared_cluster, store, prefix) for _ in range(4)]
    try:
        seed = await factories[0].open("t", BIG)
        await seed.append(b"seed")
        results = await asyncio.gather(
            *(f.open("t", BIG) for f in factories[1:]), return_exceptions=True
        )
        opened = [r for r in results if isinstance(r, JetStreamManagedLedger)]
        assert opened, results
        assert all(isinstance(r, (JetStreamManagedLedger, LedgerFenced)) for r in results)
        # Exactly one opener can still append: the one that holds the record and whose
        # marker is the stream's last fence; every other one is fenced.
        outcomes = await asyncio.gather(
            *(ml.append(b"x") for ml in [seed, *opened]), return_exceptions=True
        )
        winners = [o for o in outcomes if isinstance(o, Position)]
        assert len(winners) == 1, outcomes
        assert all(isinstance(o, LedgerFenced) for o in outcomes if not isinstance(o, Position))
    finally:
        for f in factories:
            await f.close()


async def test_orphan_marker_of_a_dead_opener_ends_the_previous_ledger(
    shared_cluster: NatsCluster, store: MemoryMetadataStore
) -> None:
    """An opener that appended its marker and died before recording it: the writer it
    fenced stays fenced, and the next opener counts the previous ledger up to that marker."""
    prefix = f"f{next(_prefixes)}"
    factory = _factory(shared_cluster, store, prefix)
    again = _factory(shared_cluster, store, prefix)
    try:
        ml = await factory.open("t", BIG)
        positions = [await ml.append(b"e%d" % i) for i in range(5)]
        client = await factory.client()
        last = await client.last_seq(ml.stream)
        await client.publish_one(f"{ml.stream}.m.999999", b"{}", expected_last_seq=last)
        with pytest.raises(LedgerFenced):
            await ml.append(b"after the orphan marker")
        recovered = await again.open("t", BIG)
        stored = await _read_all(recovered)
        assert list(stored) == positions
        assert recovered.entry_count == 5
        assert (await recovered.append(b"next")) > positions[-1]
    finally:
        await factory.close()
        await again.close()


async def test_terminate_seals_the_stream(
    shared_cluster: NatsCluster, store: MemoryMetadataStore
) -> None:
    factory = _factory(shared_cluster, store, f"f{next(_prefixes)}")
    try:
        ml = await factory.open("t", ManagedLedgerConfig(ledger_entries_max=2))
        positions = [await ml.append(b"e%d" % i) for i in range(5)]
        cursor = await ml.open_cursor("c", EARLIEST)
        assert await ml.terminate() == positions[-1]
        client = await factory.client()
        info = await client.stream_info(ml.stream)
        assert info["config"]["sealed"] is True
        with pytest.raises(ApiError, match="sealed"):
            await client.publish_batch(
                f"{ml.stream}.e", [b"x"], expected_last_seq=int(info["state"]["last_seq"])
            )
        await cursor.acknowledge_cumulative(positions[-1])
        assert await ml.trim() == 2  # the record drops the ledgers; the stream keeps them
        assert [e.position for e in await ml.read(EARLIEST, 100)] == positions[4:]
        await ml.delete()
        # NATS may leave an INFO for a stream it is deleting unanswered (seen once in CI:
        # no reply in 5 s); asked again, it says the stream is gone.
        for attempt in range(3):
            try:
                with pytest.raises(StreamNotFound):
                    await client.stream_info(ml.stream, timeout_s=2.0)
                break
            except ReplyTimeout:
                if attempt == 2:
                    raise
    finally:
        await factory.close()


async def test_a_message_deleted_behind_our_back_is_a_corrupt_record(
    shared_cluster: NatsCluster, store: MemoryMetadataStore
) -> None:
    """Never serve around a hole: entries before it are served, the hole itself raises."""
    factory = _factory(shared_cluster, store, f"f{next(_prefixes)}")
    try:
        ml = await factory.open("t", BIG)
        positions = [await ml.append(b"e%d" % i) for i in range(5)]
        client = await factory.client()
        marker = (await client.last_seq(ml.stream)) - 5
        await client.api(f"$JS.API.STREAM.MSG.DELETE.{ml.stream}", {"seq": marker + 3})
        assert [e.position for e in await ml.read(EARLIEST, 10)] == positions[:2]
        with pytest.raises(CorruptRecord):
            await ml.read(positions[2], 10)
        assert [e.data for e in await ml.read(positions[3], 10)] == [b"e3", b"e4"]
    finally:
        await factory.close()


async def test_stream_deleted_behind_our_back_fences(
    shared_cluster: NatsCluster, store: MemoryMetadataStore
) -> None:
    factory = _factory(shared_cluster, store, f"f{next(_prefixes)}")
    try:
        ml = await factory.open("t", BIG)
        await ml.append(b"a")
        client = await factory.client()
        await client.delete_stream(ml.stream)
        with pytest.raises(LedgerFenced):
            await ml.append(b"b")
    finally:
        await factory.close()


async def test_unreachable_nats_is_a_clear_error(store: MemoryMetadataStore) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    factory = JetStreamManagedLedgerFactory([url], store, connect_timeout_s=0.5)
    with pytest.raises(StorageIOError, match="cannot reach NATS JetStream at nats://127"):
        await factory.open("t")
    await factory.close()


async def test_credentials(tmp_path: Path, store: MemoryMetadataStore) -> None:
    cluster = NatsCluster.start(tmp_path / "nats", nodes=1, auth=("broker", "s3cret"))
    good = JetStreamManagedLedgerFactory(
        cluster.urls, store, replicas=1, user="broker", password="s3cret"
    )
    bad = JetStreamManagedLedgerFactory(
        cluster.urls, store, replicas=1, user="broker", password="wrong", connect_timeout_s=20
    )
    try:
        ml = await good.open("t", BIG)
        assert (await ml.append(b"x")).entry_id == 0
        started = asyncio.get_running_loop().time()
        with pytest.raises(NatsAuthError, match="refused our credentials") as caught:
            await bad.open("t", BIG)
        assert "wrong" not in str(caught.value)  # never a credential in a message
        assert asyncio.get_running_loop().time() - started < 10  # no retrying a refusal
    finally:
        await good.close()
        await bad.close()
        cluster.stop()


async def _produce_through(
    ml: JetStreamManagedLedger, crash: object, workers: int = 16, total: int = 1500
) -> tuple[dict[Position, bytes], list[BaseException]]:
    """Appends from ``workers`` tasks; runs ``crash()`` in a thread once a third is
    acknowledged; returns what was acknowledged and what failed."""
    acked: dict[Position, bytes] = {}
    failures: list[BaseException] = []
    counter = itertools.count()
    third = asyncio.Event()

    async def produce(worker: int) -> None:
        while True:
            i = next(counter)
            if i >= total:
                return
            data = f"w{worker}-{i}".encode()
            try:
                acked[await ml.append(data)] = data
            except Exception as err:
                failures.append(err)
                return
            if len(acked) >= total // 3:
                third.set()

    producers = [asyncio.ensure_future(produce(w)) for w in range(workers)]
    await third.wait()
    assert callable(crash)
    await asyncio.to_thread(crash)
    await asyncio.gather(*producers)
    return acked, failures


@pytest.mark.slow
async def test_killing_the_stream_leader_loses_no_acknowledged_append(
    tmp_path: Path, store: MemoryMetadataStore
) -> None:
    cluster = NatsCluster.start(tmp_path / "nats", nodes=3)
    factory = JetStreamManagedLedgerFactory(cluster.urls, store, api_timeout_s=2.0)
    reader = JetStreamManagedLedgerFactory(cluster.urls, store, tail_cache_bytes=0)
    try:
        ml = await factory.open("t", BIG)
        leader = cluster.stream_leader(ml.stream)
        acked, failures = await _produce_through(ml, leader.kill)
        assert failures == []  # the writer rode out the election: nothing failed
        assert len(acked) == 1500
        assert cluster.stream_leader(ml.stream).name != leader.name
        await factory.close()
        cluster.start_node(leader.name)
        recovered = await reader.open("t", BIG)
        stored = await _read_all(recovered)
        lost = [p for p in acked if stored.get(p) != acked[p]]
        assert lost == []
        assert len(stored) == len(acked)
    finally:
        await factory.close()
        await reader.close()
        cluster.stop()


async def test_single_node_restart_keeps_the_ledger(
    tmp_path: Path, store: MemoryMetadataStore
) -> None:
    """R1 on one node: a clean restart of the server (same store dir) keeps every entry."""
    cluster = NatsCluster.start(tmp_path / "nats", nodes=1)
    factory = JetStreamManagedLedgerFactory(cluster.urls, store, replicas=1)
    reader = JetStreamManagedLedgerFactory(cluster.urls, store, replicas=1, tail_cache_bytes=0)
    try:
        ml = await factory.open("t", BIG)
        positions = await ml.append_many([b"a", b"b", b"c"])
        await factory.close()
        await asyncio.to_thread(cluster.restart, "n1")
        recovered = await reader.open("t", BIG)
        assert [(e.position, e.data) for e in await recovered.read(EARLIEST, 10)] == list(
            zip(positions, [b"a", b"b", b"c"], strict=True)
        )
    finally:
        await factory.close()
        await reader.close()
        cluster.stop()


@pytest.mark.slow
async def test_pausing_the_stream_leader_loses_no_acknowledged_append(
    tmp_path: Path, store: MemoryMetadataStore
) -> None:
    """SIGSTOP of the stream leader: publishes go unanswered (timeouts, outcome unknown),
    the writer reads back instead of trusting deduplication, and after the resume every
    acknowledged append is stored exactly once at its position."""
    cluster = NatsCluster.start(tmp_path / "nats", nodes=3)
    factory = JetStreamManagedLedgerFactory(cluster.urls, store, api_timeout_s=1.0)
    reader = JetStreamManagedLedgerFactory(cluster.urls, store, tail_cache_bytes=0)
    paused = None
    try:
        ml = await factory.open("t", BIG)
        paused = cluster.stream_leader(ml.stream)

        def pause_then_resume() -> None:
            assert paused is not None
            paused.pause()
            time.sleep(4.0)
            paused.resume()

        acked, failures = await _produce_through(ml, pause_then_resume)
        assert failures == []
        assert len(acked) == 1500
        await factory.close()
        recovered = await reader.open("t", BIG)
        stored = await _read_all(recovered)
        assert [p for p in acked if stored.get(p) != acked[p]] == []
        assert len(stored) == len(acked)  # no batch stored twice
    finally:
        if paused is not None:
            paused.resume()
        await factory.close()
        await reader.close()
        cluster.stop()


@pytest.mark.slow
async def test_killing_every_node_loses_no_acknowledged_append(
    tmp_path: Path, store: MemoryMetadataStore
) -> None:
    cluster = NatsCluster.start(tmp_path / "nats", nodes=3)
    factory = JetStreamManagedLedgerFactory(
        cluster.urls, store, api_timeout_s=1.0, append_timeout_s=2.0
    )
    reader = JetStreamManagedLedgerFactory(cluster.urls, store, tail_cache_bytes=0)
    try:
        ml = await factory.open("t", BIG)
        acked, failures = await _produce_through(ml, cluster.kill)
        # With every node dead, in-flight appends fail (unacknowledged) once their
        # retry budget runs out; what was acknowledged must all come back.
        assert len(acked) >= 500
        assert all(isinstance(f, StorageIOError) for f in failures)
        for node in cluster.nodes:
            cluster.start_node(node.name)
        await asyncio.to_thread(cluster.wait_ready)
        recovered = await reader.open("t", BIG)
        stored = await _read_all(recovered)
        lost = [p for p in acked if stored.get(p) != acked[p]]
        assert lost == []
    finally:
        await factory.close()
        await reader.close()
        cluster.stop()

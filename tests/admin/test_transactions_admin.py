"""Transaction admin endpoints, CLI and ``anabranch_txn_*`` metrics against a real broker.

Transactions are made over the wire with our client (a transactional send and a
transactional ack), or through the in-process broker's coordinator object where only a
header is needed (the CLI test, whose broker runs on another thread's loop).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from anabranch.admin import routes_transactions
from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.cli.main import app
from anabranch.errors import InvalidTxnStatus
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.cluster import LocalCluster
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import TxnState

T = TypeVar("T")
TOPIC = "persistent://public/default/txn-admin"
SHORT = TOPIC.removeprefix("persistent://")
SUB = "billing"
V2 = "/admin/v2/transactions"
V3 = "/admin/v3/transactions"
RECEIVE_S = 5.0
runner = CliRunner()


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


@pytest.fixture
async def admin(broker: InProcessBroker) -> AsyncIterator[AdminClient]:
    assert broker.http_url is not None
    async with AdminClient(broker.http_url) as client:
        yield client


async def status_of(call: Awaitable[Any]) -> int:
    with pytest.raises(AdminHttpError) as info:
        await call
    return info.value.status


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every ``anabranch_txn_*`` sample: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("anabranch_txn_"):
                key = (sample.name, tuple(sorted(sample.labels.items())))
                out[key] = sample.value
    return out


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:  # fmt: skip
    return found[(name, tuple(sorted({"cluster": "standalone", **labels}.items())))]


async def test_a_transaction_seen_through_every_endpoint_and_metric(
    broker: InProcessBroker, admin: AdminClient
) -> None:
    before = samples(await admin.metrics())
    client = Client(broker.service_url)
    try:
        producer = await client.create_producer(TOPIC)
        consumer = await client.subscribe(TOPIC, SUB, initial_position="earliest")
        await producer.send(b"plain")
        plain = await consumer.receive(timeout=RECEIVE_S)
        assert plain is not None
        txn = await client.new_transaction(timeout=300)
        await producer.send(b"in-txn", txn=txn)
        await consumer.acknowledge(plain, txn=txn)
        txn_id = TxnId(*txn.id)
        most, least = txn_id

        stats = await admin.coordinator_stats()
        assert stats["partitions"] == broker.service.config.transaction_partitions
        assert stats["created"] == 1 and stats["open"] == 1 and stats["committed"] == 0
        partition = stats["perPartition"][str(most)]
        assert partition["open"] == 1 and partition["state"] == "Ready"
        assert await admin.coordinator_stats(most) == partition
        assert await admin.request("GET", f"{V3}/coordinatorStats?coordinatorId={most}") == (
            partition
        )

        meta = await admin.transaction_metadata(most, least)
        assert meta["txnId"] == str(txn_id) and meta["status"] == "OPEN"
        assert meta["timeoutAt"] > meta["openTimestamp"]
        assert TOPIC in meta["producedPartitions"]
        assert SUB in meta["ackedPartitions"][TOPIC]
        assert meta["opRecords"] == 2
        assert await admin.request("GET", f"{V3}/transactionMetadata/{most}/{least}") == meta

        slow = await admin.slow_transactions(0)
        assert list(slow) == [str(txn_id)] and slow[str(txn_id)]["status"] == "OPEN"
        assert await admin.slow_transactions(0, coordinator_id=most) == slow
        other = (most + 1) % stats["partitions"]
        assert await admin.slow_transactions(0, coordinator_id=other) == {}
        assert await admin.slow_transactions(3_600_000) == {}

        buffer = await admin.transaction_buffer_stats(TOPIC)
        assert buffer["state"] == "Ready" and buffer["ongoingTxnSize"] == 1
        assert buffer["opWrites"] == 1
        assert buffer["maxReadPosition"] != buffer["lastConfirmed"]  # the open txn pins it
        assert await admin.transaction_buffer_stats("txn-admin") == buffer  # short name
        pending = await admin.pending_ack_stats(TOPIC, SUB)
        assert pending["state"] == "Ready" and pending["ongoingTxnSize"] == 1
        assert pending["opWrites"] == 1

        during = samples(await admin.metrics())
        assert value(during, "anabranch_txn_active_count") == 1
        assert value(during, "anabranch_txn_metadata_store_op_writes_total") == 2
        assert value(during, "anabranch_txn_metadata_store_outstanding_op_records") >= 2

        await txn.commit()
        assert (await admin.transaction_metadata(most, least))["status"] == "COMMITTED"
        assert await admin.slow_transactions(0) == {}
        assert (await admin.coordinator_stats())["committed"] == 1
        after = samples(await admin.metrics())
    finally:
        await client.close()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("anabranch_txn_created_total") == 1
    assert delta("anabranch_txn_committed_total") == 1
    assert delta("anabranch_txn_aborted_total") == 0
    assert delta("anabranch_txn_metadata_store_header_cas_total", result="ok") == 1
    assert delta("anabranch_txn_commit_latency_seconds_count") == 1
    assert value(after, "anabranch_txn_commit_latency_seconds_bucket", le="+Inf") == 1
    assert value(after, "anabranch_txn_active_count") == 0
    assert value(after, "anabranch_txn_metadata_store_op_writes_total") == 2
    for result in ("conflict", "reject"):
        assert value(after, "anabranch_txn_metadata_store_header_cas_total", result=result) == 0


async def test_abort_timeout_and_reject_counters(
    broker: InProcessBroker, admin: AdminClient
) -> None:
    tc = broker.service.txn_coordinator
    assert tc is not None
    aborted = await tc.new_txn(60_000)
    await tc.end_txn(aborted, TxnState.ABORTED)
    assert (await admin.transaction_metadata(*aborted))["status"] == "ABORTED"
    with pytest.raises(InvalidTxnStatus):
        await tc.end_txn(aborted, TxnState.COMMITTED)
    found = samples(await admin.metrics())
    assert value(found, "anabranch_txn_aborted_total") == 1
    assert value(found, "anabranch_txn_metadata_store_header_cas_total", result="reject") == 1
    assert value(found, "anabranch_txn_timeout_total") == 0


async def test_bad_and_unknown_requests(broker: InProcessBroker, admin: AdminClient) -> None:
    partitions = broker.service.config.transaction_partitions
    assert await status_of(admin.transaction_metadata(0, 987_654)) == 404
    assert await status_of(admin.transaction_metadata(partitions, 0)) == 404
    for path in (
        f"{V2}/transactionMetadata/x/1",
        f"{V2}/transactionMetadata/0/-1",
        f"{V2}/transactionMetadata/-1/0",
        f"{V3}/transactionMetadata/0/{2**64}",
        f"{V2}/slowTransactions/soon",
        f"{V2}/slowTransactions/-5",
        f"{V2}/coordinatorStats?coordinatorId=abc",
        f"{V2}/coordinatorStats?coordinatorId=-1",
    ):
        assert await status_of(admin.request("GET", path)) == 400, path
    with pytest.raises(AdminHttpError) as info:
        await admin.request("GET", f"{V2}/transactionMetadata/0/987654")
    assert "not found" in info.value.reason and "Traceback" not in info.value.reason
    assert await status_of(admin.coordinator_stats(partitions)) == 404
    assert await status_of(admin.transaction_buffer_stats("public/default/nope")) == 404
    await admin.create_topic(TOPIC)
    assert await status_of(admin.pending_ack_stats(TOPIC, "nope")) == 404
    assert await status_of(admin.transaction_buffer_stats("public/nope/t")) == 404
    assert await status_of(admin.request("GET", f"{V2}/transactionBufferStats/x//y")) == 404


async def test_segment_topics(broker: InProcessBroker, admin: AdminClient) -> None:
    await admin.create_scalable_topic("topic://public/default/scaled", 1)
    await admin.create_scalable_subscription("topic://public/default/scaled", SUB)
    stats = await admin.scalable_stats("topic://public/default/scaled")
    segment = stats["segments"]["0"]["name"]
    assert segment.startswith("segment://public/default/scaled/")
    unloaded = f"{segment[: segment.rindex('-')]}-7"
    assert await status_of(admin.transaction_buffer_stats(unloaded)) == 404
    assert broker.service.loaded_topic(segment) is not None  # created and served here
    buffer = await admin.transaction_buffer_stats(segment)
    assert buffer["state"] == "Ready" and buffer["ongoingTxnSize"] == 0
    pending = await admin.pending_ack_stats(segment, SUB)
    assert pending["state"] == "Ready" and pending["ongoingTxnSize"] == 0
    path = segment.removeprefix("segment://")
    assert await admin.request("GET", f"{V3}/transactionBufferStats/segment/{path}") == buffer
    assert await status_of(admin.pending_ack_stats(segment, "nope")) == 404


async def test_openapi_lists_both_prefixes(admin: AdminClient) -> None:
    doc = await admin.openapi()
    for prefix in (V2, V3):
        for path in (
            "/coordinatorStats",
            "/transactionMetadata/{mostSigBits}/{leastSigBits}",
            "/slowTransactions/{timeout}",
            "/transactionBufferStats/{tenant}/{namespace}/{topic}",
            "/transactionBufferStats/segment/{tenant}/{namespace}/{topic}/{descriptor}",
            "/pendingAckStats/{tenant}/{namespace}/{topic}/{subName}",
            "/pendingAckStats/segment/{tenant}/{namespace}/{topic}/{descriptor}/{subName}",
        ):
            operation = doc["paths"][prefix + path]["get"]
            assert operation["tags"] == ["transactions"]
            assert "503" in operation["responses"]
    ids = [
        op["operationId"]
        for path, ops in doc["paths"].items()
        if "/transactions/" in path
        for op in ops.values()
    ]
    # 7 read routes under each prefix, plus the key and sink-batch routes (unique ids).
    assert len(ids) == len(set(ids)) == len(routes_transactions.ROUTES)


async def test_transactions_disabled_answer_503(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, ledgers="memory", transactions_enabled=False) as b:
        assert b.http_url is not None
        async with AdminClient(b.http_url) as admin:
            await admin.create_topic(TOPIC)
            await admin.create_subscription(TOPIC, SUB)
            for call in (
                admin.coordinator_stats(),
                admin.transaction_metadata(0, 1),
                admin.slow_transactions(0),
                admin.transaction_buffer_stats(TOPIC),
                admin.pending_ack_stats(TOPIC, SUB),
            ):
                assert await status_of(call) == 503
            assert "anabranch_txn_" not in await admin.metrics()


async def test_cluster_non_owner_redirects_like_topic_stats(tmp_path: Path) -> None:
    async with LocalCluster(tmp_path, brokers=2) as cluster:
        owner = await cluster.owner_of(TOPIC)
        other = next(b for b in cluster.brokers if b is not owner)
        status, _, _ = await cluster.http_follow("PUT", f"/admin/v2/persistent/{SHORT}")
        assert status in (204, 409)  # 409: the owner's lookup auto-created it already
        path = f"{V2}/transactionBufferStats/{SHORT}"
        status, stats = await cluster.http("GET", path, via=owner)
        assert status == 200 and stats["state"] == "Ready"
        status, location = await cluster.http("GET", path, via=other)
        assert status == 307 and location == f"{owner.http_url}{path}"
        # Coordinator reads are served by any broker (each serves every partition).
        status, stats = await cluster.http("GET", f"{V2}/coordinatorStats", via=other)
        assert status == 200 and stats["partitions"] >= 1


# --- the CLI (its own asyncio.run per command: the broker lives on another thread) ------------


class ThreadBroker:
    def __init__(self, broker: InProcessBroker, loop: asyncio.AbstractEventLoop) -> None:
        self.broker = broker
        self.loop = loop

    def run(self, coro: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout=30)


@pytest.fixture
def threaded(tmp_path: Path) -> Iterator[ThreadBroker]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = InProcessBroker(tmp_path, ledgers="memory")
    try:
        asyncio.run_coroutine_threadsafe(broker.__aenter__(), loop).result()
        yield ThreadBroker(broker, loop)
        asyncio.run_coroutine_threadsafe(broker.__aexit__(None, None, None), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def cli(url: str, *args: str, code: int = 0) -> str:
    result = runner.invoke(app, ["admin", "--admin-url", url, "transactions", *args])
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result.stdout


def cli_json(url: str, *args: str) -> Any:
    return json.loads(cli(url, *args, "--output", "json"))


def test_cli(threaded: ThreadBroker) -> None:
    url = threaded.broker.http_url
    assert url is not None
    tc = threaded.broker.service.txn_coordinator
    assert tc is not None
    txn = threaded.run(tc.new_txn(300_000))
    most, least = txn

    stats = cli_json(url, "coordinator-stats")
    assert stats["created"] == 1 and stats["open"] == 1
    one = cli_json(url, "coordinator-stats", "--coordinator-id", str(most))
    assert one["coordinatorId"] == most and one["open"] == 1
    table = cli(url, "coordinator-stats")
    assert "transaction coordinator" in table and "total" in table

    meta = cli_json(url, "transaction-metadata", str(most), str(least))
    assert meta["txnId"] == f"{most}_{least}" and meta["status"] == "OPEN"
    assert "OPEN" in cli(url, "transaction-metadata", str(most), str(least))
    cli(url, "transaction-metadata", "0", "987654", code=1)

    assert list(cli_json(url, "slow-transactions", "--timeout-ms", "0")) == [f"{most}_{least}"]
    assert cli_json(url, "slow-transactions", "--timeout-ms", "3600000") == {}
    assert f"{most}_{least}" in cli(url, "slow-transactions", "--timeout-ms", "0")

    runner.invoke(app, ["admin", "--admin-url", url, "topics", "create", TOPIC])
    runner.invoke(app, ["admin", "--admin-url", url, "topics", "create-subscription", TOPIC, SUB])
    assert cli_json(url, "buffer-stats", TOPIC)["state"] == "Ready"
    assert "maxReadPosition" in cli(url, "buffer-stats", TOPIC)
    assert cli_json(url, "pending-ack-stats", TOPIC, SUB)["ongoingTxnSize"] == 0
    cli(url, "pending-ack-stats", TOPIC, "nope", code=1)
    cli(url, "buffer-stats", "topic://public/default/x", code=1)  # not persistent/segment
    threaded.run(tc.end_txn(txn, TxnState.COMMITTED))
    assert cli_json(url, "coordinator-stats")["committed"] == 1

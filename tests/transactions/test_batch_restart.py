"""Batch transactions (the exactly-once sink's) across a broker SIGKILL (a real broker process).

What the Spark sink does, without Spark: per batch one transaction from the admin batch API,
one producer per task (batching on) tagging its messages with its branch, two tasks plus
sometimes a speculative attempt that loses, one commit naming the winners. The broker is
killed right after the last commit — with ``txn-hold-outcomes`` before any participant
applied one, so that every batch's op records remain and the restart rebuilds each topic's
view with the recovery scan (a committed-with-winners transaction: its losers' entries found
by their ``__txn_branch``) — and then again after the view was persisted.

A manual run once found the rows written before such a restart gone. The cause was not the
transactions but retention, Pulsar's rule: a topic without subscriptions counts every entry
as consumed, and with the default retention (0/0) the ledger the restart closed is deleted
by the next retention sweep (the rows written after the restart, in the open ledger, stay).
``test_a_topic_without_subscription_or_retention_keeps_only_the_open_ledger`` shows exactly
that on a canary topic, which is also how the main test knows a sweep ran after the restart.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.client.checkpoint_consumer import CheckpointConsumer
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.core.txn_id import BRANCH_PROPERTY
from anabranch.failpoints import TXN_HOLD_OUTCOMES
from anabranch.testing.broker import BrokerProcess

SCALABLE = "public/default/eo-restart-out"
PLAIN = "persistent://public/default/eo-restart-plain"
CANARY = "persistent://public/scratch/canary"
SINK = "eo-restart/sink"
QUERY = "q1"
BATCHES = 8
ROWS_PER_BRANCH = 30
LOSING_BATCHES = (2, 5)
"""Batches with a third, speculative attempt of partition 0 that the commit leaves out."""
SWEEP_S = 0.5
"""The broker's retention_check_interval_s here."""
QUIET_S = 1.5


class Sink:
    """The driver and its tasks (one client per executor, reused across batches)."""

    def __init__(self, broker: BrokerProcess) -> None:
        self.admin = AdminClient(f"http://{broker.host}:{broker.http_port}")
        self.executors = [Client(broker.service_url), Client(broker.service_url)]
        self.next_row = 0
        self.committed: list[str] = []

    async def close(self) -> None:
        for client in self.executors:
            await client.close()
        await self.admin.close()

    async def task(
        self, client: Client, txn_id: tuple[int, int], branch: str, rows: list[str]
    ) -> None:
        """One task attempt: the scalable topic as the sink's TopicSink writes it (one
        ``send_many`` of the rows, then flush), the plain topic through a batching producer;
        every message tagged with ``branch``."""
        txn = await client.resume_transaction(txn_id, 60)
        tag = {BRANCH_PROPERTY: branch}
        scalable = await client.create_producer(f"topic://{SCALABLE}")
        assert isinstance(scalable, ScalableProducer)
        messages = [(r.encode(), f"k{i % 7}", tag, None) for i, r in enumerate(rows)]
        futures = await scalable.send_many(messages, txn=txn)
        await scalable.flush()
        await asyncio.gather(*futures)
        await scalable.close()
        producer = await client.create_producer(PLAIN, batching=True)
        for i, row in enumerate(rows):
            await producer.send_async(row.encode(), key=f"k{i % 7}", properties=tag, txn=txn)
        await producer.flush()
        await producer.close()

    def rows(self, count: int) -> list[str]:
        out = [f"R-{self.next_row + i}" for i in range(count)]
        self.next_row += count
        return out

    async def batch(self, batch_id: int) -> None:
        batch = await self.admin.begin_batch(SINK, batch_id, QUERY, timeout_ms=120_000)
        assert batch["state"] == "OPEN", batch
        txn_id = (batch["txnId"]["mostSigBits"], batch["txnId"]["leastSigBits"])
        winners = [f"{p}-{uuid.uuid4().hex}" for p in range(2)]
        work = [self.rows(ROWS_PER_BRANCH) for _ in winners]
        jobs = [
            self.task(client, txn_id, branch, rows)
            for client, branch, rows in zip(self.executors, winners, work, strict=True)
        ]
        if batch_id in LOSING_BATCHES:
            loser = [f"L-{batch_id}-{i}" for i in range(ROWS_PER_BRANCH)]
            jobs.append(self.task(self.executors[0], txn_id, f"0-{uuid.uuid4().hex}", loser))
        await asyncio.gather(*jobs)
        done = await self.admin.commit_batch(SINK, batch_id, QUERY, batch["epoch"], winners)
        assert (done["state"], sorted(done["winners"])) == ("COMMITTED", sorted(winners))
        self.committed += [row for rows in work for row in rows]


async def drain(receive: Callable[..., Awaitable[Any]]) -> list[str]:
    """Every value ``receive`` hands out until it has been quiet for ``QUIET_S``."""
    out: list[str] = []
    while (msg := await receive(timeout=QUIET_S)) is not None:
        out.append(msg.value.decode())
    return out


async def drain_scalable(client: Client) -> list[str]:
    reader = await client.create_checkpoint_consumer(f"topic://{SCALABLE}")
    assert isinstance(reader, CheckpointConsumer)
    try:
        return await drain(reader.receive)
    finally:
        await reader.close()


async def drain_plain(client: Client, topic: str) -> list[str]:
    reader = await client.create_reader(topic, "earliest")
    try:
        return await drain(reader.read_next)
    finally:
        await reader.close()


async def ledgers_trimmed(broker: BrokerProcess) -> float:
    url = f"http://{broker.host}:{broker.http_port}/metrics"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        text = await resp.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("anabranch_ledgers_trimmed")
    )


async def write_canary(client: Client, tag: str) -> list[str]:
    producer = await client.create_producer(CANARY)
    rows = [f"{tag}-{i}" for i in range(5)]
    for row in rows:
        await producer.send(row.encode())
    await producer.close()
    return rows


async def wait_trimmed(broker: BrokerProcess, ledgers: int) -> None:
    """Until retention sweeps have deleted ``ledgers`` ledgers since the broker started."""
    for _ in range(300):
        if await ledgers_trimmed(broker) >= ledgers:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"retention did not delete {ledgers} ledgers")


async def sweep_after_restart(client: Client, before: list[str]) -> None:
    """Write the canary again (its load closes the ledger holding ``before``), wait until a
    retention sweep deleted that ledger, then two more sweep intervals, so the other loaded
    topics have been through a sweep since the restart too."""
    after = await write_canary(client, "after")
    for _ in range(30):
        got = await drain_plain(client, CANARY)
        if got == after:
            break
        assert got == before + after, got
        await asyncio.sleep(SWEEP_S)
    else:
        raise AssertionError("no retention sweep deleted the canary's closed ledger")
    await asyncio.sleep(2 * SWEEP_S + 0.5)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[BrokerProcess]:
    proc = BrokerProcess(
        tmp_path / "data", env={"ANABRANCH_RETENTION_CHECK_INTERVAL_S": str(SWEEP_S)}
    )
    try:
        yield proc
    finally:
        await proc.stop()


async def setup_topics(sink: Sink) -> None:
    await sink.admin.create_scalable_topic(f"topic://{SCALABLE}", 2)
    # The sink's outputs are kept (what a reader of a sink's output needs: it has no
    # subscription); the canary's namespace keeps the default, 0/0.
    await sink.admin.set_retention("public/default", -1, -1)
    await sink.admin.create_namespace("public/scratch")


def exactly(got: list[str], want: list[str]) -> dict[str, Any]:
    """What differs between two multisets of rows (empty when equal)."""
    have, need = Counter(got), Counter(want)
    diff = {"missing": sorted(need - have), "extra": sorted(have - need)}
    return {k: v[:10] + ([f"... {len(v)}"] if len(v) > 10 else []) for k, v in diff.items() if v}


@pytest.mark.parametrize("held", [True, False], ids=["outcomes-held", "outcomes-live"])
async def test_committed_batches_survive_sigkill_exactly_once_losers_never(
    broker: BrokerProcess, held: bool
) -> None:
    broker.failpoints = TXN_HOLD_OUTCOMES if held else ""
    await broker.start()
    sink = Sink(broker)
    client = Client(broker.service_url)
    try:
        await setup_topics(sink)
        canary = await write_canary(client, "before")
        for batch_id in range(BATCHES):
            await sink.batch(batch_id)
        broker.kill()  # right after the last commit: no outcome applied (held) or some not
        broker.failpoints = ""
        await broker.start()

        await sweep_after_restart(client, canary)
        for batch_id in range(BATCHES):
            assert (await sink.admin.get_batch(SINK, batch_id))["state"] == "COMMITTED"
        assert exactly(await drain_scalable(client), sink.committed) == {}
        assert exactly(await drain_plain(client, PLAIN), sink.committed) == {}

        # Batches after the restart, then a second SIGKILL: the persisted view (aborted
        # records of the losers) and the new batches' recovery agree.
        for batch_id in range(BATCHES, BATCHES + 3):
            await sink.batch(batch_id)
        broker.kill()
        await broker.start()
        assert exactly(await drain_scalable(client), sink.committed) == {}
        assert exactly(await drain_plain(client, PLAIN), sink.committed) == {}
    finally:
        await client.close()
        await sink.close()


async def test_a_topic_without_subscription_or_retention_keeps_only_the_open_ledger(
    broker: BrokerProcess,
) -> None:
    """Pulsar's rule, and what the manual run saw: committed batches written before a
    restart into a sink output without subscriptions and with retention 0/0 are deleted by
    the first retention sweep after it (the restart closed their ledger); those written
    after it stay. Not a transaction matter: the canary is written without one."""
    await broker.start()
    sink = Sink(broker)
    client = Client(broker.service_url)
    try:
        await sink.admin.create_scalable_topic(f"topic://{SCALABLE}", 2)
        await sink.admin.create_namespace("public/scratch")
        canary = await write_canary(client, "before")
        for batch_id in range(2):
            await sink.batch(batch_id)
        broker.kill()
        await broker.start()
        sink.committed.clear()
        for batch_id in range(2, 4):
            await sink.batch(batch_id)
        await sweep_after_restart(client, canary)
        await wait_trimmed(broker, 4)  # the canary's, both segments' and the plain topic's
        assert exactly(await drain_scalable(client), sink.committed) == {}
        assert exactly(await drain_plain(client, PLAIN), sink.committed) == {}
    finally:
        await client.close()
        await sink.close()

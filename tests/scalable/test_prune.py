"""PIP-468 pruneSegment end to end: a drained sealed segment leaves the DAG and the disk.

A scalable topic is split while a producer writes and a stream consumer reads; once the
consumer drained the parent, the broker's retention sweep prunes it: the admin layout no
longer shows it, its children are roots, the epoch advanced, its ledger directory is gone,
and the consumer and the producer go on across the prune.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from anabranch.admin.client import AdminClient
from anabranch.aio import Client, Message
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.stream_consumer import StreamConsumer
from anabranch.core.names import SegmentName
from anabranch.scalable.paths import TopicPaths
from anabranch.storage.ledger import disk_name
from anabranch.testing.broker import InProcessBroker

TOPIC = "topic://public/default/pruned"
LONG_S = 3600.0
EVENTUALLY_ROUNDS = 2_000


async def eventually(condition: Callable[[], bool], what: str) -> None:
    for _ in range(EVENTUALLY_ROUNDS):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def receive(stream: StreamConsumer, count: int) -> list[Message]:
    out: list[Message] = []
    while len(out) < count:
        msg = await stream.receive(timeout=10)
        assert msg is not None, f"only {len(out)} of {count} arrived ({stream.segment_ids})"
        out.append(msg)
        await stream.acknowledge_cumulative(msg)
    return out


async def produce(producer: ScalableProducer, start: int, count: int) -> None:
    futures = [
        await producer.send_async(f"m{i}".encode(), key=f"k{i % 8}")
        for i in range(start, start + count)
    ]
    await asyncio.gather(*futures)


async def test_a_drained_parent_is_pruned_from_the_dag_and_the_disk(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    async with InProcessBroker(
        data_dir,
        retention_check_interval_s=LONG_S,
        cursor_persist_interval_ms=0,
    ) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            await admin.create_scalable_topic(TOPIC, 1)
            stream = await client.subscribe_stream(TOPIC, "billing", consumer_name="w1")
            producer = await client.create_producer(TOPIC, batch_delay_s=0.002)
            assert isinstance(producer, ScalableProducer)
            await produce(producer, 0, 50)
            parent_dir = (
                data_dir / "ledgers" / disk_name("public/default/segment/pruned/0000-ffff-0")
            )
            assert parent_dir.is_dir()  # segment 0's managed ledger
            layout = await admin.split_segment(TOPIC, 0)
            assert layout["epoch"] == 1
            await produce(producer, 50, 50)
            received = await receive(stream, 100)
            assert {m.message_id.segment_id for m in received} == {0, 1, 2}
            await eventually(lambda: stream.segment_ids == [1, 2], "segment 0 retires")

            await broker.service.sweeps.sweep_retention()

            layout = await admin.get_scalable_topic(TOPIC)
            assert sorted(int(i) for i in layout["segments"]) == [1, 2]
            assert layout["epoch"] == 2
            assert all(not s.get("parentIds") for s in layout["segments"].values())
            assert not parent_dir.exists()  # its ledgers and cursors are gone
            assert broker.service.scalable.counters.prunes == 1
            # The consumer and the producer carry on.
            await produce(producer, 100, 40)
            more = await receive(stream, 40)
            assert {m.value for m in more} == {f"m{i}".encode() for i in range(100, 140)}
            assert {m.message_id.segment_id for m in more} <= {1, 2}
            # A split of a child still works in the pruned DAG.
            await admin.split_segment(TOPIC, 1)
            await produce(producer, 140, 20)
            assert len(await receive(stream, 20)) == 20
            await stream.close()
            await producer.close()


async def test_a_parent_with_backlog_or_retention_is_kept(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, retention_check_interval_s=LONG_S) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            await admin.create_scalable_topic(TOPIC, 1)
            await admin.create_scalable_subscription(TOPIC, "lagging")
            producer = await client.create_producer(TOPIC, batch_delay_s=0.002)
            assert isinstance(producer, ScalableProducer)
            await produce(producer, 0, 10)
            await admin.split_segment(TOPIC, 0)
            await broker.service.sweeps.sweep_retention()
            layout = await admin.get_scalable_topic(TOPIC)
            assert 0 in {int(i) for i in layout["segments"]}  # "lagging"'s backlog

            await admin.delete_scalable_subscription(TOPIC, "lagging")
            await admin.set_retention("public/default", 60, -1)
            await broker.service.sweeps.sweep_retention()
            layout = await admin.get_scalable_topic(TOPIC)
            assert 0 in {int(i) for i in layout["segments"]}  # retained 1 h

            await admin.set_retention("public/default", 0, 0)
            await broker.service.sweeps.sweep_retention()
            layout = await admin.get_scalable_topic(TOPIC)
            assert 0 not in {int(i) for i in layout["segments"]}
            await producer.close()


async def test_a_checkpoint_group_keeps_every_segment(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, retention_check_interval_s=LONG_S) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            await admin.create_scalable_topic(TOPIC, 1)
            group = await client.create_checkpoint_consumer(
                TOPIC, consumer_group="readers", consumer_name="r1"
            )
            producer = await client.create_producer(TOPIC, batch_delay_s=0.002)
            assert isinstance(producer, ScalableProducer)
            await produce(producer, 0, 10)
            await admin.split_segment(TOPIC, 0)
            await broker.service.sweeps.sweep_retention()
            layout = await admin.get_scalable_topic(TOPIC)
            # No cursor says what the group read: the sealed parent stays.
            assert 0 in {int(i) for i in layout["segments"]}
            await group.close()
            await producer.close()


async def test_a_failed_deletion_is_finished_by_the_next_sweep(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    async with InProcessBroker(data_dir, retention_check_interval_s=LONG_S) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            await admin.create_scalable_topic(TOPIC, 1)
            producer = await client.create_producer(TOPIC, batch_delay_s=0.002)
            assert isinstance(producer, ScalableProducer)
            await produce(producer, 0, 10)
            await admin.split_segment(TOPIC, 0)
            parent_dir = (
                data_dir / "ledgers" / disk_name("public/default/segment/pruned/0000-ffff-0")
            )
            assert parent_dir.is_dir()
            controller = await broker.service.scalable.controller(TOPIC)
            real_delete = controller.ops.delete_segment
            failures = 0

            async def failing_delete(segment: SegmentName) -> None:
                nonlocal failures
                failures += 1
                raise OSError("disk unplugged")

            controller.ops.delete_segment = failing_delete  # type: ignore[method-assign]
            await broker.service.sweeps.sweep_retention()
            assert failures == 1
            layout = await admin.get_scalable_topic(TOPIC)
            assert 0 not in {int(i) for i in layout["segments"]}  # pruned from the DAG
            assert parent_dir.is_dir()  # but its data is still there
            pending = await broker.service.store.list_children(
                TopicPaths(controller.topic).pruned_root
            )
            assert pending == ["0"]

            controller.ops.delete_segment = real_delete  # type: ignore[method-assign]
            await broker.service.sweeps.sweep_retention()
            assert not parent_dir.exists()
            assert (
                await broker.service.store.list_children(TopicPaths(controller.topic).pruned_root)
                == []
            )
            await produce(producer, 10, 10)
            await producer.close()

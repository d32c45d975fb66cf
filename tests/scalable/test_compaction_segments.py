"""Compaction of a scalable topic: one compaction per segment (a key's messages live in
the segment its hash falls in), started for the whole topic or for one segment, and
compacted reads of each segment that give the latest value of each of its keys."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import SegmentLayout, segment_name
from anabranch.testing.broker import InProcessBroker

TOPIC = "topic://public/default/table"
KEYS = [f"key-{i}" for i in range(24)]
HANG_GUARD_S = 60


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(HANG_GUARD_S * 20):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: still not after {HANG_GUARD_S}s")


async def read_compacted(client: Client, segment: str) -> list[tuple[str | None, bytes]]:
    reader = await client.create_reader(segment, "earliest", read_compacted=True)
    out = []
    while await reader.has_message_available():
        msg = await reader.read_next(timeout=HANG_GUARD_S)
        assert msg is not None
        out.append((msg.key, msg.value))
    await reader.close()
    return out


async def test_each_segment_is_compacted_on_its_own(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            await admin.create_scalable_topic(TOPIC, 2)
            producer = await client.create_producer(TOPIC, batch_delay_s=0.002)
            assert isinstance(producer, ScalableProducer)
            latest: dict[str, bytes] = {}
            for round_ in range(4):
                sends = []
                for key in KEYS:
                    value = (
                        b""
                        if round_ == 3 and key.endswith("7")
                        else b"%s-%d" % (key.encode(), round_)
                    )
                    sends.append(await producer.send_async(value, key=key))
                    if value:
                        latest[key] = value
                    else:
                        latest.pop(key, None)
                await asyncio.gather(*sends)
            await producer.close()
            layout = SegmentLayout.from_dict(await admin.get_scalable_topic(TOPIC))
            segments = [
                str(segment_name(TopicName.parse(TOPIC), s)) for s in layout.segments.values()
            ]
            assert len(segments) == 2
            await admin.compact(TOPIC)  # every segment of the layout

            async def all_done() -> bool:
                states = [(await admin.compaction_status(s))["status"] for s in segments]
                return all(state == "SUCCESS" for state in states)

            await until(all_done, "both segments compacted")
            views = [await read_compacted(client, s) for s in segments]
            # one more value for one key, then compact only its segment
            home = next(i for i, view in enumerate(views) if any(k == "key-1" for k, _ in view))
            again = await client.create_producer(TOPIC)
            await again.send(b"newest", key="key-1")
            await again.close()
            await admin.compact(segments[home])

            async def home_done() -> bool:
                return (await admin.compaction_status(segments[home]))["status"] == "SUCCESS"

            await until(home_done, "the segment compacted again")
            recompacted = await read_compacted(client, segments[home])
            # a split hands the topic's subscriptions to the children, not the compaction cursor
            await admin.create_scalable_subscription(TOPIC, "billing")
            after = SegmentLayout.from_dict(
                await admin.split_segment(TOPIC, list(layout.segments)[home])
            )
            children = [s for s in after.segments.values() if s.is_active and s.parent_ids]
            cursors = set()
            for child in children:
                topic = await broker.service.get_topic(
                    str(segment_name(TopicName.parse(TOPIC), child)), create=False
                )
                cursors |= {c.name for c in topic.ledger.cursors()}
    keys = [[k for k, _ in view] for view in views]
    assert all(keys), "every segment holds some keys"
    assert not set(keys[0]) & set(keys[1])  # a key lives in one segment
    assert {k: v for view in views for k, v in view} == latest  # tombstones deleted
    assert sum(len(view) for view in views) == len(latest)  # one message per key
    assert dict(recompacted) == {k: v for k, v in views[home]} | {"key-1": b"newest"}
    assert len(recompacted) == len(views[home])
    assert len(children) == 2
    assert cursors == {"billing"}

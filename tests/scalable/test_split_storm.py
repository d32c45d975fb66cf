"""A split/merge storm without any fault: a stream consumer must keep up and finish.

One broker, a topic created with 2 segments, 16 keys x N messages sent one by one while a
split or a merge is requested every hundred milliseconds or so (issue 19, item 6: the stream
consumer got 4,359 of 4,800 messages and then nothing for 90 s). Afterwards every message
must have arrived exactly once, per key in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import defaultdict
from pathlib import Path

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.errors import AnabranchError
from anabranch.testing.broker import InProcessBroker

KEYS = [f"key-{i}" for i in range(16)]
PER_KEY = 120
STORM_INTERVAL_S = 0.1
SEGMENTS_MAX = 8
RECEIVE_TIMEOUT_S = 30.0
"""How long the consumer may see nothing before the test calls it stalled (generous: the
bug was a stall forever, not a slow consumer)."""


async def storm(admin: AdminClient, topic: str, rng: random.Random, stop: asyncio.Event) -> int:
    """Split or merge every STORM_INTERVAL_S until ``stop``; returns the changes made."""
    changes = 0
    while not stop.is_set():
        await asyncio.sleep(STORM_INTERVAL_S)
        layout = await admin.get_scalable_topic(topic)
        active = sorted(
            (s["hashRange"]["start"], int(i))
            for i, s in layout["segments"].items()
            if s["state"] == "ACTIVE"
        )
        with contextlib.suppress(AnabranchError):
            if len(active) > 1 and (len(active) >= SEGMENTS_MAX or rng.random() < 0.5):
                at = rng.randrange(len(active) - 1)
                await admin.merge_segments(topic, active[at][1], active[at + 1][1])
            else:
                await admin.split_segment(topic, rng.choice(active)[1])
            changes += 1
    return changes


async def test_stream_consumer_finishes_under_a_split_merge_storm(tmp_path: Path) -> None:
    topic = "topic://public/default/storm"
    async with InProcessBroker(tmp_path) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            await admin.create_scalable_topic(topic, 2)
            stream = await client.subscribe_stream(topic, "storm", consumer_name="c1")
            producer = await client.create_producer(topic)
            stop = asyncio.Event()
            storming = asyncio.ensure_future(storm(admin, topic, random.Random(19), stop))

            async def produce() -> None:
                for i in range(PER_KEY):
                    for key in KEYS:
                        await producer.send(f"{key}:{i}".encode(), key=key)
                stop.set()

            producing = asyncio.ensure_future(produce())
            seen: dict[str, list[int]] = defaultdict(list)
            total = len(KEYS) * PER_KEY
            for got in range(total):
                msg = await stream.receive(timeout=RECEIVE_TIMEOUT_S)
                assert msg is not None, (
                    f"stalled after {got} of {total} messages (segments {stream.segment_ids})"
                )
                key, seq = msg.value.decode().split(":")
                seen[key].append(int(seq))
                await stream.acknowledge_cumulative(msg)
            await producing
            changes = await storming
            assert await stream.receive(timeout=0.5) is None, "more messages than produced"
            assert changes >= 10, changes
            assert dict(seen) == {k: list(range(PER_KEY)) for k in KEYS}

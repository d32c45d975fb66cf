"""Load-driven split and merge end to end: a standalone broker process, a hot key range, a
stream consumer checking every key's order and exactly-once delivery throughout.

The broker evaluates every 0.25 s; the topic's policy (set through the admin API) has a
low threshold and short windows so the whole cycle takes seconds, not minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp

from anabranch.admin.client import AdminClient
from anabranch.aio import Client, Message
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.stream_consumer import StreamConsumer
from anabranch.core.hash_range import segment_hash
from anabranch.core.segment_layout import SegmentLayout
from anabranch.testing.broker import BrokerProcess

TOPIC = "topic://public/default/hot"
HOT_KEYS = [k for k in (f"key-{i}" for i in range(200)) if segment_hash(k) <= 0x7FFF][:8]
"""Keys of segment 0's range ([0000, 7fff] of a two-segment topic): the hot range."""
POLICY: dict[str, Any] = {
    "enabled": True,
    "splitMsgRateIn": 150,
    "splitThroughputIn": 0,
    "minSegments": 2,
    "maxSegments": 3,
    "splitSustainMs": 1000,
    "mergeSustainMs": 2000,
    "splitCooldownMs": 0,
    "mergeCooldownMs": 3000,
    "mergeLowWater": 0.3,
}
DECISIONS = "anabranch_scalable_autoscale_decisions_total"
POLL_S = 0.1
POLLS_MAX = 600
"""Hang guard of each wait (a minute): the cycle itself takes a few seconds."""


async def _when_http_serves(admin: AdminClient) -> None:
    for _ in range(POLLS_MAX):
        try:
            await admin.create_scalable_topic(TOPIC, 2)
            return
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)
    raise AssertionError("the admin HTTP port never answered")


async def _layout(admin: AdminClient) -> SegmentLayout:
    return SegmentLayout.from_dict(await admin.get_scalable_topic(TOPIC))


async def _consume(stream: StreamConsumer, seen: dict[str, list[int]]) -> None:
    while True:
        msg: Message | None = await stream.receive(timeout=0.5)
        if msg is None:
            continue
        key, seq = msg.value.decode().split(":")
        assert key == msg.key
        seen[key].append(int(seq))
        await stream.acknowledge_cumulative(msg)


async def test_a_hot_range_splits_then_merges_back_every_key_once_in_order(
    tmp_path: Path,
) -> None:
    broker = BrokerProcess(
        tmp_path / "data", fsync="never", env={"ANABRANCH_SCALABLE_AUTOSCALE_INTERVAL_S": "0.25"}
    )
    await broker.start()
    try:
        async with (
            AdminClient(f"http://{broker.host}:{broker.http_port}") as admin,
            Client(broker.service_url) as client,
        ):
            await _when_http_serves(admin)
            await admin.set_scalable_autoscale(TOPIC, POLICY)
            assert (await admin.get_scalable_autoscale(TOPIC, applied=True))["maxSegments"] == 3
            stream = await client.subscribe_stream(TOPIC, "audit", consumer_name="auditor")
            made = await client.create_producer(TOPIC, batch_delay_s=0.002)
            assert isinstance(made, ScalableProducer)
            producer = made
            seen: dict[str, list[int]] = defaultdict(list)
            sent: dict[str, int] = defaultdict(int)
            consuming = asyncio.ensure_future(_consume(stream, seen))
            try:
                # ~400 msg/s into segment 0's range until the controller splits it.
                for _ in range(POLLS_MAX):
                    futures = []
                    for i in range(40):
                        key = HOT_KEYS[i % len(HOT_KEYS)]
                        payload = f"{key}:{sent[key]}".encode()
                        futures.append(await producer.send_async(payload, key=key))
                        sent[key] += 1
                    await asyncio.gather(*futures)
                    await asyncio.sleep(POLL_S)
                    if len((await _layout(admin)).active_segments()) == 3:
                        break
                split = await _layout(admin)
                assert not split.segments[0].is_active, "the hot segment 0 was split"
                assert split.segments[1].is_active, "the idle segment 1 was left alone"
                assert split.segments[0].child_ids == (2, 3)
                stats = await admin.scalable_stats(TOPIC)
                assert stats["autoscale"]["policy"]["splitMsgRateIn"] == 150
                # No traffic: the two halves merge back (segment 1 stays: minSegments 2).
                for _ in range(POLLS_MAX):
                    await asyncio.sleep(POLL_S)
                    if (await _layout(admin)).epoch >= 2:
                        break
                merged = await _layout(admin)
                assert [s.segment_id for s in merged.active_segments()] == [4, 1]
                assert merged.segments[4].parent_ids == (2, 3)
                total = sum(sent.values())
                for _ in range(POLLS_MAX):
                    if sum(len(v) for v in seen.values()) >= total:
                        break
                    await asyncio.sleep(POLL_S)
                assert dict(seen) == {k: list(range(n)) for k, n in sent.items()}
                async with aiohttp.ClientSession() as http:
                    url = f"http://{broker.host}:{broker.http_port}/metrics"
                    async with http.get(url) as response:
                        metrics = await response.text()
                decisions = sorted(
                    line for line in metrics.splitlines() if line.startswith(DECISIONS + "{")
                )
                assert decisions == [
                    f'{DECISIONS}{{action="merge",cluster="standalone",reason="lowWater"}} 1.0',
                    f'{DECISIONS}{{action="split",cluster="standalone",reason="msgRateIn"}} 1.0',
                ], decisions
            finally:
                consuming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await consuming
            await stream.close()
            await producer.close()
    finally:
        await broker.stop()

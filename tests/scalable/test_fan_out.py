"""Key_Shared dispatch mode of stream consumers (PIP-460 "Scaling Reads beyond the Segment
Count"): more consumers than segments share a segment by key hash, on a real broker.

The crash test runs the victim consumer in a child process and SIGKILLs it mid-stream:
its unacknowledged messages and its keys must move to the survivors, with every message
acknowledged exactly once and each key's deliveries in order.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from anabranch.admin.client import AdminClient
from anabranch.aio import Client, Message, MessageId
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.stream_consumer import StreamConsumer
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import SegmentLayout, segment_name
from anabranch.errors import InvalidArgument, NotAllowed
from anabranch.testing.broker import InProcessBroker

KEYS = [f"key-{i}" for i in range(24)]
EVENTUALLY_ROUNDS = 2_000
HANG_GUARD_S = 30.0
VICTIM = """
import asyncio, sys
from anabranch.aio import Client

async def main() -> None:
    async with Client(sys.argv[1]) as client:
        stream = await client.subscribe_stream(
            sys.argv[2], "fan", consumer_name="victim", dispatch_mode="key_shared",
            receiver_queue_size=8,
        )
        print("ready", flush=True)
        while True:
            msg = await stream.receive()
            print(msg.value.decode(), flush=True)  # received, never acknowledged

asyncio.run(main())
"""


async def eventually(condition: Callable[[], bool], what: str) -> None:
    for _ in range(EVENTUALLY_ROUNDS):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


@dataclass
class World:
    broker: InProcessBroker
    client: Client


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with (
        InProcessBroker(tmp_path, ledgers="memory", consumer_grace_period_s=30.0) as broker,
        Client(broker.service_url) as client,
    ):
        yield World(broker, client)


def parse(msg: Message) -> tuple[str, int]:
    key, seq = msg.value.decode().split(":")
    return key, int(seq)


class Survivors:
    """Stream consumers in this process: each acknowledges what it receives at once and
    appends it to one shared log (so the log's order per key is the delivery order)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []
        self.entries: dict[tuple[int, int], set[str]] = defaultdict(set)
        """Batch entries (ledger, entry) -> the consumers that got messages of them."""
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, stream: StreamConsumer) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(self._run(stream)))

    async def _run(self, stream: StreamConsumer) -> None:
        while True:
            msg = await stream.receive()
            if msg is None:
                continue
            key, seq = parse(msg)
            self.log.append((stream.consumer_name, key, seq))
            mid = msg.message_id
            if mid.batch_size > 1:
                self.entries[(mid.ledger_id, mid.entry_id)].add(stream.consumer_name)
            await stream.acknowledge(msg)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def segment_consumers(world: World, topic: str, subscription: str) -> set[str]:
    """The consumers attached to ``subscription`` on segment 0 of ``topic`` (this broker)."""
    layout = SegmentLayout.initial(1, 0)  # the topic's, as created (never split here)
    name = str(segment_name(TopicName.parse(topic), layout.segments[0]))
    loaded = world.broker.service.loaded_topic(name)
    sub = loaded.subscriptions.get(subscription) if loaded is not None else None
    return {c.name for c in sub.consumers} if sub is not None else set()


async def produce(producer: ScalableProducer, sent: dict[str, int], count: int) -> None:
    futures = []
    for i in range(count):
        key = KEYS[i % len(KEYS)]
        futures.append(await producer.send_async(f"{key}:{sent[key]}".encode(), key=key))
        sent[key] += 1
    await asyncio.gather(*futures)


async def test_four_consumers_share_one_segment_and_survive_a_crash(world: World) -> None:
    topic = "topic://public/default/fanout"
    await world.broker.service.scalable.create(topic, 1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    victim = await asyncio.create_subprocess_exec(
        sys.executable, "-c", VICTIM, world.broker.service_url, topic,
        stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    survivors = Survivors()
    streams: list[StreamConsumer] = []
    try:
        assert victim.stdout is not None
        ready = await asyncio.wait_for(victim.stdout.readline(), HANG_GUARD_S)
        assert ready.strip() == b"ready"
        for name in ("s1", "s2", "s3"):
            stream = await world.client.subscribe_stream(
                topic, "fan", consumer_name=name, dispatch_mode="key_shared"
            )
            streams.append(stream)
            survivors.start(stream)
        controller = await world.broker.service.scalable.controller(topic)
        state = controller.assignment("fan")
        assert state is not None and state.owners_of(0) == ("s1", "s2", "s3", "victim")
        for stream in streams:
            assert stream.segment_ids == [0]
        await eventually(
            lambda: segment_consumers(world, topic, "fan") == {"s1", "s2", "s3", "victim"},
            "all four attached to segment 0 (Key_Shared)",
        )
        with pytest.raises(InvalidArgument, match="cumulative"):
            await streams[0].acknowledge_cumulative(MessageId(0, 0, segment_id=0))

        # Unbatched first, so each message is routed by its own key and the victim gets
        # its keys' share; after the crash, mixed-key batches (routed by their key slots).
        single = await world.client.create_producer(topic, batching=False)
        assert isinstance(single, ScalableProducer)
        sent: dict[str, int] = defaultdict(int)
        await produce(single, sent, 240)
        victim_got: list[tuple[str, int]] = []
        while len(victim_got) < 8:  # the victim holds some keys' messages, unacked
            line = await asyncio.wait_for(victim.stdout.readline(), HANG_GUARD_S)
            assert line, "the victim ended before receiving its share"
            victim_key, victim_seq = line.decode().strip().split(":")
            victim_got.append((victim_key, int(victim_seq)))
        victim.send_signal(signal.SIGKILL)
        await victim.wait()
        await check_stats_after_the_crash(world, topic)
        producer = await world.client.create_producer(topic, batch_delay_s=0.005)
        assert isinstance(producer, ScalableProducer)
        await produce(producer, sent, 240)
        total = sum(sent.values())
        await eventually(lambda: len(survivors.log) >= total, f"{total} messages acknowledged")
        await asyncio.sleep(0.2)  # nothing more may arrive: no duplicates
        per_key: dict[str, list[int]] = defaultdict(list)
        for _, got_key, got_seq in survivors.log:
            per_key[got_key].append(got_seq)
        assert per_key == {k: list(range(n)) for k, n in sent.items()}  # once, in order
        assert {name for name, _, _ in survivors.log} == {"s1", "s2", "s3"}
        # Mixed-key batch entries were split by key among the survivors, not sent whole.
        assert survivors.entries
        assert max(len(names) for names in survivors.entries.values()) >= 2
        for got_key, got_seq in victim_got:  # never acknowledged: a survivor got it too
            assert got_seq in per_key[got_key]
        await producer.close()
        await single.close()
    finally:
        if victim.returncode is None:
            victim.kill()
            await victim.wait()
        await survivors.stop()
        for stream in streams:
            await stream.close()


async def check_stats_after_the_crash(world: World, topic: str) -> None:
    """``/stats``: the four consumers share segment 0; the victim is in its grace period
    (keeping its share); the segment's Key_Shared ranges are the survivors' alone."""
    assert world.broker.http_url is not None
    async with AdminClient(world.broker.http_url) as admin:

        async def victim_gone() -> dict[str, Any]:
            for _ in range(EVENTUALLY_ROUNDS):
                stats = await admin.scalable_stats(topic)
                state = stats["subscriptionStates"]["fan"]
                ranges = stats["segments"]["0"].get("keySharedHashRanges", {}).get("fan", {})
                if not state["consumers"]["victim"]["connected"] and "victim" not in ranges:
                    return stats
                await asyncio.sleep(0.01)
            raise AssertionError("the victim's disconnect never showed in /stats")

        stats = await victim_gone()
    state = stats["subscriptionStates"]["fan"]
    assert state["leader"] is True and state["type"] == "STREAM_KEY_SHARED"
    assert state["sharedSegments"] == {"0": ["s1", "s2", "s3", "victim"]}
    assert state["connectedConsumers"] == 3 and state["consumerCount"] == 4
    victim = state["consumers"]["victim"]
    assert victim["segments"] == [0]
    assert 0 < victim["graceRemainingMs"] <= state["gracePeriodMs"] == 30_000
    assert "graceRemainingMs" not in state["consumers"]["s1"]
    ranges = stats["segments"]["0"]["keySharedHashRanges"]["fan"]
    assert sorted(ranges) == ["s1", "s2", "s3"]
    covered = sorted(tuple(r) for r in ranges.values())
    assert covered[0][0] == 0 and covered[-1][1] == 65535


# --- delayed delivery ----------------------------------------------------------------------

DELAY_S = 0.8


async def test_delayed_messages_of_a_sealed_parent_come_when_due_and_before_the_children(
    world: World,
) -> None:
    """Delayed messages stored in segment 0, then a split: the children's messages of the
    same keys wait until the parent drained, which needs the delayed ones delivered (when
    due) and acknowledged; queue consumers get them when due as well."""
    topic = "topic://public/default/delayed"
    await world.broker.service.scalable.create(topic, 1)
    stream = await world.client.subscribe_stream(
        topic, "d", consumer_name="d1", dispatch_mode="key_shared"
    )
    queue = await world.client.subscribe_queue(topic, "q")
    producer = await world.client.create_producer(topic, batch_delay_s=0.002)
    assert isinstance(producer, ScalableProducer)
    keys = KEYS[:6]
    due: dict[tuple[str, int], int] = {}
    for key in keys:
        mid = await producer.send(f"{key}:0".encode(), key=key, deliver_after=DELAY_S)
        assert mid.segment_id == 0
        due[(key, 0)] = int(time.time() * 1000 + DELAY_S * 1000)
    at = int(time.time() * 1000 + DELAY_S * 1000)
    mid = await producer.send(f"{keys[0]}:1".encode(), key=keys[0], deliver_at=at)
    due[(keys[0], 1)] = at
    await world.broker.service.scalable.split(topic, 0)
    for key in keys:
        n = 2 if key == keys[0] else 1
        mid = await producer.send(f"{key}:{n}".encode(), key=key)
        assert mid.segment_id in (1, 2)
    total = len(keys) * 2 + 1
    per_key: dict[str, list[int]] = defaultdict(list)
    for _ in range(total):
        msg = await stream.receive(timeout=HANG_GUARD_S)
        assert msg is not None
        key, seq = parse(msg)
        if (key, seq) in due:
            # Not before it was due (the broker's and this clock are the same wall clock;
            # 'due' was taken after the send, so it is no earlier than the real one).
            assert time.time() * 1000 >= due[(key, seq)] - DELAY_S * 1000 / 4
            assert msg.message_id.segment_id == 0
        per_key[key].append(seq)
        await stream.acknowledge(msg)
    assert per_key == {k: [0, 1, 2] if k == keys[0] else [0, 1] for k in keys}
    queued = set()
    for _ in range(total):
        msg = await queue.receive(timeout=HANG_GUARD_S)
        assert msg is not None
        if parse(msg) in due:
            assert time.time() * 1000 >= due[parse(msg)] - DELAY_S * 1000 / 4
        queued.add(parse(msg))
        await queue.acknowledge(msg)
    assert len(queued) == total
    await producer.close()
    await stream.close()
    await queue.close()


# --- the mode of a subscription ------------------------------------------------------------


async def test_a_subscription_keeps_its_mode_while_consumed_and_switches_when_idle(
    world: World,
) -> None:
    topic = "topic://public/default/modes"
    await world.broker.service.scalable.create(topic, 1)
    await world.broker.service.scalable.create_subscription(topic, "sub")  # a STREAM one
    fan = await world.client.subscribe_stream(
        topic, "sub", consumer_name="a", dispatch_mode="key_shared"
    )
    controller = await world.broker.service.scalable.controller(topic)
    state = controller.assignment("sub")
    assert state is not None and state.fan_out  # nobody consumed it: it took the new mode
    with pytest.raises(NotAllowed, match="STREAM_KEY_SHARED subscription, not STREAM"):
        await world.client.subscribe_stream(topic, "sub", consumer_name="b")
    await fan.close()  # leaves: no sessions, the next consumer's mode wins again
    plain = await world.client.subscribe_stream(topic, "sub", consumer_name="b")
    state = controller.assignment("sub")
    assert state is not None and not state.fan_out and plain.segment_ids == [0]
    await plain.close()


async def test_sharers_follow_a_split_in_key_order(world: World) -> None:
    """Three consumers share segment 0; it splits mid-stream: once they drained it (split
    batches acknowledged part by part), they spread over the children; every message is
    acknowledged once, each key in order."""
    topic = "topic://public/default/fan-split"
    await world.broker.service.scalable.create(topic, 1)
    survivors = Survivors()
    streams = [
        await world.client.subscribe_stream(
            topic, "fan", consumer_name=name, dispatch_mode="key_shared"
        )
        for name in ("a", "b", "c")
    ]
    for stream in streams:
        survivors.start(stream)
    try:
        producer = await world.client.create_producer(topic, batch_delay_s=0.005)
        assert isinstance(producer, ScalableProducer)
        sent: dict[str, int] = defaultdict(int)
        await produce(producer, sent, 240)
        await world.broker.service.scalable.split(topic, 0)
        await produce(producer, sent, 240)
        total = sum(sent.values())
        await eventually(lambda: len(survivors.log) >= total, f"{total} acknowledged")
        await eventually(
            lambda: {s for st in streams for s in st.segment_ids} == {1, 2}, "children held"
        )
        per_key: dict[str, list[int]] = defaultdict(list)
        for _, key, seq in survivors.log:
            per_key[key].append(seq)
        assert per_key == {k: list(range(n)) for k, n in sent.items()}
        await producer.close()
    finally:
        await survivors.stop()
        for stream in streams:
            await stream.close()

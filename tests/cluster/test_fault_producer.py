"""A producer whose topic's owner is paused (SIGSTOP) moves to the new owner while the old
one still sleeps, and stores every acknowledged message exactly once.

A paused broker keeps its TCP connections open and answers nothing, so without the
client's stuck-operation probe a producer waits for its keepalive (30 s of silence, then
30 s for a PONG). With it, a SEND without a receipt for ``limits.CLIENT_OPERATION_STUCK_S``
makes the client PING the connection; no PONG within ``CLIENT_PROBE_TIMEOUT_S`` closes it,
and the producer looks the topic up again (elsewhere) and resends its pending messages with
the same sequence ids once the owner's session has expired and another broker took over.

The cluster (three brokers, session TTL ``SESSION_TTL_S``, deduplication on) starts once
for the module; each test resumes the broker it paused.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from anabranch.aio import Client
from anabranch.client.connection import ConnectionPool
from anabranch.core.hash_range import segment_hash
from anabranch.errors import AnabranchError
from anabranch.protocol import commands
from anabranch.testing.cluster import ClusterBroker, LocalCluster
from tests.cluster.local_cluster import SESSION_TTL_S, fresh_name, others, read_all
from tests.cluster.test_cluster_scalable import create_topic, layout_of, segment_names

PAUSE_WINDOW_S = 30.0
"""How long a broker stays paused at most while the test waits for sends to resume: 10x
the session TTL (generous for a loaded machine), well under the ~60 s a keepalive takes."""

RESUMED_ACKS = 20
"""Sends of the stalled producer (or segment) acknowledged during the pause that count as
having resumed."""


class Sender:
    """Sends numbered, keyed messages continuously (``send_async``, so several are pending
    at any time) and records when each is acknowledged."""

    def __init__(self, producer: Any, keys: Sequence[str]) -> None:
        self.producer = producer
        self.keys = list(keys)
        self.acked: dict[bytes, float] = {}
        """Acknowledged value → when its acknowledgement arrived."""
        self.errors: list[BaseException] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        for i in itertools.count():
            if self._stop.is_set():
                return
            key = self.keys[i % len(self.keys)]
            value = f"{key}:{i:06d}".encode()
            future = await self.producer.send_async(value, key=key)
            future.add_done_callback(lambda f, v=value: self._answered(v, f))
            await asyncio.sleep(0.005)

    def _answered(self, value: bytes, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            self.errors.append(asyncio.CancelledError())
        elif future.exception() is not None:
            self.errors.append(future.exception())  # type: ignore[arg-type]
        else:
            self.acked[value] = time.monotonic()

    def acks_after(self, instant: float, keys: Sequence[str] | None = None) -> int:
        wanted = None if keys is None else {k.encode() for k in keys}
        return sum(
            t > instant and (wanted is None or v.split(b":")[0] in wanted)
            for v, t in self.acked.items()
        )

    def first_ack_after(self, instant: float, keys: Sequence[str] | None = None) -> float | None:
        wanted = None if keys is None else {k.encode() for k in keys}
        times = [
            t
            for v, t in self.acked.items()
            if t > instant and (wanted is None or v.split(b":")[0] in wanted)
        ]
        return min(times, default=None)

    def check(self) -> None:
        """Raise what ended the sending task early."""
        if self._task is not None and self._task.done():
            self._task.result()

    async def stop(self) -> None:
        """Stop sending and wait for every sent message's answer."""
        self._stop.set()
        if self._task is not None:
            await self._task
        await asyncio.wait_for(self.producer.flush(), 60)

    async def cancel(self) -> None:
        """Stop sending without waiting for answers (a failed test's clean-up)."""
        self._stop.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


async def wait_for(
    condition: Callable[[], bool], timeout_s: float, check: Callable[[], None]
) -> bool:
    """Poll ``condition`` until true (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        check()
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def parse(value: bytes) -> tuple[str, int]:
    key, number = value.decode().split(":")
    return key, int(number)


def assert_stored_exactly_once(sender: Sender, stored: list[bytes]) -> None:
    counts = collections.Counter(stored)
    duplicated = [v for v, n in counts.items() if n > 1]
    assert not duplicated, f"stored more than once: {duplicated[:5]}"
    missing = [v for v in sender.acked if v not in counts]
    assert not missing, f"acknowledged but not stored: {missing[:5]}"
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for value in stored:
        key, number = parse(value)
        by_key[key].append(number)
    for key, numbers in by_key.items():
        assert numbers == sorted(numbers), f"{key} stored out of send order"


async def assert_refuses_producers(broker: ClusterBroker, topic: str) -> None:
    """The woken old owner takes no producer for the topic (so no write either)."""
    pool = ConnectionPool(broker.service_url)
    try:
        conn = await pool.get()
        request_id = conn.new_request_id()
        try:
            await conn.request(commands.producer(topic, 1, request_id, "late"), request_id)
        except AnabranchError:
            return
        raise AssertionError(f"{broker.broker_id} accepted a producer for {topic} it lost")
    finally:
        await pool.close()


async def pause_while_sending(
    owner: ClusterBroker, sender: Sender, stalled: Sequence[str] | None
) -> float:
    """Pause ``owner`` once ``sender`` is going; assert that sends of the ``stalled`` keys
    (None: all) are acknowledged again before it is resumed. Returns the stall."""
    sender.start()
    try:
        assert await wait_for(lambda: len(sender.acked) >= 50, 30, sender.check)
        owner.pause()
        paused_at = time.monotonic()
        try:
            resumed = await wait_for(
                lambda: sender.acks_after(paused_at, stalled) >= RESUMED_ACKS,
                PAUSE_WINDOW_S,
                sender.check,
            )
        finally:
            owner.resume()
        assert resumed, f"no send acknowledged in {PAUSE_WINDOW_S}s while the owner slept"
        await asyncio.sleep(1.0)  # sends go on after the old owner woke, too
        await sender.stop()
    finally:
        await sender.cancel()
    first = sender.first_ack_after(paused_at, stalled)
    assert first is not None
    print(f"\nstall after the pause: {first - paused_at:.2f}s (session TTL {SESSION_TTL_S}s)")
    assert not sender.errors, sender.errors[:3]
    return first - paused_at


async def test_pause_of_the_owner_moves_the_producer_before_it_wakes(
    three_brokers: LocalCluster,
) -> None:
    cluster = three_brokers
    topic = f"persistent://public/default/{fresh_name('paused-owner')}"
    owner = await cluster.owner_of(topic)
    survivor = others(cluster, owner)[0]
    # The paused broker first in the service URL: lookups must go elsewhere too.
    url = "pulsar://" + ",".join(b.broker_id for b in [owner, *others(cluster, owner)])
    async with Client(url) as client:
        producer = await client.create_producer(topic)
        sender = Sender(producer, ["a", "b", "c"])
        await pause_while_sending(owner, sender, None)
    new_owner = await cluster.owner_of(topic, via=survivor)
    assert new_owner is not owner
    await assert_refuses_producers(owner, topic)
    assert_stored_exactly_once(sender, await read_all(survivor.service_url, topic))


async def test_pause_of_one_segment_owner_moves_that_segment_producer(
    three_brokers: LocalCluster,
) -> None:
    cluster = three_brokers
    topic, leader = await create_topic(cluster, 2)
    layout = await layout_of(cluster, topic, leader)
    names = segment_names(topic, layout)
    owner = await cluster.segment_owner(names[0])
    assert owner is not None
    survivor = others(cluster, owner)[0]
    ranges = {int(i): s["hashRange"] for i, s in layout["segments"].items()}
    keys: dict[int, list[str]] = {i: [] for i in ranges}
    for key in (f"key-{n}" for n in range(100)):
        for i, r in ranges.items():
            if r["start"] <= segment_hash(key) <= r["end"] and len(keys[i]) < 3:
                keys[i].append(key)
    mixed = [k for pair in zip(keys[0], keys[1], strict=True) for k in pair]
    async with Client(cluster.service_url) as client:
        producer = await client.create_producer(topic)
        sender = Sender(producer, mixed)
        await pause_while_sending(owner, sender, keys[0])
    new_owner = await cluster.segment_owner(names[0], via=survivor)
    assert new_owner is not None and new_owner is not owner
    await assert_refuses_producers(owner, names[0])
    stored: list[bytes] = []
    for name in names.values():
        stored.extend(await read_all(survivor.service_url, name))
    assert_stored_exactly_once(sender, stored)

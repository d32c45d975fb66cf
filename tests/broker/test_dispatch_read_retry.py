"""A dispatch pass whose ledger read fails retries by itself, with a bounded backoff.

The ``dispatch-read-fails`` failpoint makes every dispatcher read raise a storage error
while it is on. Before the timed retry, a failed pass only waited for the next kick (a new
publish, new permits): a consumer whose read failed once stalled although the storage had
recovered. Here nothing kicks the dispatcher after the fault heals, so only the retry can
deliver.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from anabranch import failpoints
from anabranch.aio import Client
from anabranch.broker.topic import PersistentTopic
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/read-retry"
COUNT = 20
HANG_GUARD_S = 10.0
POLL_ROUNDS = 2_000


@pytest.fixture
def fault_off() -> Iterator[None]:
    """Whatever a test did, the failpoint is off afterwards (it is process-wide)."""
    yield
    failpoints.activate(())


@pytest.fixture
async def broker(tmp_path: Path, fault_off: None) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path) as running:
        yield running


def loaded(broker: InProcessBroker, name: str) -> PersistentTopic:
    topic = broker.service.loaded_topic(name)
    assert topic is not None
    return topic


async def failures_reach(topic: PersistentTopic, at_least: int) -> None:
    for _ in range(POLL_ROUNDS):
        if topic.dispatch_read_failures >= at_least:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"only {topic.dispatch_read_failures} failed reads, not {at_least}")


async def test_reads_failing_then_healing_deliver_everything_without_a_new_publish(
    broker: InProcessBroker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="anabranch.broker.dispatcher")
    async with Client(broker.service_url) as client:
        producer = await client.create_producer(TOPIC, batching=False)
        sent = [f"m{i}".encode() for i in range(COUNT)]
        for value in sent:
            await producer.send(value)
        failpoints.activate({failpoints.DISPATCH_READ_FAILS})
        consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
        topic = loaded(broker, TOPIC)
        await failures_reach(topic, 3)  # the read failed, and was tried again by itself
        failpoints.activate(())  # the storage heals; nobody publishes or sends permits
        received: list[bytes] = []
        for _ in range(COUNT):
            msg = await consumer.receive(timeout=HANG_GUARD_S)
            assert msg is not None, f"stalled after {len(received)} messages"
            received.append(msg.value)
            await consumer.acknowledge(msg)
        assert received == sent
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings  # one line per failure streak, not per retry
        assert any("after" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        dispatcher = topic.subscriptions["s"].dispatcher
        assert dispatcher.read_failure_streak == 0  # reset by the successful read
        assert await read_failures_metric(broker, TOPIC) == topic.dispatch_read_failures


async def test_retries_back_off_and_stop_when_the_topic_closes(broker: InProcessBroker) -> None:
    async with Client(broker.service_url) as client:
        producer = await client.create_producer(TOPIC + "-closed", batching=False)
        await producer.send(b"x")
        failpoints.activate({failpoints.DISPATCH_READ_FAILS})
        await client.subscribe(TOPIC + "-closed", "s", initial_position="earliest")
        topic = loaded(broker, TOPIC + "-closed")
        await failures_reach(topic, 4)
        dispatcher = topic.subscriptions["s"].dispatcher
        delays = dispatcher.read_retry_delays
        assert delays == sorted(delays)  # growing: no busy loop against a broken storage
        assert delays[-1] > delays[0]
        await broker.service.unload_topic(TOPIC + "-closed")
        seen = topic.dispatch_read_failures
        await asyncio.sleep(2 * delays[-1])
        assert topic.dispatch_read_failures == seen  # the closed topic's retry stopped


async def read_failures_metric(broker: InProcessBroker, topic: str) -> float:
    assert broker.http_url is not None
    async with aiohttp.ClientSession() as http, http.get(broker.http_url + "/metrics") as resp:
        text = await resp.text()
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "anabranch_dispatch_read_failures_total"
        and sample.labels.get("topic") == topic
    )

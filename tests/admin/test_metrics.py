"""The Prometheus collector: counters, scrape-to-scrape rates, broker-wide counters."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from anabranch.broker import metrics
from anabranch.broker.metrics import BrokerCollector, BrokerCounters, render
from anabranch.client.client import Client
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/metered"
LABELS = {"cluster": "c1", "namespace": "public/default", "topic": TOPIC}


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


async def produce(broker: InProcessBroker, count: int) -> None:
    async with Client(broker.service_url) as client:
        producer = await client.create_producer(TOPIC, batching=False)
        for i in range(count):
            await producer.send(b"x" * 10 + str(i).encode())
        await producer.close()


async def test_rates_are_computed_between_scrapes(broker: InProcessBroker) -> None:
    now = [100.0]
    counters = BrokerCounters(connections_opened=5, connections_closed=2, bad_frames=7)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        BrokerCollector(
            broker.service.loaded_topics, counters, cluster="c1", monotonic=lambda: now[0]
        )
    )
    await produce(broker, 3)
    # Every get_sample_value is one scrape.
    assert registry.get_sample_value("anabranch_rate_in", LABELS) == 0.0  # first scrape
    await produce(broker, 4)
    now[0] = 102.0
    assert registry.get_sample_value("anabranch_rate_in", LABELS) == 2.0  # 4 msgs in 2 s
    assert registry.get_sample_value("anabranch_rate_in", LABELS) == 0.0  # no time passed
    assert registry.get_sample_value("anabranch_in_messages_total", LABELS) == 7
    assert registry.get_sample_value("anabranch_active_connections", {"cluster": "c1"}) == 3
    assert registry.get_sample_value("anabranch_bad_frames_total", {"cluster": "c1"}) == 7


async def test_unloaded_topics_disappear_from_the_exposition(broker: InProcessBroker) -> None:
    await produce(broker, 1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(broker.service.loaded_topics, cluster="c1"))
    text = render(registry).decode()
    assert TOPIC in text
    await broker.service.delete_topic(TOPIC)
    families = list(text_string_to_metric_families(render(registry).decode()))
    assert not any(s.labels.get("topic") == TOPIC for f in families for s in f.samples)
    assert any(f.name == "anabranch_topics_count" for f in families)


async def test_a_scrape_is_formatted_off_the_event_loop(
    broker: InProcessBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collectors run on the loop (the broker's state is not thread-safe); formatting,
    most of a scrape's cost, runs in a worker thread."""
    await produce(broker, 3)
    threads: list[str] = []
    real = prometheus_client.generate_latest

    def recording(registry: Any) -> bytes:
        threads.append(threading.current_thread().name)
        return real(registry)

    monkeypatch.setattr(metrics, "generate_latest", recording)
    assert broker.http_url is not None
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{broker.http_url}/metrics") as answer,
    ):
        text = await answer.text()
    assert threads and threading.main_thread().name not in threads
    families = text_string_to_metric_families(text)
    [family] = [f for f in families if f.name == "anabranch_in_messages"]
    assert any(s.labels.get("topic") == TOPIC and s.value == 3 for s in family.samples)

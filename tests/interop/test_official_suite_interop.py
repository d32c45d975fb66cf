"""Behaviours the official ``pulsar-client`` test suite relies on, checked with the official
client against our broker (regressions found by running that suite; our own tests).

Schema evolution: upstream's validator (Avro's resolving grammar) matches records by their
fields, not their names, so a producer whose record class was renamed may still evolve a
topic's schema when the fields resolve; a renamed record whose fields do not resolve is
still refused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pulsar
from pulsar.schema import Integer, JsonSchema, Record, String

from anabranch.admin.client import AdminClient
from anabranch.testing.broker import InProcessBroker


class Order(Record):  # type: ignore[misc]
    sku = String()
    qty = Integer()


# Renamed; qty now required: FORWARD (old readers still read it).
class OrderV2(Record):  # type: ignore[misc]
    _sorted_fields = True
    sku = String()
    qty = Integer(required=True)


# Renamed; the same fields with defaults: FULL.
class OrderDefaults(Record):  # type: ignore[misc]
    sku = String(required_default=True)
    qty = Integer(required_default=True)


# Renamed; sku is no longer a string: compatible under no strategy.
class OrderBroken(Record):  # type: ignore[misc]
    sku = Integer(required=True)
    qty = Integer()


def evolve(url: str, topic: str, first: type[Record], then: type[Record]) -> str:
    """Create a producer with ``first`` then one with ``then`` on ``topic``; the outcome of
    the second, after a consumer with ``first`` read one message of each."""
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        old = client.create_producer(topic, schema=JsonSchema(first))
        consumer = client.subscribe(topic, "readers", schema=JsonSchema(first))
        try:
            new = client.create_producer(topic, schema=JsonSchema(then))
        except pulsar.PulsarException as err:
            return type(err).__name__
        old.send(first(sku="a-1", qty=1))
        new.send(then(sku="b-2", qty=2))
        got = [consumer.receive(10_000).value() for _ in range(2)]
        assert [(o.sku, o.qty) for o in got] == [("a-1", 1), ("b-2", 2)]
        return "ok"
    finally:
        client.close()


async def test_a_renamed_record_evolves_by_its_fields(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker:
        assert broker.http_url is not None
        url, base = broker.service_url, "persistent://public/default/suite-orders"
        # The broker's default strategy (FULL) takes a renamed record with defaults ...
        assert await asyncio.to_thread(evolve, url, f"{base}-full", Order, OrderDefaults) == "ok"
        # ... but not one whose field type changed, renamed or not.
        refused = await asyncio.to_thread(evolve, url, f"{base}-broken", Order, OrderBroken)
        assert refused == "IncompatibleSchema"
        async with AdminClient(broker.http_url) as admin:
            await admin.set_schema_compatibility_strategy("public/default", "FORWARD")
        assert await asyncio.to_thread(evolve, url, f"{base}-forward", Order, OrderV2) == "ok"

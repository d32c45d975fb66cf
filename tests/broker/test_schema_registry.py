"""The schema registry on a metadata store: strategies, delete markers, the version bound,
separate histories per domain, a subscriber's schema, concurrent registrations."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from anabranch.broker.schema import SchemaRegistry, decode_version, same_schema
from anabranch.core.names import TopicName
from anabranch.core.schema_compat import Strategy
from anabranch.errors import IncompatibleSchema, NotFound, SchemaVersionsExhausted
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.protocol._generated import pulsar_api_pb2 as pb

TOPIC = "persistent://public/default/users"


def avro(*fields: dict[str, Any]) -> pb.Schema:
    definition = {"type": "record", "name": "User", "fields": list(fields)}
    return pb.Schema(name="u", type=pb.Schema.Avro, schema_data=json.dumps(definition).encode())


V1 = avro({"name": "name", "type": "string"})
V2 = avro({"name": "name", "type": "string"}, {"name": "age", "type": "int", "default": 0})
V3_REQUIRED = avro({"name": "name", "type": "string"}, {"name": "zip", "type": "string"})


def registry(strategy: Strategy = Strategy.FULL, versions_max: int = 1000) -> SchemaRegistry:
    async def strategy_of(_: TopicName) -> Strategy:
        return strategy

    return SchemaRegistry(MemoryMetadataStore(), strategy_of, versions_max=versions_max)


async def test_compatible_evolution_gets_new_versions_and_the_rest_is_refused() -> None:
    r = registry(Strategy.BACKWARD)
    assert decode_version(await r.get_or_create(TOPIC, V1)) == 0
    assert decode_version(await r.get_or_create(TOPIC, V2)) == 1
    assert decode_version(await r.get_or_create(TOPIC, V1)) == 0  # an existing version
    with pytest.raises(IncompatibleSchema, match="BACKWARD"):
        await r.get_or_create(TOPIC, V3_REQUIRED)
    with pytest.raises(IncompatibleSchema, match="AVRO, not STRING"):
        await r.get_or_create(TOPIC, pb.Schema(name="s", type=pb.Schema.String))
    assert [v.number for v in await r.live(TOPIC)] == [0, 1]


async def test_always_strategies_and_invalid_definitions() -> None:
    loose = registry(Strategy.ALWAYS_COMPATIBLE)
    await loose.get_or_create(TOPIC, V1)
    await loose.get_or_create(TOPIC, pb.Schema(name="s", type=pb.Schema.String))
    strict = registry(Strategy.ALWAYS_INCOMPATIBLE)
    await strict.get_or_create(TOPIC, V1)
    await strict.get_or_create(TOPIC, V1)
    with pytest.raises(IncompatibleSchema, match="ALWAYS_INCOMPATIBLE"):
        await strict.get_or_create(TOPIC, V2)
    with pytest.raises(IncompatibleSchema, match="invalid AVRO schema"):
        await registry().get_or_create(TOPIC, pb.Schema(type=pb.Schema.Avro, schema_data=b"{"))


async def test_delete_marker_starts_a_new_history_and_force_removes_it() -> None:
    r = registry(Strategy.FULL)
    await r.get_or_create(TOPIC, V1)
    assert await r.delete(TOPIC) == 1
    assert await r.delete(TOPIC) is None  # already deleted: nothing to do
    with pytest.raises(NotFound):
        await r.get(TOPIC)
    with pytest.raises(NotFound, match="delete marker"):
        await r.get_version(TOPIC, 1)
    assert (await r.get_version(TOPIC, 0)).schema == V1  # history is kept
    # Checked against nothing: a schema FULL would refuse after V1 is accepted now.
    assert decode_version(await r.get_or_create(TOPIC, V3_REQUIRED)) == 2
    assert await r.delete(TOPIC, force=True) == 2
    assert await r.history(TOPIC) == []
    assert decode_version(await r.get_or_create(TOPIC, V1)) == 0


async def test_versions_per_topic_are_bounded() -> None:
    r = registry(Strategy.ALWAYS_COMPATIBLE, versions_max=3)
    for i in range(3):
        await r.get_or_create(TOPIC, pb.Schema(type=pb.Schema.String, schema_data=b"%d" % i))
    with pytest.raises(SchemaVersionsExhausted, match="3 schema versions"):
        await r.get_or_create(TOPIC, pb.Schema(type=pb.Schema.String, schema_data=b"new"))
    # An existing version still answers; a forced delete frees the history.
    await r.get_or_create(TOPIC, pb.Schema(type=pb.Schema.String, schema_data=b"1"))
    await r.delete(TOPIC, force=True)
    await r.get_or_create(TOPIC, pb.Schema(type=pb.Schema.String, schema_data=b"new"))


async def test_domains_keep_separate_histories_and_partitions_share_their_base() -> None:
    r = registry()
    await r.get_or_create(TOPIC, V1)
    await r.get_or_create("topic://public/default/users", pb.Schema(type=pb.Schema.String))
    assert (await r.get(TOPIC + "-partition-3"))[0] == V1
    schema, _ = await r.get("topic://public/default/users")
    assert schema.type == pb.Schema.String
    with pytest.raises(NotFound):
        await r.get("persistent://public/default/other")


async def test_a_subscriber_schema_is_registered_only_on_an_idle_topic() -> None:
    r = registry(Strategy.BACKWARD)
    await r.check_for_consumer(TOPIC, V1, idle=False)
    assert await r.history(TOPIC) == []  # a busy topic without a schema takes none
    await r.check_for_consumer(TOPIC, V1, idle=True)
    assert [v.schema for v in await r.live(TOPIC)] == [V1]
    await r.check_for_consumer(TOPIC, V2, idle=False)  # compatible: accepted, not stored
    assert len(await r.history(TOPIC)) == 1
    with pytest.raises(IncompatibleSchema):
        await r.check_for_consumer(TOPIC, V3_REQUIRED, idle=False)


async def test_concurrent_registrations_get_distinct_versions() -> None:
    r = registry(Strategy.ALWAYS_COMPATIBLE)
    schemas = [pb.Schema(type=pb.Schema.String, schema_data=b"%d" % i) for i in range(8)]
    versions = await asyncio.gather(*(r.get_or_create(TOPIC, s) for s in schemas))
    assert sorted(decode_version(v) for v in versions) == list(range(8))
    for schema, version in zip(schemas, versions, strict=True):
        assert same_schema((await r.get(TOPIC, version))[0], schema)

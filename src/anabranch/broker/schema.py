"""The schema registry: numbered schema versions per topic, checked for compatibility.

Each topic name has its own history, *per domain*: ``persistent://t/ns/x`` and
``topic://t/ns/x`` never share schemas (Pulsar keys schemas by tenant/namespace/name only).
Partitions share their base topic's history and segments their scalable topic's. A version
is upstream's ``LongSchemaVersion``: the number as 8 big-endian bytes.

Registering a schema (a producer's, GET_OR_CREATE_SCHEMA, the admin upload) that equals a
live version (type, data and properties) returns that version. Any other schema is checked
against the live versions under the topic's compatibility strategy (topic policy, else the
namespace's, else the broker's ``schema_compatibility_strategy``; Pulsar's default FULL):
AVRO and JSON definitions by Avro schema resolution (:mod:`anabranch.core.schema_compat`),
other types by type alone; then it becomes the next version. A topic holds at most
``schema_versions_max`` versions (delete markers included) so that a client cycling
schemas cannot grow the store without bound.

Deleting a topic's schema (admin) appends a *delete marker* version, as Pulsar does: the
history is kept, numbering continues, and the next schema is checked against nothing.
``force`` (and deleting the topic) removes every record.

Paths::

    /schemas/<domain>/<tenant>/<ns>/<local name>/<version:020d>
        {"name", "type": int, "data": b64, "properties", "timestamp": ms, "deleted": bool}

Example:
    >>> import asyncio
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo(store: MetadataStore) -> None:
    ...     registry = SchemaRegistry(store)
    ...     schema = pb.Schema(name="s", type=pb.Schema.String, schema_data=b"")
    ...     v = await registry.get_or_create("persistent://public/default/t", schema)
    ...     assert await registry.get_or_create("persistent://public/default/t", schema) == v
    ...     print(decode_version(v))        # v is the 8-byte version of the wire
    ...     await store.close()
    >>> asyncio.run(demo(MemoryMetadataStore()))
    0
"""

from __future__ import annotations

import base64
import json
import re
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from anabranch.core.names import SegmentName, TopicName, parse_name
from anabranch.core.schema_compat import (
    Incompatible,
    InvalidAvroSchema,
    Strategy,
    check_compatible,
    parse_avro,
)
from anabranch.errors import (
    AlreadyExists,
    BadVersion,
    IncompatibleSchema,
    InvalidArgument,
    NotFound,
    SchemaVersionsExhausted,
)
from anabranch.metadata.api import MetadataStore
from anabranch.protocol._generated import pulsar_api_pb2 as pb

_VERSION = struct.Struct(">q")
ROOT = "/schemas"
SCHEMA_VERSIONS_MAX_DEFAULT = 1000
AVRO_TYPES = frozenset({pb.Schema.Avro, pb.Schema.Json})
"""Types whose data is an Avro definition (Pulsar's JSON schemas are Avro definitions)."""

StrategyOf = Callable[[TopicName], Awaitable[Strategy]]


def encode_version(version: int) -> bytes:
    """Upstream's wire form of a schema version.

    Example:
        >>> encode_version(1).hex()
        '0000000000000001'
    """
    return _VERSION.pack(version)


def decode_version(data: bytes) -> int:
    """Inverse of :func:`encode_version`; anything else is InvalidArgument."""
    if len(data) != _VERSION.size:
        raise InvalidArgument(f"schema version must be 8 bytes, got {len(data)}")
    return int(_VERSION.unpack(data)[0])


def schema_owner(topic: str | TopicName | SegmentName) -> TopicName:
    """The topic whose history ``topic`` uses: its base (partitions) or scalable topic.

    Example:
        >>> str(schema_owner("persistent://public/default/t-partition-2"))
        'persistent://public/default/t'
    """
    name = parse_name(topic) if isinstance(topic, str) else topic
    if isinstance(name, SegmentName):
        name = name.topic
    assert isinstance(name, TopicName)
    return name.base if name.partition is not None else name


def _base_path(topic: str | TopicName | SegmentName) -> str:
    name = schema_owner(topic)
    return f"{ROOT}/{name.domain.value}/{name.tenant}/{name.namespace}/{name.local_name}"


@dataclass(frozen=True)
class SchemaVersion:
    """One stored version (a delete marker has ``deleted`` set and no schema)."""

    number: int
    schema: pb.Schema
    timestamp_ms: int
    deleted: bool = False

    @property
    def version(self) -> bytes:
        """The wire form of :attr:`number`."""
        return encode_version(self.number)


def _to_json(schema: pb.Schema, *, deleted: bool = False) -> dict[str, Any]:
    return {
        "name": schema.name,
        "type": int(schema.type),
        "data": base64.b64encode(schema.schema_data).decode(),
        "properties": sorted((p.key, p.value) for p in schema.properties),
        "timestamp": int(time.time() * 1000),
        "deleted": deleted,
    }


def _from_json(number: int, obj: dict[str, Any]) -> SchemaVersion:
    schema = pb.Schema(
        name=obj["name"], type=obj["type"], schema_data=base64.b64decode(obj["data"])
    )
    for key, value in obj["properties"]:
        schema.properties.add(key=key, value=value)
    return SchemaVersion(
        number, schema, int(obj.get("timestamp", 0)), bool(obj.get("deleted", False))
    )


def same_schema(a: pb.Schema, b: pb.Schema) -> bool:
    """Upstream's equality: type, data and properties (the name is the client's label)."""
    props = sorted((p.key, p.value) for p in a.properties)
    return (a.type, a.schema_data, props) == (
        b.type, b.schema_data, sorted((p.key, p.value) for p in b.properties),
    )  # fmt: skip


def check_against(strategy: Strategy, live: list[SchemaVersion], new: pb.Schema) -> None:
    """Raise IncompatibleSchema unless ``new`` may follow the ``live`` versions.

    Example:
        >>> s = pb.Schema(name="s", type=pb.Schema.String)
        >>> n = pb.Schema(name="n", type=pb.Schema.Int32)
        >>> try:
        ...     check_against(Strategy.FULL, [SchemaVersion(0, s, 0)], n)
        ... except IncompatibleSchema as err:
        ...     print(err)
        incompatible schema: the topic's schema type is STRING, not INT32
    """
    if new.type in AVRO_TYPES:
        try:
            parse_avro(new.schema_data)
        except InvalidAvroSchema as err:
            raise IncompatibleSchema(
                f"invalid {schema_type_name(new.type)} schema: {err}"
            ) from None
    if not live or strategy is Strategy.ALWAYS_COMPATIBLE:
        return
    latest = live[-1].schema
    if latest.type != new.type:
        raise IncompatibleSchema(
            f"incompatible schema: the topic's schema type is {schema_type_name(latest.type)},"
            f" not {schema_type_name(new.type)}"
        )
    if strategy is Strategy.ALWAYS_INCOMPATIBLE:
        raise IncompatibleSchema("incompatible schema: the strategy is ALWAYS_INCOMPATIBLE")
    if new.type not in AVRO_TYPES:
        return
    same_type = [v.schema.schema_data for v in live if v.schema.type == new.type]
    try:
        check_compatible(strategy, same_type, new.schema_data)
    except Incompatible as err:
        raise IncompatibleSchema(f"incompatible schema: {err}") from None


def _rest_name(wire_name: str) -> str:
    if wire_name == "Bool":
        return "BOOLEAN"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", wire_name).upper()


SCHEMA_TYPES: dict[str, int] = {_rest_name(n): int(v) for n, v in pb.Schema.Type.items()}
"""Pulsar's REST ``SchemaType`` names (``KEY_VALUE``, ``BOOLEAN``) → wire values."""
_TYPE_NAMES = {v: n for n, v in SCHEMA_TYPES.items()}


def schema_type_name(value: int) -> str:
    """The REST name of a wire schema type.

    Example:
        >>> schema_type_name(pb.Schema.KeyValue), schema_type_name(pb.Schema.Bool)
        ('KEY_VALUE', 'BOOLEAN')
    """
    return _TYPE_NAMES.get(value, str(value))


def schema_type_value(name: str) -> int:
    """The wire value of a REST schema type name; InvalidArgument names the valid ones.

    Example:
        >>> schema_type_value("avro") == pb.Schema.Avro
        True
    """
    try:
        return SCHEMA_TYPES[name.strip().upper()]
    except KeyError:
        raise InvalidArgument(
            f"unknown schema type {name!r}; one of {', '.join(SCHEMA_TYPES)}"
        ) from None


async def _broker_default(_: TopicName) -> Strategy:
    return Strategy.FULL


class SchemaRegistry:
    """Schema versions per topic (see the module docstring).

    ``strategy_of`` answers the strategy in force for a topic (policies); ``versions_max``
    bounds each topic's history.
    """

    def __init__(
        self,
        store: MetadataStore,
        strategy_of: StrategyOf = _broker_default,
        *,
        versions_max: int = SCHEMA_VERSIONS_MAX_DEFAULT,
    ) -> None:
        self.store = store
        self.strategy_of = strategy_of
        self.versions_max = versions_max

    async def history(self, topic: str | TopicName | SegmentName) -> list[SchemaVersion]:
        """Every stored version of ``topic``'s history, oldest first (markers included)."""
        base = _base_path(topic) + "/"
        out: list[SchemaVersion] = []
        start_after: str | None = None
        while True:
            page = await self.store.list_prefix(base, limit=256, start_after=start_after)
            for record in page.records:
                child = record.path[len(base) :]
                if child.isdigit():
                    out.append(_from_json(int(child), json.loads(record.value)))
            if not page.more or not page.records:
                return out
            start_after = page.records[-1].path

    async def live(self, topic: str | TopicName | SegmentName) -> list[SchemaVersion]:
        """The versions after the last delete marker, oldest first."""
        history = await self.history(topic)
        cut = max((i for i, v in enumerate(history) if v.deleted), default=-1)
        return history[cut + 1 :]

    async def strategy(self, topic: str | TopicName | SegmentName) -> Strategy:
        """The compatibility strategy in force for ``topic``."""
        return await self.strategy_of(schema_owner(topic))

    async def get_or_create(self, topic: str, schema: pb.Schema) -> bytes:
        """The version of ``schema`` on ``topic``, registering it if new and compatible
        (IncompatibleSchema otherwise; SchemaVersionsExhausted past the bound)."""
        base = _base_path(topic)
        while True:
            history = await self.history(topic)
            cut = max((i for i, v in enumerate(history) if v.deleted), default=-1)
            live = history[cut + 1 :]
            for version in live:
                if same_schema(version.schema, schema):
                    return version.version
            check_against(await self.strategy(topic), live, schema)
            if len(history) >= self.versions_max:
                raise SchemaVersionsExhausted(str(schema_owner(topic)), self.versions_max)
            number = history[-1].number + 1 if history else 0
            try:
                await self.store.put(
                    f"{base}/{number:020d}",
                    json.dumps(_to_json(schema)).encode(),
                    expected_version=0,
                )
            except (AlreadyExists, BadVersion):
                continue  # a concurrent registration took this number: look again
            return encode_version(number)

    async def check(self, topic: str, schema: pb.Schema) -> Strategy:
        """Raise IncompatibleSchema unless ``schema`` could be registered (or is already a
        live version); registers nothing. Answers the strategy applied."""
        strategy = await self.strategy(topic)
        live = await self.live(topic)
        if not any(same_schema(v.schema, schema) for v in live):
            check_against(strategy, live, schema)
        return strategy

    async def check_for_consumer(self, topic: str, schema: pb.Schema, *, idle: bool) -> None:
        """A subscriber's schema (Pulsar's ``addSchemaIfIdleOrCheckCompatible``): an idle
        topic without a schema takes it; a topic with schemas must be able to accept it."""
        live = await self.live(topic)
        if not live:
            if idle:
                await self.get_or_create(topic, schema)
            return
        if not any(same_schema(v.schema, schema) for v in live):
            check_against(await self.strategy(topic), live, schema)

    async def version_of(self, topic: str, schema: pb.Schema) -> bytes:
        """The live version equal to ``schema``; NotFound if none."""
        for version in await self.live(topic):
            if same_schema(version.schema, schema):
                return version.version
        raise NotFound(f"no version of {schema_owner(topic)}'s schema equals the one given")

    async def get(self, topic: str, version: bytes | None = None) -> tuple[pb.Schema, bytes]:
        """The schema at ``version`` (default: the latest); NotFound if there is none or it
        was deleted."""
        found = await self.get_version(topic, None if version is None else decode_version(version))
        return found.schema, found.version

    async def get_version(self, topic: str, number: int | None = None) -> SchemaVersion:
        """The stored version ``number`` (default: the latest live one); NotFound if there is
        none or it is a delete marker."""
        owner = schema_owner(topic)
        if number is not None:
            record = await self.store.get(f"{_base_path(topic)}/{number:020d}")
            if record is None:
                raise NotFound(f"schema version {number} of {owner}")
            found = _from_json(number, json.loads(record.value))
            if found.deleted:
                raise NotFound(f"schema version {number} of {owner} is a delete marker")
            return found
        live = await self.live(topic)
        if not live:
            raise NotFound(f"schema of {owner}")
        return live[-1]

    async def delete(self, topic: str | TopicName, *, force: bool = False) -> int | None:
        """Delete ``topic``'s schema: append a delete marker (answers its version, None when
        there was nothing to delete), or with ``force`` remove the whole history."""
        base = _base_path(topic)
        while True:
            history = await self.history(topic)
            if force:
                for version in history:
                    await self.store.delete(f"{base}/{version.number:020d}")
                return history[-1].number if history else None
            if not history or history[-1].deleted:
                return None
            number = history[-1].number + 1
            marker = pb.Schema(name="", type=history[-1].schema.type)
            try:
                await self.store.put(
                    f"{base}/{number:020d}",
                    json.dumps(_to_json(marker, deleted=True)).encode(),
                    expected_version=0,
                )
            except (AlreadyExists, BadVersion):
                continue
            return number

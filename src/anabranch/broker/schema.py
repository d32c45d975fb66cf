"""A simple schema registry: numbered schema versions per topic, in the metadata store.

Partitions share their base topic's schemas (upstream keys schemas by the base name).
A version is upstream's ``LongSchemaVersion``: the number as 8 big-endian bytes. Asking
for a schema that equals an existing version (type, data and properties) returns that
version; any other schema becomes the next version. Compatibility strategies are not
enforced yet (upstream's default, BACKWARD, accepts most evolutions anyway).

Paths::

    /schemas/<tenant>/<ns>/<local name>/<version:020d>   {"type": int, "data": b64, ...}

Example:
    >>> async def demo(store: MetadataStore) -> None:
    ...     registry = SchemaRegistry(store)
    ...     schema = pb.Schema(name="s", type=pb.Schema.String, schema_data=b"")
    ...     v = await registry.get_or_create("persistent://public/default/t", schema)
    ...     assert await registry.get_or_create("persistent://public/default/t", schema) == v
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

from anabranch.core.names import SegmentName, TopicName, parse_name
from anabranch.errors import AlreadyExists, BadVersion, InvalidArgument, NotFound
from anabranch.metadata.api import MetadataStore
from anabranch.protocol._generated import pulsar_api_pb2 as pb

_VERSION = struct.Struct(">q")


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


def _base_path(topic: str) -> str:
    name = parse_name(topic)
    if isinstance(name, SegmentName):
        name = name.topic
    assert isinstance(name, TopicName)
    return f"/schemas/{name.tenant}/{name.namespace}/{name.local_name}"


def _to_json(schema: pb.Schema) -> dict[str, Any]:
    return {
        "name": schema.name,
        "type": int(schema.type),
        "data": base64.b64encode(schema.schema_data).decode(),
        "properties": sorted((p.key, p.value) for p in schema.properties),
    }


def _from_json(obj: dict[str, Any]) -> pb.Schema:
    schema = pb.Schema(
        name=obj["name"], type=obj["type"], schema_data=base64.b64decode(obj["data"])
    )
    for key, value in obj["properties"]:
        schema.properties.add(key=key, value=value)
    return schema


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    # The name is the client's label; upstream compares type, data and properties.
    return (a["type"], a["data"], a["properties"]) == (b["type"], b["data"], b["properties"])


class SchemaRegistry:
    """Schema versions per topic (see the module docstring)."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store

    async def _versions(self, base: str) -> list[tuple[int, dict[str, Any]]]:
        out = []
        for child in await self.store.list_children(base):
            record = await self.store.get(f"{base}/{child}")
            if record is not None:
                out.append((int(child), json.loads(record.value)))
        return out

    async def get_or_create(self, topic: str, schema: pb.Schema) -> bytes:
        """The version of ``schema`` on ``topic``, registering it if new."""
        base = _base_path(topic)
        wanted = _to_json(schema)
        while True:
            versions = await self._versions(base)
            for number, stored in versions:
                if _same(stored, wanted):
                    return encode_version(number)
            number = versions[-1][0] + 1 if versions else 0
            try:
                await self.store.put(
                    f"{base}/{number:020d}", json.dumps(wanted).encode(), expected_version=0
                )
            except (AlreadyExists, BadVersion):
                continue  # a concurrent registration took this number: look again
            return encode_version(number)

    async def get(self, topic: str, version: bytes | None = None) -> tuple[pb.Schema, bytes]:
        """The schema at ``version`` (default: the latest); NotFound if there is none."""
        base = _base_path(topic)
        if version is not None:
            number = decode_version(version)
            record = await self.store.get(f"{base}/{number:020d}")
            if record is None:
                raise NotFound(f"schema version {number} of {topic}")
            return _from_json(json.loads(record.value)), version
        versions = await self._versions(base)
        if not versions:
            raise NotFound(f"schema of {topic}")
        number, stored = versions[-1]
        return _from_json(stored), encode_version(number)

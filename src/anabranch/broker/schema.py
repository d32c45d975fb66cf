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
    /schemas/<domain>/<tenant>/<ns>/<local name>/head
        {"next": the next version's number, "live_from": the first live version's}
    /schemas/<domain>/<tenant>/<ns>/<local name>/hash/<schema_digest>
        {"version": the version last registered with that schema}

DESIGN: the cost of a request does not grow with the history. A version record holds up
to 1 MiB and a topic up to ``schema_versions_max`` of them, so decoding the history per
request let a 40-byte GET_SCHEMA cost hundreds of megabytes and seconds of event loop.

* ``head`` names the latest version and where the live ones start: the latest schema
  (GET_SCHEMA, a new schema's check under a non-transitive strategy, a delete marker) is
  one record away.
* ``hash/<digest>`` finds the live version equal to a schema (a known schema registered
  again, a producer's or subscriber's schema, the admin's version lookup) in one record.
  The version record it names is read to confirm: a stale hash record costs a miss, never
  a wrong answer.
* A registration (or delete marker) commits its version record, its hash record and the
  new head at once, on condition that the head is the one it read: concurrent
  registrations serialize on the head, as they did on the version number before.
* Only what needs the history reads it: a transitive strategy's check of a *new* schema,
  the admin's all-versions listing, and indexing a history without a head. Such walks
  read ``limits.SCHEMA_HISTORY_PAGE_RECORDS`` records at a time, at most
  ``limits.SCHEMA_HISTORY_WALKS_MAX`` of them run at once, and records larger than
  ``limits.SCHEMA_DECODE_INLINE_BYTES_MAX`` are decoded on a worker thread.
* Histories written before heads existed have none: the first request indexes them (one
  walk; reads never change the version records). A head that disagrees with the records
  (its latest version is gone, or its next number is taken) is rebuilt from them the same
  way, so a writer that does not keep the index cannot leave it wrong for good.

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

import asyncio
import base64
import hashlib
import json
import re
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from anabranch import limits
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
from anabranch.metadata.api import MetadataStore, Op, Put
from anabranch.protocol._generated import pulsar_api_pb2 as pb

_VERSION = struct.Struct(">q")
ROOT = "/schemas"
SCHEMA_VERSIONS_MAX_DEFAULT = 1000
AVRO_TYPES = frozenset({pb.Schema.Avro, pb.Schema.Json})
"""Types whose data is an Avro definition (Pulsar's JSON schemas are Avro definitions)."""
_HEAD = "head"
_HASHES = "hash"
_VERSIONS_END = ":"
"""Sorts right after "9": the version keys (digits) lie below ``<base>/:``, ``head`` and
``hash/...`` above it."""

StrategyOf = Callable[[TopicName], Awaitable[Strategy]]
_T = TypeVar("_T")
_Raw = list[tuple[int, bytes]]
"""One page of a walk: (version number, stored value) pairs, oldest first."""


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


def _version_path(base: str, number: int) -> str:
    return f"{base}/{number:020d}"


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


@dataclass(frozen=True)
class _Head:
    """A topic's index: versions ``[live_from, end)`` are live, ``end`` is the next number.
    ``stat_version`` is the head record's store version (0: there is none yet), the
    condition of the next write.

    Example:
        >>> _Head(end=3, live_from=3).has_live          # the latest version is a marker
        False
    """

    end: int
    live_from: int
    stat_version: int = 0

    @property
    def has_live(self) -> bool:
        """Whether there is a live version (else none at all, or the latest is a marker)."""
        return self.live_from < self.end


def _head_value(end: int, live_from: int) -> bytes:
    return json.dumps({"next": end, "live_from": live_from}).encode()


def _hash_value(number: int) -> bytes:
    return json.dumps({"version": number}).encode()


def _to_json(schema: pb.Schema, *, deleted: bool = False) -> dict[str, Any]:
    return {
        "name": schema.name,
        "type": int(schema.type),
        "data": base64.b64encode(schema.schema_data).decode(),
        "properties": sorted((p.key, p.value) for p in schema.properties),
        "timestamp": int(time.time() * 1000),
        "deleted": deleted,
    }


def _encode(schema: pb.Schema, *, deleted: bool = False) -> bytes:
    return json.dumps(_to_json(schema, deleted=deleted)).encode()


def _from_json(number: int, obj: dict[str, Any]) -> SchemaVersion:
    schema = pb.Schema(
        name=obj["name"], type=obj["type"], schema_data=base64.b64decode(obj["data"])
    )
    for key, value in obj["properties"]:
        schema.properties.add(key=key, value=value)
    return SchemaVersion(
        number, schema, int(obj.get("timestamp", 0)), bool(obj.get("deleted", False))
    )


def _decode(number: int, value: bytes) -> SchemaVersion:
    return _from_json(number, json.loads(value))


def _decode_page(raw: _Raw) -> list[SchemaVersion]:
    return [_decode(number, value) for number, value in raw]


def _index_page(raw: _Raw) -> list[tuple[int, bool, str]]:
    """(number, is a delete marker, digest) per version: what the index is built from."""
    return [(v.number, v.deleted, schema_digest(v.schema)) for v in _decode_page(raw)]


def _definitions_page(schema_type: int, raw: _Raw) -> list[bytes]:
    """The data of the page's versions of ``schema_type`` (what a transitive check uses)."""
    return [
        v.schema.schema_data
        for v in _decode_page(raw)
        if not v.deleted and v.schema.type == schema_type
    ]


async def _off_loop(work: Callable[[], _T], size: int) -> _T:
    """``work()`` here when its input is ``size`` bytes at most
    SCHEMA_DECODE_INLINE_BYTES_MAX, else on a worker thread: decoding a 1 MiB record takes
    milliseconds, a page of them far longer, and every other connection waits meanwhile.

    Example:
        >>> asyncio.run(_off_loop(lambda: 6 * 7, 10))
        42
    """
    if size <= limits.SCHEMA_DECODE_INLINE_BYTES_MAX:
        return work()
    return await asyncio.to_thread(work)


def schema_digest(schema: pb.Schema) -> str:
    """The SHA-256 (hex) of what :func:`same_schema` compares: equal schemas, equal digests.

    Example:
        >>> a = pb.Schema(name="a", type=pb.Schema.String, schema_data=b"x")
        >>> b = pb.Schema(name="b", type=pb.Schema.String, schema_data=b"x")
        >>> c = pb.Schema(name="a", type=pb.Schema.Json, schema_data=b"x")
        >>> schema_digest(a) == schema_digest(b), schema_digest(a) == schema_digest(c)
        (True, False)
    """
    props = sorted((p.key, p.value) for p in schema.properties)
    digest = hashlib.sha256(json.dumps([int(schema.type), props]).encode())
    # The JSON is self-delimiting and holds no raw newline: no two schemas hash one input.
    digest.update(b"\n")
    digest.update(schema.schema_data)
    return digest.hexdigest()


def same_schema(a: pb.Schema, b: pb.Schema) -> bool:
    """Upstream's equality: type, data and properties (the name is the client's label)."""
    props = sorted((p.key, p.value) for p in a.properties)
    return (a.type, a.schema_data, props) == (
        b.type, b.schema_data, sorted((p.key, p.value) for p in b.properties),
    )  # fmt: skip


def _check_definitions(strategy: Strategy, existing: list[bytes], new: bytes) -> None:
    try:
        check_compatible(strategy, existing, new)
    except Incompatible as err:
        raise IncompatibleSchema(f"incompatible schema: {err}") from None


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
    _check_definitions(strategy, same_type, new.schema_data)


def _transitive(strategy: Strategy) -> bool:
    return strategy.value.endswith("_TRANSITIVE")


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


class _StaleHead(Exception):
    """The head named a latest version that is not there; it was rebuilt: look again."""


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
        self._walks = asyncio.Semaphore(limits.SCHEMA_HISTORY_WALKS_MAX)

    # --- reading ----------------------------------------------------------------------------

    async def history(self, topic: str | TopicName | SegmentName) -> list[SchemaVersion]:
        """Every stored version of ``topic``'s history, oldest first (markers included).
        Reads the whole history: for the admin and tests, never a client's request."""
        async with self._walks:
            return [v async for page in self._walk(_base_path(topic), _decode_page) for v in page]

    async def live(self, topic: str | TopicName | SegmentName) -> list[SchemaVersion]:
        """The versions after the last delete marker, oldest first (the admin's
        all-versions listing: reads every live version)."""
        base = _base_path(topic)
        head = await self._head(base)
        if not head.has_live:
            return []
        async with self._walks:
            walk = self._walk(base, _decode_page, head.live_from)
            found = [v async for page in walk for v in page]
        # Versions a writer that keeps no index appended after a marker: cut there too.
        cut = max((i for i, v in enumerate(found) if v.deleted), default=-1)
        return found[cut + 1 :]

    async def strategy(self, topic: str | TopicName | SegmentName) -> Strategy:
        """The compatibility strategy in force for ``topic``."""
        return await self.strategy_of(schema_owner(topic))

    async def get(self, topic: str, version: bytes | None = None) -> tuple[pb.Schema, bytes]:
        """The schema at ``version`` (default: the latest); NotFound if there is none or it
        was deleted."""
        found = await self.get_version(topic, None if version is None else decode_version(version))
        return found.schema, found.version

    async def get_version(self, topic: str, number: int | None = None) -> SchemaVersion:
        """The stored version ``number`` (default: the latest live one); NotFound if there is
        none or it is a delete marker. Reads the head and one version."""
        owner, base = schema_owner(topic), _base_path(topic)
        if number is not None:
            found = await self._read(base, number)
            if found is None:
                raise NotFound(f"schema version {number} of {owner}")
            if found.deleted:
                raise NotFound(f"schema version {number} of {owner} is a delete marker")
            return found
        while True:
            head = await self._head(base)
            if not head.has_live:
                raise NotFound(f"schema of {owner}")
            try:
                return await self._latest(base, head)
            except _StaleHead:
                continue

    async def version_of(self, topic: str, schema: pb.Schema) -> bytes:
        """The live version equal to ``schema``; NotFound if none."""
        base = _base_path(topic)
        number = await self._find(base, await self._head(base), schema)
        if number is None:
            raise NotFound(f"no version of {schema_owner(topic)}'s schema equals the one given")
        return encode_version(number)

    # --- registering ------------------------------------------------------------------------

    async def get_or_create(self, topic: str, schema: pb.Schema) -> bytes:
        """The version of ``schema`` on ``topic``, registering it if new and compatible
        (IncompatibleSchema otherwise; SchemaVersionsExhausted past the bound)."""
        base = _base_path(topic)
        while True:
            head = await self._head(base)
            found = await self._find(base, head, schema)
            if found is not None:
                return encode_version(found)
            try:
                await self._check_new(await self.strategy(topic), base, head, schema)
            except _StaleHead:
                continue
            if head.end >= self.versions_max:
                raise SchemaVersionsExhausted(str(schema_owner(topic)), self.versions_max)
            number = head.end
            value = await _off_loop(partial(_encode, schema), len(schema.schema_data))
            ops: list[Op] = [
                Put(f"{base}/{_HEAD}", _head_value(number + 1, head.live_from), head.stat_version),
                Put(_version_path(base, number), value, expected_version=0),
                Put(f"{base}/{_HASHES}/{schema_digest(schema)}", _hash_value(number)),
            ]
            if await self._append(base, head, ops):
                return encode_version(number)

    async def check(self, topic: str, schema: pb.Schema) -> Strategy:
        """Raise IncompatibleSchema unless ``schema`` could be registered (or is already a
        live version); registers nothing. Answers the strategy applied."""
        strategy = await self.strategy(topic)
        base = _base_path(topic)
        while True:
            head = await self._head(base)
            if await self._find(base, head, schema) is not None:
                return strategy
            try:
                await self._check_new(strategy, base, head, schema)
            except _StaleHead:
                continue
            return strategy

    async def check_for_consumer(self, topic: str, schema: pb.Schema, *, idle: bool) -> None:
        """A subscriber's schema (Pulsar's ``addSchemaIfIdleOrCheckCompatible``): an idle
        topic without a schema takes it; a topic with schemas must be able to accept it."""
        base = _base_path(topic)
        while True:
            head = await self._head(base)
            if not head.has_live:
                if idle:
                    await self.get_or_create(topic, schema)
                return
            if await self._find(base, head, schema) is not None:
                return
            try:
                await self._check_new(await self.strategy(topic), base, head, schema)
            except _StaleHead:
                continue
            return

    async def delete(self, topic: str | TopicName, *, force: bool = False) -> int | None:
        """Delete ``topic``'s schema: append a delete marker (answers its version, None when
        there was nothing to delete), or with ``force`` remove the whole history."""
        base = _base_path(topic)
        if force:
            return await self._remove(base)
        while True:
            head = await self._head(base)
            if not head.has_live:
                return None
            try:
                latest = await self._latest(base, head)
            except _StaleHead:
                continue
            number = head.end
            marker = pb.Schema(name="", type=latest.schema.type)
            ops: list[Op] = [
                Put(f"{base}/{_HEAD}", _head_value(number + 1, number + 1), head.stat_version),
                Put(_version_path(base, number), _encode(marker, deleted=True), 0),
            ]
            if await self._append(base, head, ops):
                return number

    # --- the index --------------------------------------------------------------------------

    async def _read(self, base: str, number: int) -> SchemaVersion | None:
        record = await self.store.get(_version_path(base, number))
        if record is None:
            return None
        return await _off_loop(partial(_decode, number, record.value), len(record.value))

    async def _head(self, base: str) -> _Head:
        """The topic's index, indexing a history written without one first."""
        while True:
            record = await self.store.get(f"{base}/{_HEAD}")
            if record is not None:
                obj = json.loads(record.value)
                return _Head(int(obj["next"]), int(obj["live_from"]), record.stat.version)
            # Names only: a history without a head is rare, an empty one is not.
            if not any(name.isdigit() for name in await self.store.list_children(base)):
                return _Head(0, 0)
            await self._reindex(base, expected=0)

    async def _latest(self, base: str, head: _Head) -> SchemaVersion:
        """The head's latest version (``head.has_live``); _StaleHead when it is not there."""
        found = await self._read(base, head.end - 1)
        if found is None or found.deleted:
            await self._reindex(base, expected=head.stat_version)
            raise _StaleHead
        return found

    async def _find(self, base: str, head: _Head, schema: pb.Schema) -> int | None:
        """The live version equal to ``schema``, or None: its hash record and the version
        record that confirms it, whatever the history's length."""
        if not head.has_live:
            return None
        record = await self.store.get(f"{base}/{_HASHES}/{schema_digest(schema)}")
        if record is None:
            return None
        number = int(json.loads(record.value)["version"])
        if not head.live_from <= number < head.end:
            return None  # registered before the last delete marker: not live
        found = await self._read(base, number)
        if found is None or found.deleted or not same_schema(found.schema, schema):
            return None
        return number

    async def _check_new(
        self, strategy: Strategy, base: str, head: _Head, schema: pb.Schema
    ) -> None:
        """:func:`check_against` the live versions, reading only what ``strategy`` compares:
        the latest version, and the older ones only for a transitive strategy's Avro check."""
        if not head.has_live:
            check_against(strategy, [], schema)
            return
        check_against(strategy, [await self._latest(base, head)], schema)
        if schema.type not in AVRO_TYPES or not _transitive(strategy):
            return
        async with self._walks:
            older = self._walk(
                base, partial(_definitions_page, schema.type), head.live_from, head.end - 1
            )
            async for definitions in older:
                if not definitions:
                    continue
                size = sum(map(len, definitions)) + len(schema.schema_data)
                check = partial(_check_definitions, strategy, definitions, schema.schema_data)
                await _off_loop(check, size)

    async def _append(self, base: str, head: _Head, ops: list[Op]) -> bool:
        """Commit a new version (``ops[0]`` puts the head ``head`` was read as); False when
        another write came first (the caller looks again), after rebuilding the index when
        the version number was taken behind the head's back."""
        try:
            await self.store.commit(ops)
        except (AlreadyExists, BadVersion) as err:
            if isinstance(err, BadVersion) and err.path != ops[0].path:
                await self._reindex(base, expected=head.stat_version)
            return False
        return True

    async def _walk(
        self,
        base: str,
        decode: Callable[[_Raw], _T],
        first: int = 0,
        end: int | None = None,
    ) -> AsyncIterator[_T]:
        """``decode`` of each page of the versions numbered ``[first, end)`` (default: to
        the last), oldest first. Callers hold ``_walks``: a page is up to
        SCHEMA_HISTORY_PAGE_RECORDS records of up to a MiB each."""
        start = _version_path(base, first)
        stop = f"{base}/{_VERSIONS_END}" if end is None else _version_path(base, end)
        prefix = base + "/"
        while start < stop:
            page = await self.store.list_range(
                start, stop, limit=limits.SCHEMA_HISTORY_PAGE_RECORDS
            )
            raw = [
                (int(r.path[len(prefix) :]), r.value)
                for r in page.records
                if r.path[len(prefix) :].isdigit()
            ]
            if raw:
                yield await _off_loop(partial(decode, raw), sum(len(v) for _, v in raw))
            if not page.more or not page.records:
                return
            start = page.records[-1].path + "\x00"

    async def _reindex(self, base: str, *, expected: int) -> None:
        """Build the head and hash records from the version records, unless the head's
        store version is no longer ``expected`` (someone wrote or rebuilt it meanwhile)."""
        head_path = f"{base}/{_HEAD}"
        async with self._walks:
            record = await self.store.get(head_path)
            if (0 if record is None else record.stat.version) != expected:
                return
            end, live_from = 0, 0
            digests: dict[str, int] = {}
            async for page in self._walk(base, _index_page):
                for number, deleted, digest in page:
                    end = number + 1
                    if deleted:
                        live_from = end
                        digests.clear()
                    else:
                        digests.setdefault(digest, number)  # the oldest equal one answers
        if end == 0:
            # The versions are gone (a forced delete ran meanwhile): so is the index, and
            # numbering starts at 0 again.
            await self._remove_index(base, expected)
            return
        puts = [Put(f"{base}/{_HASHES}/{d}", _hash_value(n)) for d, n in digests.items()]
        for i in range(0, len(puts), limits.METADATA_TXN_OPS_MAX):
            await self.store.commit(puts[i : i + limits.METADATA_TXN_OPS_MAX])
        try:
            await self.store.put(head_path, _head_value(end, live_from), expected)
        except (AlreadyExists, BadVersion):
            pass  # written meanwhile: the caller reads that one

    async def _delete_hashes(self, base: str) -> None:
        for digest in await self.store.list_children(f"{base}/{_HASHES}"):
            await self.store.delete(f"{base}/{_HASHES}/{digest}")

    async def _remove_index(self, base: str, expected: int) -> None:
        await self._delete_hashes(base)
        try:
            await self.store.delete(f"{base}/{_HEAD}", expected_version=expected)
        except BadVersion:
            pass

    async def _remove(self, base: str) -> int | None:
        """Delete every record of the history (keys are listed, values never read); the
        latest number there was, None if none. Again while registrations race it."""
        last: int | None = None
        while True:
            head = await self.store.get(f"{base}/{_HEAD}")
            numbers = [int(n) for n in await self.store.list_children(base) if n.isdigit()]
            for number in numbers:
                await self.store.delete(_version_path(base, number))
            if numbers:  # sorted: the names are zero-padded
                last = numbers[-1] if last is None else max(last, numbers[-1])
            await self._delete_hashes(base)
            try:
                # Absent (0) when there was none: a first registration meanwhile is caught.
                await self.store.delete(
                    f"{base}/{_HEAD}", expected_version=0 if head is None else head.stat.version
                )
            except BadVersion:
                continue  # a registration came in meanwhile: remove that too
            return last

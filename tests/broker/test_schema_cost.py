"""What a schema request costs: the records it reads must not grow with the topic's history
(a probe registered 100 versions of 780 KB, and each 40-byte GET_SCHEMA then decoded all
of them on the event loop), walks of a whole history are paged and bounded, and histories
written before the index existed still read the same."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from typing import Any

import pytest

from anabranch import limits
from anabranch.broker import schema as schema_module
from anabranch.broker.schema import SchemaRegistry, SchemaVersion, decode_version
from anabranch.core.names import TopicName
from anabranch.core.schema_compat import Strategy
from anabranch.errors import IncompatibleSchema, NotFound
from anabranch.metadata.api import MetadataStore, Page, Record
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from tests.metadata_backends import etcd_server, store

__all__ = ["etcd_server", "store"]  # pytest fixtures

TOPIC = "persistent://public/default/users"
BASE = "/schemas/persistent/public/default/users"


class CountingStore(MemoryMetadataStore):
    """A memory store that counts the records (values) handed out and the largest
    number of listings in progress at once."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.largest_page = 0
        self.listings = 0
        self.most_listings = 0

    async def get(self, path: str) -> Record | None:
        record = await super().get(path)
        self.reads += record is not None
        return record

    async def list_range(self, start: str, end: str, *, limit: int | None = None) -> Page:
        self.listings += 1
        self.most_listings = max(self.most_listings, self.listings)
        try:
            await asyncio.sleep(0)  # let other walks in, as a real store's round trip does
            page = await super().list_range(start, end, limit=limit)
        finally:
            self.listings -= 1
        self.reads += len(page.records)
        self.largest_page = max(self.largest_page, len(page.records))
        return page

    async def list_prefix(
        self, prefix: str, *, limit: int | None = None, start_after: str | None = None
    ) -> Page:
        page = await super().list_prefix(prefix, limit=limit, start_after=start_after)
        self.reads += len(page.records)
        return page


def registry(store: MetadataStore, strategy: Strategy = Strategy.FULL) -> SchemaRegistry:
    async def strategy_of(_: TopicName) -> Strategy:
        return strategy

    return SchemaRegistry(store, strategy_of)


def string(i: int, size: int = 16) -> pb.Schema:
    return pb.Schema(name="s", type=pb.Schema.String, schema_data=b"%d" % i * size)


def avro(i: int) -> pb.Schema:
    fields = [{"name": f"f{j}", "type": "int", "default": 0} for j in range(i)]
    definition = {"type": "record", "name": "U", "fields": fields}
    return pb.Schema(name="u", type=pb.Schema.Avro, schema_data=json.dumps(definition).encode())


async def reads_of(store: CountingStore, request: Any) -> int:
    before = store.reads
    await request
    return store.reads - before


async def costs(versions: int) -> dict[str, int]:
    """Records read by each kind of request on a topic with ``versions`` versions."""
    store = CountingStore()
    r = registry(store)
    for i in range(versions):
        await r.get_or_create(TOPIC, string(i))
    known = string(1)
    out = {
        "GET_SCHEMA latest": await reads_of(store, r.get(TOPIC)),
        "GET_SCHEMA version": await reads_of(store, r.get_version(TOPIC, 1)),
        "GET_OR_CREATE known": await reads_of(store, r.get_or_create(TOPIC, known)),
        "version_of": await reads_of(store, r.version_of(TOPIC, known)),
        "check known": await reads_of(store, r.check(TOPIC, known)),
        "subscriber known": await reads_of(store, r.check_for_consumer(TOPIC, known, idle=False)),
        "subscriber new": await reads_of(
            store, r.check_for_consumer(TOPIC, string(-1), idle=False)
        ),
        "GET_OR_CREATE new": await reads_of(store, r.get_or_create(TOPIC, string(-2))),
        "delete marker": await reads_of(store, r.delete(TOPIC)),
    }
    await store.close()
    return out


async def test_requests_read_a_few_records_whatever_the_history_length() -> None:
    short, long = await costs(3), await costs(60)
    assert short == long
    assert max(long.values()) <= 3, long  # head, hash record, one version


async def test_get_schema_reads_only_the_latest_of_large_versions() -> None:
    store = CountingStore()
    r = registry(store)
    for i in range(20):
        await r.get_or_create(TOPIC, string(i, size=20_000))
    before = store.reads
    schema, version = await r.get(TOPIC)
    assert store.reads - before == 2  # the head and the latest version
    assert decode_version(version) == 19 and schema == string(19, size=20_000)


async def test_a_transitive_check_of_a_new_schema_walks_the_history_in_pages() -> None:
    store = CountingStore()
    r = registry(store, Strategy.BACKWARD_TRANSITIVE)
    count = 3 * limits.SCHEMA_HISTORY_PAGE_RECORDS + 1
    for i in range(count):
        await r.get_or_create(TOPIC, avro(i))
    # A known schema is still found without the history.
    assert await reads_of(store, r.get_or_create(TOPIC, avro(0))) <= 3
    # A new one is checked against every live version, a page at a time.
    store.largest_page = 0
    assert await reads_of(store, r.get_or_create(TOPIC, avro(count))) >= count
    assert 0 < store.largest_page <= limits.SCHEMA_HISTORY_PAGE_RECORDS
    # Non-transitive: the latest only.
    plain = CountingStore()
    p = registry(plain, Strategy.BACKWARD)
    for i in range(count):
        await p.get_or_create(TOPIC, avro(i))
    assert await reads_of(plain, p.get_or_create(TOPIC, avro(count))) <= 3


async def test_a_transitive_check_still_refuses_what_an_old_version_cannot_read() -> None:
    r = registry(CountingStore(), Strategy.FORWARD_TRANSITIVE)
    required = pb.Schema(
        name="u",
        type=pb.Schema.Avro,
        schema_data=b'{"type":"record","name":"U","fields":[{"name":"a","type":"int"}]}',
    )
    optional = pb.Schema(
        name="u",
        type=pb.Schema.Avro,
        schema_data=b'{"type":"record","name":"U","fields":'
        b'[{"name":"a","type":"int","default":0}]}',
    )
    dropped = pb.Schema(
        name="u", type=pb.Schema.Avro, schema_data=b'{"type":"record","name":"U","fields":[]}'
    )
    await r.get_or_create(TOPIC, required)
    for i in range(limits.SCHEMA_HISTORY_PAGE_RECORDS + 2):
        optional.properties.add(key="n", value=str(i))  # a distinct, compatible version
        await r.get_or_create(TOPIC, optional)
    # Only the first version (pages away from the latest) needs "a": refused for it.
    with pytest.raises(IncompatibleSchema, match="FORWARD_TRANSITIVE"):
        await r.get_or_create(TOPIC, dropped)


async def test_walks_of_whole_histories_are_bounded_at_once() -> None:
    store = CountingStore()
    r = registry(store, Strategy.ALWAYS_COMPATIBLE)
    for i in range(4 * limits.SCHEMA_HISTORY_PAGE_RECORDS):
        await r.get_or_create(TOPIC, string(i))
    store.most_listings = 0
    lists = await asyncio.gather(*(r.live(TOPIC) for _ in range(8)))
    assert all(len(found) == 4 * limits.SCHEMA_HISTORY_PAGE_RECORDS for found in lists)
    assert store.most_listings == limits.SCHEMA_HISTORY_WALKS_MAX


async def test_large_records_are_decoded_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: list[bool] = []
    decode = schema_module._decode

    def spy(number: int, value: bytes) -> SchemaVersion:
        threads.append(threading.current_thread() is threading.main_thread())
        return decode(number, value)

    monkeypatch.setattr(schema_module, "_decode", spy)
    r = registry(CountingStore())
    await r.get_or_create(TOPIC, string(1))
    big = pb.Schema(
        type=pb.Schema.String, schema_data=b"x" * (limits.SCHEMA_DECODE_INLINE_BYTES_MAX + 1)
    )
    await r.get_or_create(TOPIC, big)
    threads.clear()
    await r.get_version(TOPIC, 0)
    await r.get_version(TOPIC, 1)
    assert threads == [True, False]  # the small one here, the large one on a worker


def old_record(schema: pb.Schema, *, deleted: bool = False) -> bytes:
    """A version record as the registry wrote it before the index existed."""
    return json.dumps(
        {
            "name": schema.name,
            "type": int(schema.type),
            "data": base64.b64encode(schema.schema_data).decode(),
            "properties": sorted((p.key, p.value) for p in schema.properties),
            "timestamp": 1,
            "deleted": deleted,
        }
    ).encode()


async def test_a_history_written_without_the_index_reads_the_same() -> None:
    store = CountingStore()
    old = [string(0), string(1), None, string(2), string(3)]  # None: a delete marker
    for number, schema in enumerate(old):
        value = old_record(schema or string(9), deleted=schema is None)
        await store.put(f"{BASE}/{number:020d}", value, expected_version=0)
    r = registry(store)
    assert (await r.get(TOPIC))[0] == string(3)
    assert [v.number for v in await r.live(TOPIC)] == [3, 4]
    assert decode_version(await r.get_or_create(TOPIC, string(2))) == 3
    with pytest.raises(NotFound, match="delete marker"):
        await r.get_version(TOPIC, 2)
    # Before the marker: not live, so registered again as the next number.
    assert decode_version(await r.get_or_create(TOPIC, string(0))) == 5
    # Indexed once; from then on a request reads a few records.
    assert await reads_of(store, r.get(TOPIC)) == 2
    assert await reads_of(store, r.get_or_create(TOPIC, string(3))) == 3


async def test_a_version_written_behind_the_index_is_not_overwritten() -> None:
    store = CountingStore()
    r = registry(store, Strategy.ALWAYS_COMPATIBLE)
    await r.get_or_create(TOPIC, string(0))
    # A writer that does not keep the index (an older broker) appends version 1.
    await store.put(f"{BASE}/{1:020d}", old_record(string(1)), expected_version=0)
    assert decode_version(await r.get_or_create(TOPIC, string(2))) == 2
    assert [v.schema for v in await r.history(TOPIC)] == [string(0), string(1), string(2)]
    assert decode_version(await r.get_or_create(TOPIC, string(1))) == 1
    # ... or deletes the latest: the one before answers.
    await store.delete(f"{BASE}/{2:020d}")
    assert decode_version((await r.get(TOPIC))[1]) == 1


async def test_a_forced_delete_removes_the_index_too() -> None:
    store = CountingStore()
    r = registry(store)
    for i in range(3):
        await r.get_or_create(TOPIC, string(i))
    assert await r.delete(TOPIC, force=True) == 2
    assert not (await store.list_prefix(BASE + "/")).records
    assert await r.delete(TOPIC, force=True) is None
    with pytest.raises(NotFound):
        await r.get(TOPIC)
    assert decode_version(await r.get_or_create(TOPIC, string(5))) == 0


async def test_the_index_on_every_backend(store: MetadataStore) -> None:
    """Commits, conflicts and the rebuild behind them hold on SQLite and etcd too."""
    await store.put(f"{BASE}/{0:020d}", old_record(string(0)), expected_version=0)
    r = registry(store, Strategy.ALWAYS_COMPATIBLE)
    versions = await asyncio.gather(*(r.get_or_create(TOPIC, string(i)) for i in range(1, 6)))
    assert sorted(decode_version(v) for v in versions) == [1, 2, 3, 4, 5]
    await store.put(f"{BASE}/{6:020d}", old_record(string(6)), expected_version=0)
    assert decode_version(await r.get_or_create(TOPIC, string(7))) == 7
    assert decode_version(await r.get_or_create(TOPIC, string(6))) == 6
    assert await r.delete(TOPIC) == 8
    assert decode_version(await r.get_or_create(TOPIC, string(0))) == 9
    assert await r.delete(TOPIC, force=True) == 9
    assert not (await store.list_prefix("/schemas/")).records

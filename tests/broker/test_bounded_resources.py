"""Per-broker bounds (issue 15, bounded resources): writer threads and open files shared by
every ledger, connections per broker and per address, topics loaded, pending lookups, and
auto-creation that writes nothing when it would not create.

Each test starts a real broker (or ledger factory) and would fail without its bound: a
thread or descriptor per ledger, an accepted connection over the cap, a loaded topic over
the cap, a lookup answered past the pending bound, a registered topic past the namespace
cap.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from anabranch import limits
from anabranch.errors import NotAllowed, NotFound, ResourceLimitReached
from anabranch.metadata.api import MetadataStore
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import EARLIEST
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_core_protocol import RawClient

pytestmark = pytest.mark.timeout(120)

T = pb.BaseCommand
WAIT_S = 10.0
"""Only turns a hang into a failure; never a performance assertion."""


async def all_keys(store: MetadataStore) -> list[str]:
    keys: list[str] = []
    start: str | None = None
    while True:
        page = await store.list_prefix("/", start_after=start)
        keys += [r.path for r in page.records]
        if not page.more or not page.records:
            return keys
        start = page.records[-1].path


async def recv(client: RawClient) -> pb.BaseCommand:
    frame = await asyncio.wait_for(client.recv(), WAIT_S)
    assert frame is not None, "the broker closed the connection"
    return frame.command


# --- writer threads and open files ------------------------------------------------------------


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_200_topics_share_a_few_writer_threads(tmp_path: Path) -> None:
    before = threading.active_count()
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        topics = [
            await broker.service.get_topic(f"persistent://public/default/t-{i}", create=True)
            for i in range(200)
        ]
        positions = await asyncio.gather(*(t.ledger.append(b"x") for t in topics))
        assert len(positions) == 200
        grown = threading.active_count() - before
        # The pool plus asyncio's default executor (min(32, cpus + 4)) and a few helpers;
        # a thread per ledger would be 200 more.
        executor = min(32, (os.cpu_count() or 1) + 4)
        assert grown <= limits.STORAGE_WRITER_THREADS + executor + 4, grown
        factory = broker.service.ledgers
        assert isinstance(factory, FileManagedLedgerFactory)
        assert factory.writers.threads <= limits.STORAGE_WRITER_THREADS


async def test_open_ledger_files_are_bounded_and_reopened(tmp_path: Path) -> None:
    store = MemoryMetadataStore()
    factory = FileManagedLedgerFactory(tmp_path, store, open_files_max=8)
    fds = fd_count()
    ledgers = [await factory.open(f"t/ns/persistent/l-{i}") for i in range(40)]
    for round_ in range(3):
        await asyncio.gather(*(ml.append(b"%d" % round_) for ml in ledgers))
    assert factory.handles.open_count <= 8
    assert fd_count() - fds <= 8 + 2  # a reopen may be under way on an executor thread
    assert factory.handles.reopened > 0
    for ml in ledgers:  # every entry reads back after its file was closed and reopened
        entries = await ml.read(EARLIEST, 3)
        assert [e.data for e in entries] == [b"0", b"1", b"2"]
    await factory.close()
    await store.close()


# --- connections ------------------------------------------------------------------------------


@pytest.fixture
async def capped(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(
        tmp_path, metadata="memory", max_connections=2, max_topics_per_broker=3
    ) as b:
        yield b


async def test_a_connection_over_max_connections_is_refused_with_too_many_requests(
    capped: InProcessBroker,
) -> None:
    first, second = await RawClient.open(capped.port), await RawClient.open(capped.port)
    await first.handshake()
    await second.handshake()
    third = await RawClient.open(capped.port)
    await third.send(commands.connect("over", pb.v21))
    error = await recv(third)
    assert error.type == T.ERROR and error.error.error == pb.TooManyRequests
    assert "connections" in error.error.message
    assert await third.closed_by_broker() == []
    assert capped.service.counters.connections_refused == 1
    await first.close()
    for _ in range(100):  # the broker notices the close, then accepts a new one
        if capped.service.counters.active_connections < 2:
            break
        await asyncio.sleep(0.02)
    again = await RawClient.open(capped.port)
    await again.handshake()
    for c in (second, third, again):
        await c.close()


async def test_a_connection_over_max_connections_per_ip_is_refused(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, metadata="memory", max_connections_per_ip=1) as broker:
        first = await RawClient.open(broker.port)
        await first.handshake()
        second = await RawClient.open(broker.port)
        await second.send(commands.connect("over", pb.v21))
        error = await recv(second)
        assert error.type == T.ERROR and error.error.error == pb.TooManyRequests
        assert "address" in error.error.message
        await first.close()
        await second.close()


async def test_our_client_gets_the_typed_error(capped: InProcessBroker) -> None:
    from anabranch.client.client import Client
    from anabranch.client.errors import TooManyRequests

    holders = [await RawClient.open(capped.port) for _ in range(2)]
    for h in holders:
        await h.handshake()
    client = Client(capped.service_url, operation_timeout_s=3.0)
    try:
        with pytest.raises(TooManyRequests):
            await client.create_producer("persistent://public/default/over")
    finally:
        await client.close()
        for h in holders:
            await h.close()


def test_caps_can_only_be_lowered() -> None:
    from pydantic import ValidationError

    from anabranch.broker.config import BrokerConfig

    with pytest.raises(ValidationError):
        BrokerConfig.model_validate({"max_connections": limits.BROKER_CONNECTIONS_MAX + 1})
    with pytest.raises(ValidationError):
        BrokerConfig.model_validate({"max_topics_per_broker": limits.BROKER_TOPICS_MAX + 1})
    config = BrokerConfig.model_validate({"max_topics_per_broker": 5})
    assert config.max_topics_per_broker == 5


# --- topics loaded ----------------------------------------------------------------------------


async def test_a_topic_over_max_topics_per_broker_is_refused(capped: InProcessBroker) -> None:
    service = capped.service
    for i in range(3):
        await service.get_topic(f"persistent://public/default/cap-{i}", create=True)
    with pytest.raises(ResourceLimitReached):
        await service.get_topic("persistent://public/default/cap-3", create=True)
    assert service.counters.topics_refused == 1
    client = await RawClient.open(capped.port)
    await client.handshake()
    await client.send(commands.producer("persistent://public/default/cap-4", 1, 7))
    error = await recv(client)
    assert error.type == T.ERROR and error.error.error == pb.TooManyRequests
    # A loaded topic is still served.
    await client.send(commands.producer("persistent://public/default/cap-0", 2, 8))
    assert (await recv(client)).type == T.PRODUCER_SUCCESS
    await client.close()


# --- lookups ----------------------------------------------------------------------------------


async def test_lookups_over_the_pending_bound_get_too_many_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "SESSION_PENDING_LOOKUPS_MAX", 0)
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        client = await RawClient.open(broker.port)
        await client.handshake()
        lookup = pb.CommandLookupTopic(topic="persistent://public/default/l", request_id=1)
        await client.send(T(type=T.LOOKUP, lookupTopic=lookup))
        answer = (await recv(client)).lookupTopicResponse
        assert answer.response == pb.CommandLookupTopicResponse.Failed
        assert answer.error == pb.TooManyRequests
        meta = pb.CommandPartitionedTopicMetadata(
            topic="persistent://public/default/l", request_id=2
        )
        await client.send(T(type=T.PARTITIONED_METADATA, partitionMetadata=meta))
        response = (await recv(client)).partitionMetadataResponse
        assert response.error == pb.TooManyRequests
        assert broker.service.counters.lookups_refused == 2
        await client.close()


async def test_no_auto_creation_writes_nothing(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, metadata="memory", allow_auto_topic_creation=False) as b:
        store = b.service.store
        before = await all_keys(store)
        client = await RawClient.open(b.port)
        await client.handshake()
        for i in range(50):
            name = f"persistent://public/default/missing-{i}"
            await client.send(T(type=T.LOOKUP, lookupTopic=pb.CommandLookupTopic(
                topic=name, request_id=2 * i)))  # fmt: skip
            await recv(client)
            await client.send(commands.producer(name, i, 2 * i + 1))
            error = await recv(client)
            assert error.type == T.ERROR and error.error.error == pb.TopicNotFound
        assert await all_keys(store) == before
        assert b.service.counters.topics_not_auto_created == 50
        await client.close()


async def test_auto_creation_stops_at_max_topics_per_namespace(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, metadata="memory", max_topics_per_namespace=2) as b:
        service = b.service
        for i in range(2):
            await service.get_topic(f"persistent://public/default/ns-{i}", create=True)
        before = await all_keys(service.store)
        with pytest.raises(NotAllowed):
            await service.get_topic("persistent://public/default/ns-2", create=True)
        with pytest.raises(NotFound):
            await service.get_topic("persistent://public/default/ns-3", create=False)
        assert await all_keys(service.store) == before
        # An existing topic still loads (after an unload) although the namespace is full.
        await service.unload_topic("persistent://public/default/ns-0")
        await service.get_topic("persistent://public/default/ns-0", create=True)


def test_a_broker_process_does_not_load_what_it_does_not_use() -> None:
    """Idle RSS (issue 15: <= 80 MB): grpc (etcd), jwt/cryptography (token auth) and nats
    (JetStream storage) cost ~20 MB and are imported only by a broker that uses them."""
    import subprocess
    import sys

    heavy = ("grpc", "aetcd", "jwt", "cryptography", "nats")
    code = (
        "import sys, anabranch.cli.main, anabranch.broker.standalone;"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

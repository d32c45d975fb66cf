"""Ownership logic without processes: brokers as ClusterOwnership objects on one in-memory
store with a manual clock (session expiry on demand), plus the pure placement rule."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.broker.cluster.ownership import ClusterOwnership
from anabranch.broker.cluster.placement import broker_load, choose_broker
from anabranch.broker.cluster.records import (
    OwnerRecord,
    OwnerState,
    decode_owner,
    encode,
    ownership_path,
    topic_of_ownership_path,
)
from anabranch.broker.service import BrokerService
from anabranch.core.names import TopicName
from anabranch.errors import BadVersion, InvalidArgument, NotFound, NotOwner
from anabranch.metadata.api import Put
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import ProtocolConnection, Role
from anabranch.supervisor import Fatal
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.clock import ManualClock

TTL_S = 5.0
TOPIC = "persistent://public/default/t"

# --- placement (pure) -------------------------------------------------------------------------

loads_strategy = st.dictionaries(
    st.text(alphabet="abc123:.", min_size=1, max_size=8), st.integers(0, 50), max_size=6
)


@given(loads_strategy, st.text(max_size=20))
def test_choice_is_a_least_loaded_broker(loads: dict[str, int], topic: str) -> None:
    choice = choose_broker(topic, loads)
    if not loads:
        assert choice is None
    else:
        assert choice in loads and loads[choice] == min(loads.values())
        assert choose_broker(topic, dict(reversed(list(loads.items())))) == choice


def test_equal_loads_spread_topics_over_every_broker() -> None:
    loads = {f"10.0.0.{i}:6650": 0 for i in range(3)}
    chosen = [choose_broker(f"persistent://t/ns/topic-{i}", loads) for i in range(300)]
    counts = [chosen.count(b) for b in loads]
    assert min(counts) > 60, counts


def test_a_broker_with_hot_topics_gets_new_ones_last() -> None:
    # b1 owns fewer topics but carries 50k msg/s: the idle brokers take new topics first.
    loads = {"b1": broker_load(2, 50_000.0), "b2": broker_load(5, 10.0), "b3": broker_load(6, 0.0)}
    chosen = {choose_broker(f"persistent://t/ns/topic-{i}", loads) for i in range(50)}
    assert chosen == {"b2"}
    assert choose_broker(TOPIC, {"b1": broker_load(2, 0.0), "b2": broker_load(5, 10.0)}) == "b1"


@given(
    st.from_regex(r"(persistent|segment)://[a-z]{1,5}/[a-z]{1,5}/[a-z0-9-]{1,10}", fullmatch=True)
)
def test_ownership_paths_round_trip(topic: str) -> None:
    assert topic_of_ownership_path(ownership_path(topic)) == topic


def test_bad_records_are_invalid_arguments() -> None:
    with pytest.raises(InvalidArgument):
        decode_owner(b"{not json")
    with pytest.raises(InvalidArgument):
        ownership_path("no-scheme")


# --- ownership over one store -----------------------------------------------------------------


class FakeService:
    """What ClusterOwnership needs of a BrokerService: loaded topics, unloading, and
    whether a topic exists (names in ``missing`` do not and would not be created)."""

    def __init__(self) -> None:
        self.unloaded: list[str] = []
        self.missing: set[str] = set()
        self.loaded: set[str] = set()
        self.fatal = Fatal()

    def loaded_topics(self) -> list[Any]:
        return []

    def topic_in_use(self, name: str) -> bool:
        return name in self.loaded

    async def check_exists(self, name: TopicName, *, create: bool) -> bool:
        if str(name) in self.missing:
            raise NotFound(f"topic {name}")
        return False

    async def unload_topic(self, name: str) -> bool:
        self.unloaded.append(name)
        return True


class Broker:
    """A ClusterOwnership with a listening socket at its address (lookups probe owners)."""

    def __init__(self, store: MemoryMetadataStore, idle_release_s: float = 3600.0) -> None:
        self.service = FakeService()
        self.ownership = ClusterOwnership(
            store,
            cast(BrokerService, self.service),
            cluster="c",
            session_ttl_s=TTL_S,
            load_report_interval_s=3600.0,
            idle_release_s=idle_release_s,
        )
        self.server: asyncio.Server | None = None
        self.url = self.http = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(_hang_up, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url, self.http = f"pulsar://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
        await self.ownership.start(self.url, self.http)

    async def stop(self) -> None:
        await self.ownership.stop()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer the owner probe's CONNECT, then hang up (a live broker, as far as it asks)."""
    conn = ProtocolConnection(Role.BROKER)
    while data := await reader.read(65536):
        if any(f.type == pb.BaseCommand.CONNECT for f in conn.receive_data(data)):
            writer.write(conn.send(commands.connected("fake", pb.v21, 5 * 1024 * 1024)))
            await writer.drain()
            break
    writer.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def brokers(clock: ManualClock) -> AsyncIterator[list[Broker]]:
    store = MemoryMetadataStore(clock)
    started = [Broker(store) for _ in range(3)]
    for broker in started:
        await broker.start()
    yield started
    for broker in started:
        await broker.stop()
    await store.close()


async def test_concurrent_claims_leave_exactly_one_owner(brokers: list[Broker]) -> None:
    results = await asyncio.gather(
        *(b.ownership.claim(TOPIC) for b in brokers for _ in range(3)), return_exceptions=True
    )
    owners = [b for b in brokers if b.ownership.serving(TOPIC)]
    assert len(owners) == 1
    [owner] = owners
    for broker, result in zip([b for b in brokers for _ in range(3)], results, strict=True):
        if broker is owner:
            assert result is None
        else:
            assert isinstance(result, NotOwner)
            assert (result.owner_url, result.leader_url) == (owner.url, owner.http)


async def test_lookup_assigns_once_and_everyone_agrees(brokers: list[Broker]) -> None:
    first = await brokers[0].ownership.lookup(TOPIC)
    if first.redirect:  # another broker was chosen: it claims when asked authoritatively
        target = next(b for b in brokers if b.url == first.pulsar_url)
        claimed = await target.ownership.lookup(TOPIC, authoritative=True)
        assert not claimed.redirect and claimed.pulsar_url == target.url
    for broker in brokers:
        answer = await broker.ownership.lookup(TOPIC)
        assert not answer.redirect
        assert answer.pulsar_url == (first.pulsar_url)


async def test_unload_hands_the_topic_to_the_destination(brokers: list[Broker]) -> None:
    source, target, other = brokers
    await source.ownership.claim(TOPIC)
    destination = await source.ownership.unload(TOPIC, target.ownership.broker_id)
    assert destination == target.ownership.broker_id
    assert not source.ownership.serving(TOPIC) and source.service.unloaded == [TOPIC]
    record = decode_owner((await source.ownership._store.get(ownership_path(TOPIC))).value)  # type: ignore[union-attr]
    assert record.state is OwnerState.RELEASED and record.target == target.ownership.broker_id
    with pytest.raises(NotOwner):  # released to someone else
        await other.ownership.claim(TOPIC)
    answer = await other.ownership.lookup(TOPIC)  # lookups send clients to the target
    assert answer.redirect and answer.pulsar_url == target.url
    await target.ownership.claim(TOPIC)
    assert target.ownership.serving(TOPIC)


async def test_unload_at_a_non_owner_names_the_owner(brokers: list[Broker]) -> None:
    await brokers[0].ownership.claim(TOPIC)
    with pytest.raises(NotOwner) as raised:
        await brokers[1].ownership.unload(TOPIC)
    assert raised.value.leader_url == brokers[0].http


async def test_a_releasing_topic_cannot_be_taken(brokers: list[Broker]) -> None:
    owner = brokers[0]
    path = ownership_path(TOPIC)
    session = await owner.ownership._store.open_session(TTL_S)
    releasing = OwnerRecord("x:1", "pulsar://x:1", "http://x:2", OwnerState.RELEASING, None, 1)
    await owner.ownership._store.put(path, encode(releasing), session=session)
    with pytest.raises(NotOwner) as raised:
        await brokers[1].ownership.lookup(TOPIC)
    assert raised.value.leader_url is None  # moving: 503 / ServiceNotReady, retried


async def test_lookup_waits_out_a_dead_owner_and_reassigns(brokers: list[Broker]) -> None:
    dead, survivor, _ = brokers
    await dead.ownership.claim(TOPIC)
    assert dead.server is not None
    dead.server.close()  # the owner's address refuses connections: it crashed
    await dead.server.wait_closed()
    lookup = asyncio.ensure_future(survivor.ownership.lookup(TOPIC, authoritative=True))
    await asyncio.sleep(0.3)
    assert not lookup.done()  # not sent to the dead address: waiting for its record
    session = dead.ownership._session
    assert session is not None
    await session.close()  # the dead owner's session ends (etcd: its lease expires)
    answer = await lookup
    assert answer.pulsar_url == survivor.url and survivor.ownership.serving(TOPIC)


async def test_session_loss_stops_serving_before_anyone_can_take_over(
    brokers: list[Broker], clock: ManualClock
) -> None:
    owner, other, _ = brokers
    await owner.ownership.claim(TOPIC)
    assert owner.ownership.serving(TOPIC)
    # Nobody refreshes: pass the TTL on the store's clock.
    clock.advance(TTL_S + 0.1)
    assert not owner.ownership.serving(TOPIC)  # at once, before any expiry ran
    for _ in range(100):
        if TOPIC in owner.service.unloaded and owner.ownership._ready.is_set():
            break
        await asyncio.sleep(0.02)
    assert owner.service.unloaded == [TOPIC]
    assert owner.ownership.sessions_lost == 1
    # The expired session's record is gone, so another broker (its own session expired
    # too on this shared clock, and renewed) can claim the topic.
    for _ in range(100):
        if other.ownership._ready.is_set() and other.ownership.sessions_lost == 1:
            break
        await asyncio.sleep(0.02)
    await other.ownership.claim(TOPIC)
    assert other.ownership.serving(TOPIC) and not owner.ownership.serving(TOPIC)


async def test_an_owner_that_accepts_tcp_but_never_answers_is_not_reachable(
    tmp_path: Path,
) -> None:
    """A paused broker's kernel accepts connections, and so does a proxy in front of a dead
    one: the owner probe is a CONNECT handshake, not a TCP connect."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepted, never answered (until the peer leaves)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    silent_port = server.sockets[0].getsockname()[1]
    store = MemoryMetadataStore()
    ownership = ClusterOwnership(
        store, cast(BrokerService, FakeService()), cluster="c", session_ttl_s=TTL_S
    )
    try:
        async with InProcessBroker(tmp_path) as live:
            for url, reachable in (
                (f"pulsar://127.0.0.1:{silent_port}", False),
                (live.service_url, True),
            ):
                owner = OwnerRecord("b9", url, "http://127.0.0.1:1")
                assert await ownership._reachable(owner) is reachable, url
    finally:
        server.close()
        await store.close()


# --- lookups of names that do not exist (issue 15) -------------------------------------------


async def store_keys(store: MemoryMetadataStore) -> list[str]:
    page = await store.list_prefix("/")
    assert not page.more
    return [r.path for r in page.records]


async def test_lookups_of_missing_topics_write_nothing(brokers: list[Broker]) -> None:
    store = brokers[0].ownership._store
    assert isinstance(store, MemoryMetadataStore)
    before = await store_keys(store)
    names = [f"persistent://public/default/missing-{i}" for i in range(30)]
    for broker in brokers:
        broker.service.missing.update(names)
    for i, name in enumerate(names):
        with pytest.raises(NotFound):
            await brokers[i % 3].ownership.lookup(name, authoritative=i % 2 == 0)
    assert await store_keys(store) == before


async def test_ownerships_of_looked_up_but_unused_topics_are_released(
    clock: ManualClock,
) -> None:
    store = MemoryMetadataStore(clock)
    broker = Broker(store, idle_release_s=0.05)
    await broker.start()
    try:
        before = await store_keys(store)
        names = [f"persistent://public/default/random-{i}" for i in range(40)]
        for name in names:
            answer = await broker.ownership.lookup(name)
            assert answer.pulsar_url == broker.url
        used = names[0]
        broker.service.loaded.add(used)  # a producer came for this one
        assert len(await store_keys(store)) == len(before) + 40
        await asyncio.sleep(0.1)
        await broker.ownership.release_idle()
        await broker.ownership.release_idle()
        assert await store_keys(store) == sorted([*before, ownership_path(used)])
        assert broker.ownership.serving(used)
        assert not broker.ownership.serving(names[1])
        # Looked up again, a released name is claimed again.
        assert (await broker.ownership.lookup(names[1])).pulsar_url == broker.url
        assert broker.ownership.serving(names[1])
    finally:
        await broker.stop()
        await store.close()


async def test_the_fence_holds_until_another_broker_owns_the_topic(
    brokers: list[Broker],
) -> None:
    """A stale owner (its session gone while it was paused) must not write for a topic
    someone else owns: its transaction participants guard every write with this fence."""
    owner, other, third = brokers
    with pytest.raises(NotOwner):
        owner.ownership.fence(TOPIC)  # not owned: no fence to hand out
    await owner.ownership.claim(TOPIC)
    fence = owner.ownership.fence(TOPIC)
    store = owner.ownership._store
    await store.commit([Put("/probe", b"1"), fence])  # holds while owned
    await owner.ownership.claim(TOPIC)  # claiming again keeps it
    assert owner.ownership.fence(TOPIC) == fence
    session = owner.ownership._session
    assert session is not None
    await session.close()  # as when its lease expires: the ephemeral record goes
    await other.ownership.claim(TOPIC)
    with pytest.raises(BadVersion) as caught:
        await store.commit([Put("/probe", b"2"), fence])
    assert caught.value.path == ownership_path(TOPIC)
    probe = await store.get("/probe")
    assert probe is not None and probe.value == b"1"  # the fenced write wrote nothing
    # A handover after an unload keeps the record (and its create revision), but the
    # unload closed the topic at the old owner before it released it.
    assert await other.ownership.unload(TOPIC, third.ownership.broker_id) == (
        third.ownership.broker_id
    )
    assert other.service.unloaded == [TOPIC]
    await third.ownership.claim(TOPIC)
    await store.commit([Put("/probe", b"3"), third.ownership.fence(TOPIC)])

"""Concurrent commits sharing etcd Txns (``metadata/etcd_coalesce.py``): the batching rule
against a model, and on a real etcd each caller gets the answer it would get alone."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.errors import BadVersion, SessionExpired
from anabranch.metadata.api import Check, Put
from anabranch.metadata.etcd import EtcdMetadataStore
from anabranch.metadata.etcd_coalesce import PendingCommit, take_batch
from anabranch.testing.etcd import EtcdServer
from tests.metadata_backends import etcd_server

__all__ = ["etcd_server"]  # a pytest fixture

OPS_MAX = 6
BYTES_MAX = 100
_namespaces = itertools.count()

_pending = st.builds(
    lambda keys, n, size, gave_up: (keys, n, size, gave_up),
    st.frozensets(st.sampled_from([b"a", b"b", b"c", b"d", b"e"]), min_size=1, max_size=3),
    st.integers(1, 4),
    st.integers(1, 60),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_pending, max_size=12))
def test_a_batch_keeps_the_rules(specs: list[tuple[frozenset[bytes], int, int, bool]]) -> None:
    loop = asyncio.new_event_loop()
    try:
        queue: deque[PendingCommit] = deque()
        for keys, n, size, gave_up in specs:
            pending = PendingCommit((), [0] * n, [0] * n, [0] * n, keys, size)
            pending.future = loop.create_future()
            if gave_up:
                pending.future.cancel()
            queue.append(pending)
        before = list(queue)
        batch = take_batch(queue, ops_max=OPS_MAX, bytes_max=BYTES_MAX)
        waiting = [p for p in before if p.waiting]
        # The first waiting commit always goes; nobody is lost; one who gave up never
        # goes (it may stay queued past a long run of misfits, dropped at a later pass).
        left = [p for p in queue if p.waiting]
        assert batch[:1] == waiting[:1] and set(batch) | set(left) == set(waiting)
        assert all(p.waiting for p in batch) and not set(batch) & set(queue)
        # Disjoint keys, within the limits (a lone first commit may exceed them).
        for i, a in enumerate(batch):
            for b in batch[i + 1 :]:
                assert not a.keys & b.keys
        if len(batch) > 1:
            assert sum(len(p.compare) for p in batch) <= OPS_MAX
            assert sum(p.size for p in batch) <= BYTES_MAX
        # Order: what stays keeps its order, and no commit leaves ahead of an earlier
        # one that stays and shares a key with it.
        assert left == [p for p in waiting if p in left]
        for p in batch:
            for q in left:
                if waiting.index(q) < waiting.index(p):
                    assert not p.keys & q.keys
    finally:
        loop.close()


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[EtcdMetadataStore]:
    backend = await EtcdMetadataStore.open(
        etcd_server.endpoint, namespace=f"/coalesce-{next(_namespaces)}"
    )
    try:
        yield backend
    finally:
        await backend.close()


async def test_concurrent_cas_loops_share_txns(store: EtcdMetadataStore) -> None:
    """64 CAS loops on their own keys: every write lands with the right versions, in far
    fewer Txns than commits."""

    async def loop(n: int) -> int:
        version = 0
        for i in range(20):
            stat = await store.put(f"/k/{n}", str(i).encode(), expected_version=version)
            assert stat.version == version + 1
            version = stat.version
        return version

    assert await asyncio.gather(*(loop(n) for n in range(64))) == [20] * 64
    for n in range(64):
        record = await store.get(f"/k/{n}")
        assert record is not None and record.value == b"19" and record.stat.version == 20
    assert store.commits_sent >= 64 * 20
    assert store.txns_sent < store.commits_sent / 4


async def test_each_commit_of_a_failed_txn_gets_its_own_answer(
    store: EtcdMetadataStore,
) -> None:
    """Half of 40 concurrent commits expect a wrong version: they get BadVersion with the
    facts, the other half land (retried after the shared Txn failed)."""
    for n in range(40):
        await store.put(f"/v/{n}", b"x")  # version 1

    async def write(n: int) -> object:
        expected = 1 if n % 2 == 0 else 5
        try:
            return await store.put(f"/v/{n}", b"y", expected_version=expected)
        except BadVersion as err:
            return err

    results = await asyncio.gather(*(write(n) for n in range(40)))
    for n, result in enumerate(results):
        if n % 2 == 0:
            assert not isinstance(result, BadVersion), n
            record = await store.get(f"/v/{n}")
            assert record is not None and record.value == b"y"
        else:
            assert isinstance(result, BadVersion) and result.path == f"/v/{n}"
            assert (result.expected, result.actual) == (5, 1)


async def test_commits_on_one_key_serialize(store: EtcdMetadataStore) -> None:
    """Never in one Txn: of 32 CAS from the same version exactly one wins, and of two
    commits that each check the key the other writes, exactly one (no write skew)."""
    await store.put("/one", b"0")

    async def cas(i: int) -> bool:
        try:
            await store.put("/one", str(i).encode(), expected_version=1)
        except BadVersion:
            return False
        return True

    assert sum(await asyncio.gather(*(cas(i) for i in range(32)))) == 1
    for _ in range(10):
        x = await store.put("/x", b"")
        y = await store.put("/y", b"")

        async def skew(check: str, version: int, write: str) -> bool:
            try:
                await store.commit([Check(check, version), Put(write, b"w")])
            except BadVersion:
                return False
            return True

        # Two fillers take the Txns that may be out, so the pair waits together.
        won = await asyncio.gather(
            store.put("/filler/1", b""),
            store.put("/filler/2", b""),
            skew("/x", x.version, "/y"),
            skew("/y", y.version, "/x"),
        )
        assert sum(won[2:]) == 1


async def test_an_expired_session_fails_only_its_commit(store: EtcdMetadataStore) -> None:
    session = await store.open_session(2.0)
    expired_id = session.id
    await session.close()  # the lease is revoked: a put with it is refused by etcd

    async def plain(n: int) -> object:
        return await store.put(f"/s/{n}", b"ok")

    async def ephemeral() -> object:
        try:
            return await store.commit([Put("/s/eph", b"", session_id=expired_id)])
        except SessionExpired as err:
            return err

    results = await asyncio.gather(
        *(plain(n) for n in range(10)), ephemeral(), return_exceptions=True
    )
    assert isinstance(results[-1], SessionExpired)
    assert all(not isinstance(r, BaseException) for r in results[:-1])
    for n in range(10):
        assert await store.get(f"/s/{n}") is not None
    assert await store.get("/s/eph") is None


async def test_commits_do_not_queue_behind_stuck_txns(
    store: EtcdMetadataStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Txns stuck (a cut link answers only at the deadline) fill the in-flight limit;
    a later commit still goes once they have been out for ETCD_COMMIT_SLOW_S, and lands
    while they are stuck."""
    release = asyncio.Event()
    real_txn = store._send_txn
    calls = 0

    async def txn(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls <= 2:
            await release.wait()
        return await real_txn(*args)

    monkeypatch.setattr(store, "_send_txn", txn)
    stuck = [asyncio.create_task(store.put(f"/stuck/{i}", b"")) for i in range(2)]
    await asyncio.sleep(0)  # both are out
    assert calls == 2
    stat = await store.put("/after", b"v")  # would wait for `release` if it queued
    assert stat.version == 1
    assert not any(task.done() for task in stuck)
    release.set()
    await asyncio.gather(*stuck)

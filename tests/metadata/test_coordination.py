"""Leader election and fencing over every backend (etcd whenever its module imports)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from anabranch.errors import BadVersion, SessionExpired
from anabranch.metadata.api import MetadataStore, Put
from anabranch.metadata.coordination import LeaderElection
from tests.metadata_backends import etcd_server, store

LEADER = "/topics/t/ns/orders/controller"
SESSION_TTL_S = 1.0
"""Real TTL (etcd cannot take a fake clock), at etcd's 1 s minimum in the test server."""

__all__ = ["etcd_server", "store"]  # pytest fixtures


async def contender(
    store: MetadataStore, name: bytes, *, auto_keepalive: bool = True
) -> LeaderElection:
    session = await store.open_session(SESSION_TTL_S, auto_keepalive=auto_keepalive)
    return LeaderElection(store, LEADER, name, session)


async def test_one_wins_other_takes_over_after_resign(store: MetadataStore) -> None:
    a, b = await contender(store, b"a"), await contender(store, b"b")
    a_lead = await a.campaign()
    b_campaign = asyncio.ensure_future(b.campaign())
    await store.put("/unrelated", b"")  # a round trip for b to reach its watch
    assert not b_campaign.done()
    assert await b.leader() == b"a"
    await a_lead.resign()
    b_lead = await b_campaign
    await a_lead.lost()
    assert a_lead.is_lost and not b_lead.is_lost
    assert await a.leader() == b"b"
    assert b_lead.fencing_token > a_lead.fencing_token
    await b_lead.resign()
    assert await a.leader() is None


async def test_other_takes_over_after_session_expiry(store: MetadataStore) -> None:
    a = await contender(store, b"a", auto_keepalive=False)
    b = await contender(store, b"b")
    a_lead = await a.campaign()
    b_lead = await b.campaign()  # returns once a's session expired and its key was deleted
    await a_lead.lost()
    assert await b.leader() == b"b"
    assert not b_lead.is_lost
    with pytest.raises(SessionExpired):
        await a.campaign()
    await b_lead.resign()


async def test_deposed_leaders_guarded_write_fails(store: MetadataStore) -> None:
    a, b = await contender(store, b"a"), await contender(store, b"b")
    a_lead = await a.campaign()
    await store.commit([a_lead.guard(), Put("/layout", b"from a")])
    await store.delete(LEADER)  # a is deposed (an operator, or a's expiry seen by the store)
    b_lead = await b.campaign()
    await a_lead.lost()
    with pytest.raises(BadVersion) as err:
        await store.commit([a_lead.guard(), Put("/layout", b"stale a")])
    assert err.value.path == LEADER
    await store.commit([b_lead.guard(), Put("/layout", b"from b")])
    record = await store.get("/layout")
    assert record is not None and record.value == b"from b"
    await b_lead.resign()


async def test_resign_is_idempotent_and_leaves_a_new_leader_alone(store: MetadataStore) -> None:
    a, b = await contender(store, b"a"), await contender(store, b"b")
    a_lead = await a.campaign()
    await store.delete(LEADER)
    b_lead = await b.campaign()
    await a_lead.resign()
    await a_lead.resign()
    assert await a.leader() == b"b"
    await b_lead.resign()


async def test_a_store_closed_before_the_loss_watch_starts_ends_the_term() -> None:
    from anabranch.metadata.memory import MemoryMetadataStore

    store = MemoryMetadataStore()
    session = await store.open_session(SESSION_TTL_S)
    leadership = await LeaderElection(store, LEADER, b"me", session).campaign()
    await store.close()  # before the loss watch's task had its first turn
    await asyncio.wait_for(leadership.lost(), 5)
    assert leadership.is_lost


async def test_a_campaign_cancelled_while_it_waits_leaves_no_task_behind(
    store: MetadataStore,
) -> None:
    """A broker stopping while it waits for another leader's key to go: nothing is left
    to end with an exception nobody retrieves (logged at shutdown)."""
    unretrieved: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    try:
        a, b = await contender(store, b"a"), await contender(store, b"b")
        a_lead = await a.campaign()
        b_campaign = asyncio.ensure_future(b.campaign())
        await store.put("/unrelated", b"")  # a round trip for b to reach its watch
        for _ in range(20):
            await asyncio.sleep(0)
        assert not b_campaign.done()
        b_campaign.cancel()
        await asyncio.gather(b_campaign, return_exceptions=True)
        assert b_campaign.cancelled()
        del b_campaign  # its CancelledError's traceback holds the frames and their tasks
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()  # an unretrieved exception is reported when its task is collected
        await a_lead.resign()
        assert unretrieved == []
    finally:
        loop.set_exception_handler(None)

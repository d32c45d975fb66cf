"""The scalable-topic controller under faults (issue 19, items 1 and 3).

1. A broker paused past its session TTL comes back with an expired session; it must open a
   new one and campaign again. After every broker has been paused once (each time the
   leader), some broker still leads and splits work at every broker.
3. A split whose segment operation fails (the segment's owner was just SIGKILLed) must not
   leave the topic "in progress" for good: the controller finishes the pending change by
   itself once the segment has a live owner again, and later splits work.

The cluster (3 brokers, session TTL ``SESSION_TTL_S``) starts once for the module.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from anabranch.metadata.etcd import EtcdMetadataStore
from anabranch.testing.cluster import ClusterBroker, LocalCluster
from tests.cluster.local_cluster import SESSION_TTL_S, TAKEOVER_SLACK_S
from tests.cluster.test_cluster_scalable import (
    create_topic,
    layout_of,
    remote_segment_owner,
    split_held_by_a_paused_owner,
)

PAUSE_S = SESSION_TTL_S * 2
"""Longer than the session TTL: the paused broker's session (and its leadership) expires."""
RECOVERY_S = SESSION_TTL_S * 4 + TAKEOVER_SLACK_S * 2
"""Bound on the cluster leading again after a pause heals: a new election, the old
leader's rejoin, a loaded 2-core CI machine."""


async def leader_of(cluster: LocalCluster, short: str) -> ClusterBroker | None:
    """The broker named by the controller key (None while there is none)."""
    for broker in cluster.live():
        status, body = await cluster.http("GET", f"/admin/v2/scalable/{short}/stats", via=broker)
        if status == 200:
            url = body.get("controllerBrokerUrl")
            return cluster.by_url(url) if url else None
    return None


async def split_somewhere(cluster: LocalCluster, short: str, via: ClusterBroker) -> dict[str, Any]:
    """Split the first active segment, asked at ``via`` (following its redirect), retrying
    retriable answers until RECOVERY_S; returns the new layout."""
    deadline = time.monotonic() + RECOVERY_S
    last: tuple[int, Any] = (0, None)
    while time.monotonic() < deadline:
        layout = await layout_of(cluster, f"topic://{short}", via)
        active = min(int(i) for i, s in layout["segments"].items() if s["state"] == "ACTIVE")
        status, body, _ = await cluster.http_follow(
            "POST", f"/admin/v2/scalable/{short}/split/{active}", via=via
        )
        if status == 200:
            return dict(body)
        last = (status, body)
        await asyncio.sleep(0.3)
    raise AssertionError(f"no split within {RECOVERY_S} s at {via.broker_id}: {last}")


async def test_every_broker_paused_past_its_session_still_leads_again(
    three_brokers: LocalCluster,
) -> None:
    cluster = three_brokers
    topic, _ = await create_topic(cluster, 1)
    short = topic.split("://", 1)[1]
    # Every broker runs a controller of the topic (a mutation creates it; this one names
    # no segment, so the leader refuses it and the others redirect).
    for broker in cluster.brokers:
        status, _ = await cluster.http(
            "POST", f"/admin/v2/scalable/{short}/split/999999", via=broker
        )
        assert status in (307, 400, 404, 405), status
    leader = await leader_of(cluster, short)
    deadline = time.monotonic() + RECOVERY_S
    while leader is None:
        assert time.monotonic() < deadline, "no leader"
        await asyncio.sleep(0.2)
        leader = await leader_of(cluster, short)
    # Pause each broker once, the leader first, longer than the TTL (the sequence:
    # once each had been paused, no broker could lead). Who wins each election is chance,
    # so the test does not wait for every broker to lead; every paused session expires.
    for broker in (leader, *(b for b in cluster.brokers if b is not leader)):
        broker.pause()
        await asyncio.sleep(PAUSE_S)
        broker.resume()
        # The cluster leads again, and the resumed broker redirects to the leader (or
        # leads itself) instead of answering "no leader is elected".
        await split_somewhere(cluster, short, via=broker)

    # Every broker has been paused past its TTL: splits still work through every broker,
    # and each broker reports the session it replaced.
    for broker in cluster.brokers:
        layout = await split_somewhere(cluster, short, via=broker)
        assert all(s["state"] in ("ACTIVE", "SEALED") for s in layout["segments"].values())
        status, text = await cluster.http("GET", "/metrics", via=broker)
        assert status == 200
        renewed = [
            float(line.rsplit(" ", 1)[1])
            for line in str(text).splitlines()
            if line.startswith("anabranch_scalable_controller_sessions_renewed_total")
        ]
        assert renewed and renewed[0] >= 1, (broker.broker_id, renewed)


async def test_a_failed_segment_operation_is_finished_later(three_brokers: LocalCluster) -> None:
    cluster = three_brokers
    topic, leader = await create_topic(cluster, 2)
    short = topic.split("://", 1)[1]
    # A remote owner: the leader's segment operation fails to connect when it dies.
    _, owner = await remote_segment_owner(cluster, topic, leader)
    assert cluster.etcd is not None
    store = await EtcdMetadataStore.open(cluster.etcd.endpoint)
    try:
        # The owner freezes, so the leader's split stops half-way (its intent recorded,
        # the seal sent and unanswered); then the owner dies and the seal fails.
        split = await split_held_by_a_paused_owner(
            cluster, store, topic, leader, owner, deadline_s=RECOVERY_S
        )
        await asyncio.sleep(SESSION_TTL_S * 2)  # the owner's topics are free to move
        owner.kill()
        status, body = await split
        # Usually the leader's owner probe (a CONNECT handshake) finds the paused owner
        # silent, waits for its records to expire and seals at the new owner (200); when
        # a recent probe is cached, the seal goes to the frozen owner and fails (503) and
        # the background retry finishes it. Either way it ends done, below. (The failure
        # path alone: test_controller's ..._seal_failed_is_finished_by_its_leader...)
        assert status in (200, 503), (status, body)
        # Without a new request, the controller finishes the change once the segment has
        # a live owner again (after the dead owner's session expires).
        deadline = time.monotonic() + RECOVERY_S
        while True:
            layout = await layout_of(cluster, topic, leader)
            if layout["epoch"] >= 1 and await store.get(f"/topics/{short}/pending-op") is None:
                break
            assert time.monotonic() < deadline, f"the split never finished: {layout}"
            await asyncio.sleep(0.2)
        assert layout["segments"]["0"]["state"] == "SEALED"
        # And the topic takes later changes.
        status, body, _ = await cluster.http_follow(
            "POST", f"/admin/v2/scalable/{short}/split/1", via=leader
        )
        assert status == 200, (status, body)
    finally:
        await store.close()
        if not owner.running:
            await owner.start()

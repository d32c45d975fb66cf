"""PIP-468 pruneSegment on two cluster brokers: the controller leader's retention sweep
prunes a drained sealed segment that another broker owns, deleting its data over the
controller-to-broker API; the DAG no longer lists it and producers carry on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from anabranch.aio import Client
from anabranch.storage.ledger import disk_name
from anabranch.testing.cluster import LocalCluster
from tests.cluster.local_cluster import SESSION_TTL_S, fresh_name
from tests.cluster.test_cluster_scalable import (
    create_topic,
    layout_of,
    produce,
    remote_segment_owner,
)

POLLS = 1_200
"""Layout polls 50 ms apart while the sweep (every 0.5 s) prunes."""


@pytest.fixture(scope="module")
def pruning_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(
        tmp_path_factory.mktemp("prune"),
        brokers=2,
        session_ttl_s=SESSION_TTL_S,
        retention_check_interval_s=0.5,
    )
    asyncio.run(local.start())
    try:
        yield local
    finally:
        asyncio.run(local.stop())


def ledger_dir(data_dir: Path, segment: str) -> Path:
    rest = segment.split("://", 1)[1]  # t/ns/topic/descriptor
    tenant, namespace, topic, descriptor = rest.split("/")
    name = f"{tenant}/{namespace}/segment/{topic}/{descriptor}"
    return data_dir / "ledgers" / disk_name(name)


async def test_a_drained_segment_owned_elsewhere_is_pruned(pruning_cluster: LocalCluster) -> None:
    cluster = pruning_cluster
    topic, leader = await create_topic(cluster, 1)
    names, owner = await remote_segment_owner(cluster, topic, leader)
    assert owner is not leader
    await produce(owner.service_url, names[0], [b"a", b"b"])
    parent_dir = ledger_dir(cluster.data_dir, names[0])
    assert parent_dir.is_dir()
    short = topic.split("://", 1)[1]
    status, layout, _ = await cluster.http_follow(
        "POST", f"/admin/v2/scalable/{short}/split/0", via=leader
    )
    assert status == 200, layout
    # No subscription: the sealed parent is drained at once; retention 0 lets it go.
    for _ in range(POLLS):
        layout = await layout_of(cluster, topic, leader)
        if "0" not in layout["segments"] and not parent_dir.exists():
            break
        await asyncio.sleep(0.05)
    assert "0" not in layout["segments"], layout
    assert not parent_dir.exists()
    assert layout["epoch"] == 2
    assert all(not s.get("parentIds") for s in layout["segments"].values())
    async with Client(cluster.brokers[0].service_url) as client:
        producer = await client.create_producer(topic)
        await producer.send(b"after the prune", key=fresh_name("k"))

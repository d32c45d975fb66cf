"""A cluster broker on JetStream when JetStream is not there or not ours to use.

* NATS unreachable when the broker starts: the broker starts anyway (lookups, admin),
  says so in its log, retries in the background with backoff, and serves a producer that
  was waiting as soon as NATS comes up (what Pulsar does while its bookies are down).
* Wrong NATS credentials: the broker does not start; one clear line says why (and never
  the password).

Each test runs its own one-broker cluster (etcd + broker subprocess, a real nats-server).
The stream-deleted-behind-our-back fault runs on the three-broker cluster of
``test_cluster_jetstream.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from anabranch.aio import Client
from anabranch.testing.cluster import LocalCluster
from anabranch.testing.nats import NatsCluster, NatsNode, find_nats_binary
from tests.cluster.local_cluster import SESSION_TTL_S, read_all

SEND_GUARD_S = 90.0
"""Hang guard on a send that waits for NATS to come up (not a performance bound)."""


async def test_broker_starts_while_nats_is_down_and_serves_once_it_is_up(
    tmp_path: Path,
) -> None:
    node = NatsNode("n1", tmp_path / "nats" / "n1", find_nats_binary(), peers=1)
    node.write_config([])
    cluster = LocalCluster(
        tmp_path / "cluster",
        brokers=1,
        session_ttl_s=SESSION_TTL_S,
        storage="jetstream",
        nats_urls=[node.url],
        jetstream_replicas=1,
    )
    topic = "persistent://public/default/before-nats"
    try:
        await cluster.start()  # registered and serving although no NATS answers
        (broker,) = cluster.brokers
        log = broker.log_path.read_text()
        assert f"NATS JetStream at {node.url} unreachable at start" in log

        async def send() -> None:
            async with Client(broker.service_url, operation_timeout_s=SEND_GUARD_S) as client:
                producer = await client.create_producer(topic)
                await producer.send(b"waited-for-nats")

        sending = asyncio.ensure_future(send())
        # The broker keeps trying in the background, and says so.
        deadline = asyncio.get_running_loop().time() + SEND_GUARD_S
        while "still unreachable" not in broker.log_path.read_text():
            assert asyncio.get_running_loop().time() < deadline, "no retry logged"
            await asyncio.sleep(0.1)
        assert not sending.done(), "a send completed with no storage running"
        node.launch()
        await asyncio.to_thread(NatsCluster([node]).wait_ready)
        await asyncio.wait_for(sending, SEND_GUARD_S)
        assert await read_all(broker.service_url, topic) == [b"waited-for-nats"]
        assert "connected to NATS JetStream" in broker.log_path.read_text()
    finally:
        await cluster.stop()
        node.kill()


async def test_wrong_nats_credentials_stop_the_broker_with_a_clear_error(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(
        tmp_path,
        brokers=1,
        session_ttl_s=SESSION_TTL_S,
        storage="jetstream",
        nats_nodes=1,
        nats_auth=("broker", "s3cret"),
        jetstream_password="not-the-password",
    )
    with pytest.raises(RuntimeError, match="exited"):
        await cluster.start()
    log = " ".join((tmp_path / "broker-0.log").read_text().split())  # the console wraps
    assert "cannot start: NATS JetStream at nats://127.0.0.1:" in log
    assert "refused our credentials" in log
    assert "not-the-password" not in log
    assert "Traceback" not in log

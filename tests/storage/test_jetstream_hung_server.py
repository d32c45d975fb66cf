"""A hung NATS server (SIGSTOP: its sockets stay open, nothing answers) under the
JetStream ledger's connection: the first unanswered request sends a PING, and a server
that does not answer it is left for another at once, instead of after nats-py's keep-alive
gives up (``PING_INTERVAL_S`` times ``MAX_OUTSTANDING_PINGS``, 15-20 s during which
every append of the broker waited, although the two other servers served)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig
from anabranch.storage.jetstream_ledger import JetStreamManagedLedgerFactory
from anabranch.testing.nats import NatsCluster

BIG = ManagedLedgerConfig(ledger_entries_max=100_000)
READ_ROUNDS = 300
"""Reads of the stored ledger while a lagging replica catches up (a hang guard only)."""


async def test_an_append_leaves_a_hung_server_before_the_keepalive_would(
    tmp_path: Path, store: MemoryMetadataStore
) -> None:
    cluster = NatsCluster.start(tmp_path / "nats", nodes=3)
    factory = JetStreamManagedLedgerFactory(cluster.urls, store, api_timeout_s=1.0)
    reader = JetStreamManagedLedgerFactory(cluster.urls, store, tail_cache_bytes=0)
    client = await factory.client()
    hung = next(node for node in cluster.nodes if node.url == client.connected_url)
    try:
        ml = await factory.open("t", BIG)
        await ml.append(b"before")
        hung.pause()
        await ml.append(b"while hung")  # the server stays paused until it is stored
        # Left by the PING after the first unanswered request (only that probe counts
        # here), not by nats-py's keep-alive, which takes PING_INTERVAL_S *
        # MAX_OUTSTANDING_PINGS.
        assert client.hung_servers_left == 1
        assert client.connected_url not in (None, hung.url)
        hung.resume()
        await factory.close()
        again = await reader.open("t", BIG)
        # A read may be served by the resumed server's replica, which catches up after
        # the stream's leader: it answers a prefix until then, never something else.
        for _ in range(READ_ROUNDS):
            stored = [entry.data for entry in await again.read(EARLIEST, 10)]
            assert stored in ([b"before"], [b"before", b"while hung"])
            if len(stored) == 2:
                break
            await asyncio.sleep(0.1)
        assert stored == [b"before", b"while hung"]
    finally:
        hung.resume()
        await factory.close()
        await reader.close()
        cluster.stop()

"""Backends for the metadata-store contract suite.

Every test in ``test_metadata_store.py`` runs once per backend. The etcd backend uses a
real ``etcd`` process started once per module on free loopback ports (see
``anabranch.testing.etcd``); it is never skipped: a missing binary is a failure. The
JetStream ledger backend likewise gets a real 3-node NATS cluster per module
(``anabranch.testing.nats``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from anabranch.metadata.api import MetadataStore
from anabranch.testing.etcd import EtcdServer
from anabranch.testing.nats import NatsCluster


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer.start(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["memory", "sqlite", "etcd"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[MetadataStore]:
    backend: MetadataStore
    if request.param == "memory":
        from anabranch.metadata.memory import MemoryMetadataStore

        backend = MemoryMetadataStore()
    elif request.param == "sqlite":
        from anabranch.metadata.sqlite import SqliteMetadataStore

        backend = await SqliteMetadataStore.open(tmp_path / "meta.db")
    else:
        from anabranch.metadata.etcd import EtcdMetadataStore

        server: EtcdServer = request.getfixturevalue("etcd_server")
        # Each test gets its own key namespace on the shared server.
        backend = await EtcdMetadataStore.open(
            server.endpoint, namespace=f"/t{request.node.nodeid.__hash__() & 0xFFFFFFFF:x}"
        )
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """A real 3-node JetStream cluster (fsync before ack) shared by a module's tests."""
    cluster = NatsCluster.start(tmp_path_factory.mktemp("nats"), nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()

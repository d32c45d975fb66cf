"""A ``store`` fixture over every metadata backend, built as the contract suite builds them.

The etcd backend is a real ``etcd`` process started once per module
(``anabranch.testing.etcd``); each test gets its own key namespace on it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from anabranch.metadata.api import MetadataStore
from anabranch.testing.etcd import EtcdServer


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
        backend = await EtcdMetadataStore.open(
            server.endpoint, namespace=f"/t{request.node.nodeid.__hash__() & 0xFFFFFFFF:x}"
        )
    try:
        yield backend
    finally:
        await backend.close()

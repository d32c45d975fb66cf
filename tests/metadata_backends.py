"""The metadata-store fixtures suites share: ``store`` runs a test once per backend
(memory, SQLite, a real etcd) and ``etcd_server`` starts etcd once per module (stopped in
``finally``; a missing binary is a failure, never a skip). Each test gets its own key
namespace on the shared etcd. A conftest (or test module) imports both to use them."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from anabranch.metadata.api import MetadataStore
from anabranch.testing.etcd import EtcdServer

_namespaces = itertools.count()


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
        backend = await EtcdMetadataStore.open(server.endpoint, namespace=f"/t{next(_namespaces)}")
    try:
        yield backend
    finally:
        await backend.close()

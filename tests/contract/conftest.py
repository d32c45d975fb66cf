"""Backends for the metadata-store contract suite.

Every test in ``test_metadata_store.py`` runs once per backend. The etcd backend uses a
real ``etcd`` process started once per module on free loopback ports (see
``anabranch.testing.etcd``); it is never skipped: a missing binary is a failure. The
JetStream ledger backend likewise gets a real 3-node NATS cluster per module
(``anabranch.testing.nats``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from anabranch.testing.nats import NatsCluster
from tests.metadata_backends import etcd_server, store

__all__ = ["etcd_server", "store"]  # pytest fixtures, shared with other suites


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """A real 3-node JetStream cluster (fsync before ack) shared by a module's tests."""
    cluster = NatsCluster.start(tmp_path_factory.mktemp("nats"), nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()

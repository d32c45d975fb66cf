"""A ``store`` fixture over every metadata backend: the contract suite's own fixtures.

The etcd backend is a real ``etcd`` process started once per module
(``anabranch.testing.etcd``); each test gets its own key namespace on it.
"""

from __future__ import annotations

from tests.contract.conftest import etcd_server, store

__all__ = ["etcd_server", "store"]

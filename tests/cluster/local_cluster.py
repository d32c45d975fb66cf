"""What the three-broker cluster tests share: timing bounds, fresh names, reading back.

The ``cluster`` and ``three_brokers`` fixtures (``conftest.py``) start the cluster with
``SESSION_TTL_S``.
"""

from __future__ import annotations

import itertools
import time

from anabranch.aio import Client
from anabranch.testing.cluster import ClusterBroker, LocalCluster

SESSION_TTL_S = 3.0
TAKEOVER_SLACK_S = 6.0
"""What failover may take beyond the session TTL: the client's reconnect backoff, the
new owner's ledger recovery, a loaded 2-core CI machine."""

_names = itertools.count()


def fresh_name(prefix: str) -> str:
    """A name no other test of this run uses: ``<prefix>-<n>-<time>``."""
    return f"{prefix}-{next(_names)}-{time.time_ns() % 10**6}"


def others(cluster: LocalCluster, broker: ClusterBroker) -> list[ClusterBroker]:
    """Every broker of the cluster but ``broker``."""
    return [b for b in cluster.brokers if b is not broker]


async def read_all(url: str, topic: str) -> list[bytes]:
    """Every stored message of ``topic``, from the earliest."""
    async with Client(url) as client:
        reader = await client.create_reader(topic, "earliest")
        out: list[bytes] = []
        while (msg := await reader.read_next(timeout=3.0)) is not None:
            out.append(msg.value)
        return out

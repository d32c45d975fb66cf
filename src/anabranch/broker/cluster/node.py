"""A cluster broker: a standalone broker wired to the shared store, plus ownership.

It starts like :class:`~anabranch.broker.standalone.Standalone` (the metadata URL is
``etcd://...``; file ledgers live under ``data_dir``, which every broker of a one-machine
cluster shares; with ``storage = "jetstream"`` they are NATS JetStream streams and each
broker's ``data_dir`` is its own, so the brokers may run on different machines),
creates the cluster, tenant ``public`` and namespace ``public/default`` idempotently
(create-if-absent, so whichever broker starts first wins and the others leave the records
alone), and installs a :class:`ClusterOwnership` as the service's ownership gate *before*
the binary server accepts connections, so no topic is ever served unowned. Segments of
scalable topics are owned like any topic: the DAG watch reports each segment's owner
(``service.segment_broker_url``).

Shutdown hands every owned topic back (closing it, then deleting the records with the
session) before the standalone shutdown runs, so clients move on at once instead of after
the session TTL.

Example (a cluster of one on ``memory://``; brokers that share one use
``metadata_url="etcd://127.0.0.1:2379"``):
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> async def run(cfg: BrokerConfig) -> None:
    ...     node = await ClusterNode.start(cfg)
    ...     print(node.describe())
    ...     await node.stop()
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     asyncio.run(run(BrokerConfig(data_dir=Path(tmp), port=0, http_port=0,
    ...                                  metadata_url="memory://")))
    cluster standalone broker 127.0.0.1:...: broker pulsar://127.0.0.1:..., metadata memory://, ...
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from anabranch import limits
from anabranch.broker.cluster.ownership import ClusterOwnership
from anabranch.broker.cluster.segments import ClusterSegmentOps
from anabranch.broker.config import BrokerConfig
from anabranch.broker.service import BrokerService
from anabranch.broker.standalone import Standalone
from anabranch.core.names import SegmentName

log = logging.getLogger(__name__)


@dataclass
class ClusterNode:
    """A running cluster broker."""

    standalone: Standalone
    ownership: ClusterOwnership

    @classmethod
    async def start(
        cls,
        config: BrokerConfig,
        *,
        keepalive_interval_s: float = limits.KEEPALIVE_INTERVAL_S,
        handshake_timeout_s: float = limits.HANDSHAKE_TIMEOUT_S,
    ) -> ClusterNode:
        """Start serving and join the cluster (registry record, ownership)."""
        holder: list[ClusterOwnership] = []
        started: list[Standalone] = []

        def install(service: BrokerService) -> None:
            ownership = ClusterOwnership(
                service.store,
                service,
                cluster=config.cluster_name,
                session_ttl_s=config.session_ttl_s,
                load_report_interval_s=config.load_report_interval_s,
                connections=lambda: len(started[0].server.sessions) if started else 0,
                idle_release_s=config.idle_ownership_release_s,
            )
            service.ownership = ownership
            _install_segment_resolver(service, ownership)
            scalable = getattr(service, "scalable", None)
            if scalable is not None:  # the controller's segment ops run on segment owners
                scalable.ops = ClusterSegmentOps(scalable.ops, ownership)
            holder.append(ownership)

        standalone = await Standalone.start(
            config,
            keepalive_interval_s=keepalive_interval_s,
            handshake_timeout_s=handshake_timeout_s,
            prepare=install,
            exclusive_data_dir=False,
        )
        started.append(standalone)
        ownership = holder[0]
        try:
            http_url = standalone.http_url or f"http://{config.advertised_address}:0"
            await ownership.start(
                standalone.service.advertised_url,
                http_url,
                standalone.service_url_tls or "",
            )
        except BaseException:
            await standalone.stop()
            raise
        return cls(standalone, ownership)

    @property
    def service(self) -> BrokerService:
        return self.standalone.service

    @property
    def service_url(self) -> str:
        return self.standalone.service_url

    @property
    def http_url(self) -> str | None:
        return self.standalone.http_url

    def describe(self) -> str:
        """One line for the operator."""
        return (
            f"cluster {self.ownership.cluster} broker {self.ownership.broker_id}: "
            + self.standalone.describe()
        )

    async def failed(self) -> str:
        """Wait until an essential background loop gave up; the reason."""
        return await self.standalone.failed()

    async def stop(self) -> None:
        """Hand owned topics back, leave the cluster, then the standalone shutdown."""
        self.standalone.server.stop_accepting()
        try:
            await self.ownership.stop()
        finally:
            try:
                await self.standalone.stop()
            finally:
                ops = getattr(getattr(self.service, "scalable", None), "ops", None)
                if isinstance(ops, ClusterSegmentOps):
                    await ops.close()


def _install_segment_resolver(service: BrokerService, ownership: ClusterOwnership) -> None:
    """Point the DAG watch's ``segment_brokers`` at the segments' owners (the seam the
    scalable-topic service exposes; absent on a broker without scalable topics)."""
    if not hasattr(service, "segment_broker_url"):
        return

    async def segment_broker_url(segment: SegmentName) -> str:
        answer = await ownership.lookup(str(segment))
        return answer.pulsar_url

    service.segment_broker_url = segment_broker_url

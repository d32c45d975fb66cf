"""The fault harness's cluster: :class:`~anabranch.testing.cluster.LocalCluster` with a TCP
proxy between each broker and etcd, brokers started through the test-only
:mod:`~anabranch.testing.faults.launcher`, a control file per broker and failpoints.

- Broker ``i`` reaches etcd only through ``proxies[i]``: partitioning or slowing that
  proxy cuts that one broker off the metadata store (its session expires, its topics
  and leaderships move) while clients still reach it.
- Clients and other brokers reach broker ``i`` only through ``fronts[i]`` (a proxy in
  front of its binary port and one in front of its HTTP port, which it advertises):
  blackholing those cuts it off from everyone but etcd.
- ``control(i, ...)`` rewrites broker ``i``'s control file (disk faults, clock offsets).
- ``crash(i)`` is SIGKILL followed by lose-unfsynced on the files broker ``i`` wrote.
- ``failpoints`` are passed to every broker as ``ANABRANCH_FAILPOINTS``.

Example (subprocesses and etcd: seconds to start, so not run here)::

    async def demo(tmp_path: Path) -> None:
        async with FaultCluster(tmp_path, failpoints=("ack-before-fsync",)) as cluster:
            cluster.proxies[0].partition()      # broker 0 loses etcd
            cluster.control(1, disk_errno="EIO")  # broker 1's disk fails
            await cluster.crash(2)               # broker 2 dies, loses unsynced bytes
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from anabranch.errors import AnabranchError
from anabranch.failpoints import ENV_VAR, parse
from anabranch.testing.cluster import ClusterBroker, LocalCluster
from anabranch.testing.faults.control import Control, write_control
from anabranch.testing.faults.disk import lose_unfsynced
from anabranch.testing.tcp_proxy import TcpProxy

START_ATTEMPTS = 3
"""Launches of a broker before its start counts as failed."""


class FaultBroker(ClusterBroker):
    """A cluster broker launched with a control file (see the module docstring)."""

    def __init__(
        self, root: Path, index: int, settings: dict[str, Any], env: dict[str, str]
    ) -> None:
        super().__init__(root, index, settings, env)
        self.name = f"b{index}"
        self.control_path = root / f"broker-{index}.control.json"
        self.controls = Control()
        write_control(self.control_path, self.controls)

    async def start(self) -> None:
        """Start, retried: on a loaded 2-core box a broker may give up on its first etcd
        connection (through the proxy) before etcd answers; that is not what we test."""
        for attempt in range(START_ATTEMPTS):
            try:
                await super().start()
                return
            except (RuntimeError, TimeoutError):
                self.kill()
                if attempt == START_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(1.0)

    def _command(self) -> tuple[list[str], dict[str, str]]:
        args, env = super()._command()
        launcher = [sys.executable, "-m", "anabranch.testing.faults.launcher"]
        hooks = ["--control", str(self.control_path), "--broker-name", self.name]
        # super() runs "python -m anabranch.cli.main broker --config X": keep "broker ..."
        return [*launcher, *hooks, *args[3:]], env


class FaultCluster(LocalCluster):
    """See the module docstring."""

    def __init__(
        self,
        root: Path,
        brokers: int = 3,
        *,
        failpoints: Iterable[str] = (),
        session_ttl_s: float = 3.0,
        **settings: Any,
    ) -> None:
        names = parse(",".join(failpoints))  # a typo fails here, not in a subprocess
        env = {ENV_VAR: ",".join(sorted(names))} if names else {}
        # Infinite retention: the checker judges reads against the final DAG, so no drained
        # sealed segment may be pruned from it during a run.
        settings.setdefault("default_retention_time_minutes", -1)
        settings.setdefault("default_retention_size_mb", -1)
        super().__init__(root, brokers, session_ttl_s=session_ttl_s, env=env, **settings)
        self.failpoints = names
        self.proxies: list[TcpProxy] = []
        """``proxies[i]``: broker ``i``'s link to etcd."""
        self.fronts: list[tuple[TcpProxy, TcpProxy]] = []
        """``fronts[i]``: the (binary, HTTP) proxies everyone else reaches broker ``i`` by."""

    async def _etcd_endpoint_for(self, index: int) -> str:
        assert self.etcd is not None
        host, port = self.etcd.endpoint.rsplit(":", 1)
        proxy = await TcpProxy.start(host, int(port))
        self.proxies.append(proxy)
        return proxy.endpoint

    async def _fronts_for(self, index: int, settings: dict[str, Any]) -> dict[str, Any]:
        pulsar = await TcpProxy.start(self.host, int(settings["port"]))
        http = await TcpProxy.start(self.host, int(settings["http_port"]))
        self.fronts.append((pulsar, http))
        return {"advertised_port": pulsar.port, "advertised_http_port": http.port}

    def _make_broker(self, index: int, settings: dict[str, Any]) -> ClusterBroker:
        return FaultBroker(self.root, index, settings, self.env)

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            for proxy in (*self.proxies, *(p for front in self.fronts for p in front)):
                await proxy.close()
            self.proxies.clear()
            self.fronts.clear()

    @property
    def fault_brokers(self) -> list[FaultBroker]:
        return [b for b in self.brokers if isinstance(b, FaultBroker)]

    def control(self, index: int, **changes: Any) -> Control:
        """Change broker ``index``'s control file (fields of :class:`Control`)."""
        broker = self.fault_brokers[index]
        broker.controls = dataclasses.replace(broker.controls, **changes)
        write_control(broker.control_path, broker.controls)
        return broker.controls

    async def crash(self, index: int) -> int:
        """SIGKILL broker ``index`` and drop its unfsynced bytes; returns files cut."""
        broker = self.fault_brokers[index]
        broker.resume()
        broker.kill()
        return await asyncio.to_thread(lose_unfsynced, self.data_dir, broker.name)

    async def controller_leader(self, topic: str) -> int | None:
        """The index of the broker leading ``topic``'s controller (None: no leader, or etcd
        unreachable). Read from etcd directly, not through any proxy."""
        from anabranch.metadata.etcd import EtcdMetadataStore

        if self.etcd is None or not self.etcd.running:
            return None
        tenant, ns, name = topic.split("://", 1)[1].split("/")
        try:
            store = await asyncio.wait_for(EtcdMetadataStore.open(self.etcd.endpoint), 5.0)
        except (TimeoutError, AnabranchError, OSError):
            return None
        try:
            record = await asyncio.wait_for(
                store.get(f"/topics/{tenant}/{ns}/{name}/controller"), 5.0
            )
        except (TimeoutError, AnabranchError, OSError):
            return None
        finally:
            await store.close()
        if record is None:
            return None
        pulsar = str(json.loads(record.value).get("pulsar", ""))
        for broker in self.brokers:
            if pulsar.endswith(broker.broker_id):
                return broker.index
        return None

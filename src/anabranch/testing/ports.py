"""Free loopback ports for the servers tests start.

A port is chosen now and bound later by the server (etcd, NATS, SeaweedFS, a broker
subprocess), and two things can take it in between:

- **an outgoing connection**: ``connect()`` takes its local port from the kernel's
  ephemeral range, so a port picked by binding port 0 (which lies in that range) can
  be taken by any client socket before the server binds it;
- **another test process**: pytest-xdist workers are separate processes, and the
  kernel may give the same port 0 to two of them a moment apart.

So ports come from below the ephemeral range, where ``connect()`` never looks, each
pytest-xdist worker from its own slice of it; a port is handed out only if it can be
bound right now (``SO_REUSEADDR``, as servers bind: a TIME_WAIT leftover is no
obstacle) and it was not handed out lately by this process. Where the ephemeral range
leaves no room below it, ports come from binding port 0, as before.

Example:
    >>> len({free_port() for _ in range(20)})
    20
"""

from __future__ import annotations

import functools
import os
import random
import socket
from collections import deque
from pathlib import Path

RECENT_PORTS = 1024
"""Ports handed out lately that are not handed out again."""

PORTS_FLOOR = 10_000
"""The lowest port handed out (well-known and registered services live below)."""

PORTS_PER_SLICE_MIN = 2_000
"""A worker's slice must be at least this wide, else port 0 is used."""

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_recent: deque[int] = deque(maxlen=RECENT_PORTS)


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default if unknown)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def worker_slice(low: int, worker: str | None, workers: str | None) -> range | None:
    """The ports of this pytest-xdist worker (``gw<N>`` of ``workers``), or of the only
    process, below ``low``; None when the slice would be too narrow.

    Example:
        >>> worker_slice(32_768, "gw1", "2")
        range(21384, 32768)
        >>> worker_slice(32_768, None, None)
        range(10000, 32768)
        >>> worker_slice(12_000, "gw0", "4") is None
        True
    """
    count = max(1, int(workers)) if workers and workers.isdigit() else 1
    index = int(worker[2:]) if worker and worker[2:].isdigit() else 0
    width = (low - PORTS_FLOOR) // count
    if width < PORTS_PER_SLICE_MIN:
        return None
    start = PORTS_FLOOR + (index % count) * width
    return range(start, low if index % count == count - 1 else start + width)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@functools.cache
def _own_slice() -> range | None:
    """This process's slice: the kernel's range and the worker are fixed for its life."""
    return worker_slice(
        ephemeral_low(),
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now, not handed out lately, and (where the
    ephemeral range allows) outside what connections and other workers use."""
    ports = _own_slice()
    if ports is None:
        while True:
            port = _kernel_port(host)
            if port not in _recent:
                _recent.append(port)
                return port
    # A random start: processes run one after another (a broker subprocess's own
    # tools, several test runs) do not all walk the same ports.
    first = random.randrange(len(ports))
    for step in range(len(ports)):
        port = ports[(first + step) % len(ports)]
        if port not in _recent and _bindable(host, port):
            _recent.append(port)
            return port
    raise OSError(f"no free port on {host} in {ports.start}-{ports.stop - 1}")

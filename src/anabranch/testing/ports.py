"""Free loopback ports for the servers tests start.

Binding port 0 and releasing it gives a port that was free a moment ago; the OS may
hand the same one out again right away, so a fixture choosing several ports in a row
could get a duplicate (SeaweedFS then died with "address already in use"). ``free_port``
remembers the ports it handed out lately and never repeats one of them.

Example:
    >>> len({free_port() for _ in range(20)})
    20
"""

from __future__ import annotations

import socket
from collections import deque

RECENT_PORTS = 1024
"""Ports handed out lately that are not handed out again."""

_recent: deque[int] = deque(maxlen=RECENT_PORTS)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that was free a moment ago and not handed out lately."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _recent:
            _recent.append(port)
            return port

"""Is a broker alive? A CONNECT handshake, the one check a TCP connect cannot fake.

A paused broker's kernel still accepts TCP connections, and so does a proxy or load
balancer in front of a dead one; only a CONNECTED answer shows the broker itself serves.
Used by cluster lookups (is a topic's owner alive?) and by the test tools (is a started
broker ready?).

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(port: int) -> None:
    ...     await asyncio.wait_for(handshake("127.0.0.1", port), 0.5)  # raises if not
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             port = broker.port
    ...             await demo(port)
    ...             print("alive")
    ...         try:
    ...             await demo(port)                # stopped: the connection is refused
    ...         except OSError:
    ...             print("gone")
    >>> asyncio.run(main())
    alive
    gone
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from anabranch import limits
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import ProtocolConnection, Role


async def handshake(
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    auth_method: str | None = None,
    auth_data: bytes | None = None,
) -> None:
    """CONNECT to ``host:port`` and wait for CONNECTED; OSError or ConnectionError if the
    broker refuses or hangs up (the caller bounds the time). ``ssl_context`` for a TLS
    port; ``auth_method``/``auth_data`` for a broker with authentication on."""
    reader, writer = await asyncio.open_connection(
        host, port, ssl=ssl_context, server_hostname=host if ssl_context is not None else None
    )
    try:
        conn = ProtocolConnection(Role.CLIENT)
        connect = commands.connect("anabranch-probe", pb.v21, None, auth_method, auth_data)
        writer.write(conn.send(connect))
        await writer.drain()
        while True:
            data = await reader.read(limits.BROKER_PROBE_READ_BYTES)
            if not data:
                raise ConnectionError("closed during the handshake")
            if any(f.type == pb.BaseCommand.CONNECTED for f in conn.receive_data(data)):
                return
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

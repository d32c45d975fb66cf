"""A starting broker's port listens from its bind on, and serves only once it is up.

Bound but not listening, a port 0 socket did not own its port: under load another
process's outgoing connection got the same ephemeral port and the broker's listen()
failed with EADDRINUSE (seen with two pytest workers). A connection made in between
waits in the backlog and is served by :meth:`BrokerServer.serve`.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from anabranch.broker.probe import handshake
from anabranch.broker.server import BrokerServer
from anabranch.testing.broker import InProcessBroker

GUARD_S = 30.0


def _listening(server: BrokerServer) -> bool:
    assert server._server is not None
    sock = server._server.sockets[0]
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


async def test_a_bound_port_listens_and_an_early_connection_is_served_after_serve(
    tmp_path: Path,
) -> None:
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        server = BrokerServer(broker.service, "127.0.0.1", 0)
        port = await server.start(serving=False)
        try:
            assert _listening(server)
            early = asyncio.create_task(handshake("127.0.0.1", port))
            await asyncio.sleep(0.2)
            assert not early.done()  # connected, but nobody answers before serve()
            await server.serve()
            await asyncio.wait_for(early, GUARD_S)
        finally:
            await server.stop()

"""The broker's asyncio TCP server: one :class:`Session` per connection.

It listens on the plain port and, with an SSL context, on the TLS port too
(``pulsar+ssl://``); both feed the same sessions and timer. ``plaintext=False`` leaves only
the TLS listener.

Each connection is an ``asyncio.Protocol`` with TCP_NODELAY (receipts are small and
latency-bound). The transport's write-buffer water marks feed the session's flow
control: above ``SESSION_OUTPUT_BYTES_MAX`` unsent bytes the session stops reading that
client until the buffer drains below a quarter of it. A connection over
``max_connections`` or ``max_connections_per_ip`` is refused: its CONNECT is answered with
ERROR TooManyRequests and the connection closed (``counters.connections_refused``). One
timer task, on the injected clock, drives every session's handshake timeout and keepalive.

Example (a second listener for a running broker's service):
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.broker.probe import handshake
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(service: BrokerService) -> None:
    ...     server = BrokerServer(service, "127.0.0.1", 0)
    ...     port = await server.start()
    ...     await handshake("127.0.0.1", port)        # CONNECT answered with CONNECTED
    ...     print(port > 0)
    ...     await server.stop()
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             await demo(broker.service)
    >>> asyncio.run(main())
    True
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from anabranch import failpoints, limits
from anabranch.broker.session import Session
from anabranch.errors import ResourceLimitReached
from anabranch.supervisor import Supervised

if TYPE_CHECKING:
    from anabranch.broker.service import BrokerService

log = logging.getLogger(__name__)


def event_loop_factory(use_uvloop: bool = True) -> Callable[[], asyncio.AbstractEventLoop]:
    """A loop factory for ``asyncio.Runner``: uvloop's when wanted and installed.

    Example:
        >>> with asyncio.Runner(loop_factory=event_loop_factory(False)) as runner:
        ...     runner.run(asyncio.sleep(0))
    """
    if use_uvloop:
        try:
            import uvloop

            return uvloop.new_event_loop
        except ImportError:
            log.info("uvloop is not installed: using the default asyncio loop")
    return asyncio.new_event_loop


class _Connection(asyncio.Protocol):
    """Glue between an asyncio transport and a Session."""

    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        self.session: Session | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport implements asyncio.Transport without subclassing it.
        transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        high = limits.SESSION_OUTPUT_BYTES_MAX
        transport.set_write_buffer_limits(high=high, low=high // 4)
        self.session = self.server._open_session(transport)

    def data_received(self, data: bytes) -> None:
        if self.session is not None:
            self.session.data_received(data)

    def eof_received(self) -> bool | None:
        return None  # close the transport

    def pause_writing(self) -> None:
        if self.session is not None:
            self.session.set_write_paused(True)

    def resume_writing(self) -> None:
        if self.session is not None:
            self.session.set_write_paused(False)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.session is not None:
            self.session.close()


def _peer_ip(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


LISTEN_BACKLOG = 100
"""Connections the kernel queues before the broker accepts them (asyncio's default)."""


class BrokerServer:
    """Listens on ``host:port`` and runs a Session per connection."""

    def __init__(
        self,
        service: BrokerService,
        host: str,
        port: int,
        *,
        keepalive_interval_s: float = limits.KEEPALIVE_INTERVAL_S,
        handshake_timeout_s: float = limits.HANDSHAKE_TIMEOUT_S,
        ssl_context: ssl.SSLContext | None = None,
        tls_port: int | None = None,
        plaintext: bool = True,
    ) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.tls_port = tls_port if ssl_context is not None else None
        self.plaintext = plaintext
        self._tls_server: asyncio.Server | None = None
        self.keepalive_interval_s = keepalive_interval_s
        self.handshake_timeout_s = handshake_timeout_s
        self.sessions: set[Session] = set()
        self._per_ip: dict[str, int] = {}
        """Open connections per client address (for ``max_connections_per_ip``)."""
        self._refused: set[Session] = set()
        """Connections over a cap, waiting for their CONNECT to be refused."""
        self._server: asyncio.Server | None = None
        self._timer: Supervised | None = None

    async def start(self, *, serving: bool = True) -> int:
        """Bind (and with ``serving``, start accepting); returns the bound port (useful
        with port 0). A broker binds first to learn its address, then :meth:`serve` once
        everything behind the port is up, so a client never meets a half-started broker:
        the port listens from the start, and a connection made meanwhile waits."""
        loop = asyncio.get_running_loop()
        if self.plaintext:
            self._server = await loop.create_server(
                lambda: _Connection(self),
                self.host,
                self.port,
                reuse_address=True,
                backlog=LISTEN_BACKLOG,
                start_serving=serving,
            )
            self.port = int(self._server.sockets[0].getsockname()[1])
            _listen_now(self._server)
        if self.ssl_context is not None and self.tls_port is not None:
            self._tls_server = await loop.create_server(
                lambda: _Connection(self),
                self.host,
                self.tls_port,
                ssl=self.ssl_context,
                ssl_handshake_timeout=self.handshake_timeout_s,
                reuse_address=True,
                backlog=LISTEN_BACKLOG,
                start_serving=serving,
            )
            self.tls_port = int(self._tls_server.sockets[0].getsockname()[1])
            _listen_now(self._tls_server)
        self._timer = Supervised(
            "connection-timer", self._run_timer, on_give_up=self.service.fatal.fail
        ).start()
        if serving:
            self._log_listening()
        return self.port

    def _log_listening(self) -> None:
        if self._server is not None:
            log.info("broker listening on %s:%d", self.host, self.port)
        if self._tls_server is not None:
            log.info("broker listening on %s:%s (TLS)", self.host, self.tls_port)

    async def serve(self) -> None:
        """Start accepting connections (after ``start(serving=False)``)."""
        assert self._server is not None or self._tls_server is not None, "start() first"
        for server in (self._server, self._tls_server):
            if server is not None:
                await server.start_serving()
        self._log_listening()

    def _open_session(self, transport: asyncio.Transport) -> Session:
        session = Session(
            self.service,
            transport,
            keepalive_interval_s=self.keepalive_interval_s,
            handshake_timeout_s=self.handshake_timeout_s,
        )
        ip = _peer_ip(transport)
        config = self.service.config
        if len(self.sessions) >= config.max_connections:
            session.refusal = ResourceLimitReached(
                "connections to this broker", config.max_connections
            )
        elif self._per_ip.get(ip, 0) >= config.max_connections_per_ip:
            session.refusal = ResourceLimitReached(
                "connections from this address", config.max_connections_per_ip
            )
        if session.refusal is not None:
            # Answered at its CONNECT (ERROR TooManyRequests, then closed): closing now
            # could reset the socket before the client reads why.
            self.service.counters.connections_refused += 1
            log.warning("refusing a connection from %s: %s", ip, session.refusal)
            self._refused.add(session)
            session.add_close_callback(self._refused.discard)
            # Not ticked by the timer: a client that never sends CONNECT is dropped here.
            timer = asyncio.get_running_loop().call_later(self.handshake_timeout_s, session.close)
            session.add_close_callback(lambda _: timer.cancel())
            return session
        self.sessions.add(session)
        self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        self.service.counters.connections_opened += 1
        session.add_close_callback(lambda s: self._session_closed(s, ip))
        return session

    def _session_closed(self, session: Session, ip: str) -> None:
        self.sessions.discard(session)
        left = self._per_ip.get(ip, 1) - 1
        if left > 0:
            self._per_ip[ip] = left
        else:
            self._per_ip.pop(ip, None)
        self.service.counters.connections_closed += 1

    async def _run_timer(self) -> None:
        clock = self.service.clock
        interval = min(
            limits.SESSION_TIMER_INTERVAL_S,
            self.keepalive_interval_s / 4,
            self.handshake_timeout_s / 4,
        )
        while True:
            await clock.sleep(interval)
            if failpoints.enabled(failpoints.BREAK_CONNECTION_TIMER):
                raise RuntimeError("failpoint: the connection timer is broken")
            now = clock.monotonic()
            for session in list(self.sessions):
                try:
                    session.tick(now)
                except Exception:
                    log.exception("session timer failed for %s", session.remote_address)

    def stop_accepting(self) -> None:
        """Close the listening sockets; open connections keep going."""
        for server in (self._server, self._tls_server):
            if server is not None:
                server.close()

    def pause_all(self) -> None:
        """Stop reading from every connection (shutdown: no new work is accepted)."""
        for session in list(self.sessions):
            if not session.closed and not session.reading_paused:
                session.transport.pause_reading()

    async def stop(self) -> None:
        """Stop listening, close every connection and the timer."""
        self.stop_accepting()
        if self._timer is not None:
            await self._timer.stop()
        for session in list(self._refused):
            session.close()
        sessions = list(self.sessions)
        for session in sessions:
            session.close()
        for session in sessions:
            await session.wait_closed()
        for server in (self._server, self._tls_server):
            if server is not None:
                await server.wait_closed()


def _listen_now(server: asyncio.Server) -> None:
    """Put ``server``'s sockets in the listening state before it serves.

    Why: a socket bound with SO_REUSEADDR but not yet listening does not own its port
    against connect(): the kernel may give the same (ephemeral) port to another socket's
    outgoing connection during a broker's start, and the later listen() then fails with
    EADDRINUSE. A listening socket keeps the port; connections that arrive before
    :meth:`BrokerServer.serve` wait in its backlog and are served once everything behind
    the port is up.
    """
    for transport_socket in server.sockets:
        # A dup shares the socket: listen() on it is listen() on the server's.
        with socket.fromfd(
            transport_socket.fileno(), transport_socket.family, transport_socket.type
        ) as sock:
            sock.listen(LISTEN_BACKLOG)

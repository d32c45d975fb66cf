"""Bounds on the admin HTTP server's connections, so a client that opens connections and
never finishes a request cannot take the broker's file descriptors.

* At most ``limits.ADMIN_HTTP_CONNECTIONS_MAX`` connections are open at once, and at most
  ``limits.ADMIN_HTTP_CONNECTIONS_PER_IP_MAX`` from one client address; one past either
  is closed as soon as it is accepted (before any byte of it is read), and counted in
  :attr:`ConnectionGuard.refused`. The binary protocol has its own cap
  (``BROKER_CONNECTIONS_MAX``); together they stay under the process's file limit.
* A connection that has not delivered a complete request head within
  ``limits.ADMIN_HTTP_IDLE_TIMEOUT_S`` of opening, or after its last answer, is closed
  (aiohttp's keep-alive timer, which also runs before the first request).
* A request body must arrive within ``limits.ADMIN_REQUEST_BODY_TIMEOUT_S``
  (``routes.body_bytes``).

Example:
    >>> import asyncio
    >>> from aiohttp import web
    >>> async def demo() -> tuple[int, int]:
    ...     runner = guarded_runner(web.Application(), connections_max=1)
    ...     await runner.setup()
    ...     site = web.TCPSite(runner, "127.0.0.1", 0)
    ...     await site.start()
    ...     port = runner.addresses[0][1]
    ...     first = await asyncio.open_connection("127.0.0.1", port)
    ...     second = await asyncio.open_connection("127.0.0.1", port)
    ...     closed = await second[0].read()   # b"": closed at once
    ...     for _, writer in (first, second):
    ...         writer.close()
    ...     refused = runner.guard.refused if runner.guard else -1
    ...     await runner.cleanup()
    ...     return len(closed), refused
    >>> asyncio.run(demo())
    (0, 1)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from anabranch import limits

log = logging.getLogger(__name__)


class ConnectionGuard:
    """Counts a server's connections, in all and per client address, and closes those past
    ``connections_max`` or ``per_ip_max``."""

    def __init__(self, server: web.Server, connections_max: int, per_ip_max: int) -> None:
        self._connections_max = connections_max
        self._per_ip_max = per_ip_max
        self.refused = 0
        """Connections closed on arrival because a cap was reached."""
        self._open = 0
        self._per_ip: dict[str, int] = {}
        self._ip_of: dict[RequestHandler, str] = {}
        """The connections counted (a refused one is not), by handler."""
        self._connection_made = server.connection_made
        self._connection_lost = server.connection_lost

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        self._connection_made(handler, transport)
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        from_ip = self._per_ip.get(ip, 0)
        if self._open < self._connections_max and from_ip < self._per_ip_max:
            self._open += 1
            self._per_ip[ip] = from_ip + 1
            self._ip_of[handler] = ip
            return
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning(
                "admin HTTP: %d connections open (%d from %s), refusing more (%d refused so far)",
                self._open,
                from_ip,
                ip,
                self.refused,
            )
        # Next loop turn, after the handler's request task has started: closed now, the
        # handler would lose its server before that task's first step, which then dies
        # on an assertion (an error logged per refused connection).
        asyncio.get_running_loop().call_soon(transport.close)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self._connection_lost(handler, exc)
        ip = self._ip_of.pop(handler, None)
        if ip is None:
            return
        self._open -= 1
        left = self._per_ip[ip] - 1
        if left:
            self._per_ip[ip] = left
        else:
            del self._per_ip[ip]


class GuardedRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose server has a :class:`ConnectionGuard`."""

    def __init__(
        self, app: web.Application, connections_max: int, per_ip_max: int, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._connections_max = connections_max
        self._per_ip_max = per_ip_max
        self.guard: ConnectionGuard | None = None
        """Set by ``setup``."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        guard = ConnectionGuard(server, self._connections_max, self._per_ip_max)
        # aiohttp's Server has no hook for accepting a connection; its RequestHandler
        # reports each one through these methods, before it reads anything and once closed.
        server.connection_made = guard.connection_made  # type: ignore[method-assign]
        server.connection_lost = guard.connection_lost  # type: ignore[method-assign]
        self.guard = guard
        return server


def guarded_runner(
    app: web.Application,
    *,
    connections_max: int = limits.ADMIN_HTTP_CONNECTIONS_MAX,
    per_ip_max: int = limits.ADMIN_HTTP_CONNECTIONS_PER_IP_MAX,
    idle_timeout_s: float = limits.ADMIN_HTTP_IDLE_TIMEOUT_S,
    **kwargs: Any,
) -> GuardedRunner:
    """A runner for ``app`` with the bounds of this module."""
    return GuardedRunner(
        app,
        connections_max,
        per_ip_max,
        keepalive_timeout=idle_timeout_s,
        handle_signals=False,
        **kwargs,
    )

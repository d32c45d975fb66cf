"""Bounds on the admin HTTP server's connections, so a client that opens connections and
never finishes a request cannot take the broker's file descriptors.

* At most ``limits.ADMIN_HTTP_CONNECTIONS_MAX`` connections are open at once; one past it
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
    """Counts a server's connections and closes those past ``connections_max``."""

    def __init__(self, server: web.Server, connections_max: int) -> None:
        self._server = server
        self._connections_max = connections_max
        self.refused = 0
        """Connections closed on arrival because the cap was reached."""
        self._connection_made = server.connection_made

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        self._connection_made(handler, transport)
        if len(self._server.connections) > self._connections_max:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning(
                    "admin HTTP: %d connections open, refusing more (%d refused so far)",
                    self._connections_max,
                    self.refused,
                )
            transport.close()


class GuardedRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose server has a :class:`ConnectionGuard`."""

    def __init__(self, app: web.Application, connections_max: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._connections_max = connections_max
        self.guard: ConnectionGuard | None = None
        """Set by ``setup``."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        guard = ConnectionGuard(server, self._connections_max)
        # aiohttp's Server has no hook for accepting a connection; its RequestHandler
        # reports each one through this method, before it reads anything.
        server.connection_made = guard.connection_made  # type: ignore[method-assign]
        self.guard = guard
        return server


def guarded_runner(
    app: web.Application,
    *,
    connections_max: int = limits.ADMIN_HTTP_CONNECTIONS_MAX,
    idle_timeout_s: float = limits.ADMIN_HTTP_IDLE_TIMEOUT_S,
    **kwargs: Any,
) -> GuardedRunner:
    """A runner for ``app`` with the bounds of this module."""
    return GuardedRunner(
        app, connections_max, keepalive_timeout=idle_timeout_s, handle_signals=False, **kwargs
    )

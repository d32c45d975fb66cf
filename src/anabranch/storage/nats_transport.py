"""A fix for nats-py's TCP transport: a reconnect attempt leaked the previous socket.

nats-py (2.16) keeps one ``TcpTransport`` across a client's reconnect attempts. When an
attempt connects but the handshake then fails (the server died again, as when every
JetStream node is killed), the next attempt's ``connect`` replaces the transport's stream
writers without closing them: the socket stays open until the garbage collector finds
the writer, which then warns (``ResourceWarning: unclosed <StreamWriter ...>``).

:func:`close_replaced_writers` wraps ``TcpTransport.connect`` so that it closes the
writers it is about to replace. It is applied once, when :mod:`.jetstream_client` is
imported; on a nats-py whose transport names its writers otherwise it does nothing.

Example:
    >>> import asyncio
    >>> from urllib.parse import urlparse
    >>> from nats.aio.transport import TcpTransport
    >>> async def demo() -> None:
    ...     accepted: list[asyncio.StreamWriter] = []
    ...     server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    ...     uri = urlparse(f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    ...     transport = TcpTransport()
    ...     await transport.connect(uri, 1024, 5)
    ...     first = transport._io_writer
    ...     await transport.connect(uri, 1024, 5)  # the next reconnect attempt
    ...     print(first.is_closing())
    ...     first.close()  # (a no-op now: done by the second connect)
    ...     await first.wait_closed()
    ...     transport.close()
    ...     await transport.wait_closed()
    ...     for writer in accepted:
    ...         writer.close()
    ...         await writer.wait_closed()
    ...     server.close()
    ...     await server.wait_closed()
    >>> close_replaced_writers()
    >>> asyncio.run(demo())
    True
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.transport import TcpTransport

_MARK = "_anabranch_closes_replaced_writers"


def close_replaced_writers() -> None:
    """Make ``TcpTransport.connect`` close the writers it replaces (idempotent)."""
    original: Callable[..., Awaitable[None]] = TcpTransport.connect
    if getattr(original, _MARK, False):
        return

    async def connect(self: TcpTransport, *args: Any, **kwargs: Any) -> None:
        for name in ("_io_writer", "_bare_io_writer"):
            writer: asyncio.StreamWriter | None = getattr(self, name, None)
            if writer is not None and not writer.is_closing():
                writer.close()
        await original(self, *args, **kwargs)

    setattr(connect, _MARK, True)
    TcpTransport.connect = connect  # type: ignore[method-assign]

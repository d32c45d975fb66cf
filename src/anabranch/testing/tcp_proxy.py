"""A loopback TCP proxy whose connections a test can cut: network faults without root.

Clients connect to ``proxy.endpoint`` instead of the server. :meth:`TcpProxy.drop` closes
every live connection (both directions, like a network reset); :meth:`TcpProxy.refuse`
makes new connections close at once until :meth:`TcpProxy.accept` (a partition). The
server never notices anything but disconnects.

For the fault harness: :meth:`TcpProxy.partition` blackholes live connections and new
ones (bytes are swallowed, nothing is closed, a new connection is accepted and never
answered: peers only notice by their own timeouts, like a cut cable) and
:meth:`TcpProxy.heal` ends it (the blackholed connections are dropped, since their byte
streams have holes); ``delay_s`` holds every chunk that long.

Example (in front of an echo server):
    >>> async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    ...     while data := await reader.read(100):
    ...         writer.write(data)
    ...     writer.close()
    >>> async def ask(endpoint: str, question: bytes) -> bytes:
    ...     host, port = endpoint.split(":")
    ...     reader, writer = await asyncio.open_connection(host, int(port))
    ...     try:
    ...         writer.write(question)
    ...         return await reader.read(100)
    ...     except ConnectionResetError:
    ...         return b""                            # cut by the proxy
    ...     finally:
    ...         writer.close()
    >>> async def demo(server_port: int) -> None:
    ...     proxy = await TcpProxy.start("127.0.0.1", server_port)
    ...     print(await ask(proxy.endpoint, b"ping"))  # a client uses proxy.endpoint
    ...     proxy.refuse()
    ...     proxy.drop()  # clients see their connection reset and cannot reconnect
    ...     print(await ask(proxy.endpoint, b"ping"))
    ...     proxy.accept()
    ...     print(await ask(proxy.endpoint, b"pong"))
    ...     await proxy.close()
    >>> async def main() -> None:
    ...     server = await asyncio.start_server(echo, "127.0.0.1", 0)
    ...     await demo(server.sockets[0].getsockname()[1])
    ...     server.close()
    ...     await server.wait_closed()
    >>> asyncio.run(main())
    b'ping'
    b''
    b'pong'
"""

from __future__ import annotations

import asyncio
import contextlib

PROXY_CHUNK_BYTES = 64 * 1024
"""Bytes copied per read; the proxy holds at most one chunk per direction."""


class TcpProxy:
    """See the module docstring."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.connections_total = 0
        """Connections accepted and forwarded so far (refused ones are not counted)."""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._refusing = False
        self._blackholed = False
        self.delay_s = 0.0
        """Seconds each forwarded chunk waits (a slow link; 0: none)."""

    @classmethod
    async def start(cls, target_host: str, target_port: int) -> TcpProxy:
        """Listen on a free loopback port and forward to ``target_host:target_port``."""
        proxy = cls(target_host, target_port)
        proxy._server = await asyncio.start_server(proxy._handle, "127.0.0.1", 0)
        return proxy

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def drop(self) -> None:
        """Close every live connection now (in both directions)."""
        for writer in list(self._writers):
            with contextlib.suppress(OSError):
                writer.transport.abort()
        self._writers.clear()

    def refuse(self) -> None:
        """Close new connections as soon as they are accepted, until :meth:`accept`."""
        self._refusing = True

    def accept(self) -> None:
        """Forward new connections again."""
        self._refusing = False

    def partition(self) -> None:
        """Swallow the bytes of live connections; accept new ones and never answer."""
        self._blackholed = True

    def heal(self) -> None:
        """End a partition or a delay: drop the blackholed connections, accept again."""
        if self._blackholed:
            self.drop()
        self._blackholed = False
        self._refusing = False
        self.delay_s = 0.0

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.drop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        if self._blackholed:
            await self._hold(reader, writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.connections_total += 1
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self._tasks.difference_update(pumps)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection made during a partition: read and drop its bytes until the heal
        drops it (a cut cable: the peer's connect "succeeds", nothing ever answers)."""
        self._writers.add(writer)
        try:
            while self._blackholed and await reader.read(PROXY_CHUNK_BYTES):
                pass
        except (OSError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction until EOF or error, then close the other side too."""
        try:
            while chunk := await reader.read(PROXY_CHUNK_BYTES):
                if self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                if self._blackholed:
                    continue
                writer.write(chunk)
                await writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            writer.transport.abort()

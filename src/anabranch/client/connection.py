"""Asyncio connections to brokers: handshake, request correlation, keepalive, lookups.

Theory of operation: a :class:`ClientConnection` owns one socket and one sans-IO
``ProtocolConnection``. Received bytes go, as the event loop hands them over (an
``asyncio.Protocol``, no stream buffer in between), to the protocol object, and each frame
is dispatched: responses that carry a ``request_id`` resolve the future of the
matching request; SEND_RECEIPT/SEND_ERROR go to the producer and MESSAGE and friends to the
consumer registered under the id; PING is answered with PONG. A keepalive task sends PING
after a silent interval and closes the connection when no PONG comes back. When the
connection closes for any reason every pending request fails with ``ConnectionClosed``
and every registered producer/consumer is told, so it can reconnect with backoff.

A paused or partitioned broker keeps TCP open and answers nothing, which the keepalive
notices only after a minute. So an operation waiting longer than ``operation_stuck_s`` (a
request here, a SEND in the producer) calls :meth:`ClientConnection.probe`: a PING that
must be answered (by anything) within ``probe_timeout_s``, or the connection is closed with
``BrokerUnresponsive`` and its users reconnect, looking their topics up again.

:class:`ConnectionPool` keeps one connection per broker address and performs LOOKUP and
PARTITIONED_METADATA, following redirects up to ``CLIENT_LOOKUP_REDIRECTS_MAX`` hops. It
remembers the brokers that failed a probe or a handshake: a new connection to one of them
must complete its handshake within the probe timeout (a paused broker's kernel still
accepts TCP), and requests that may go to any broker (lookups) go to another service-URL
broker first.

Example (against a running broker)::

    pool = ConnectionPool("pulsar://127.0.0.1:6650")
    address = await pool.lookup("persistent://public/default/t")
    conn = await pool.get(address)
    await pool.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random as _random
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Protocol, cast
from urllib.parse import urlsplit

from anabranch import __version__
from anabranch.client.auth import Authentication
from anabranch.client.errors import (
    AuthenticationFailed,
    BrokerUnresponsive,
    ConnectionClosed,
    LookupFailed,
    OperationTimeout,
    TlsHandshakeFailed,
    from_server_error,
)
from anabranch.client.tls import TlsOptions, client_ssl_context
from anabranch.core.names import SegmentName, parse_name
from anabranch.errors import AnabranchError, Closed, InvalidArgument, ListenerNotFound
from anabranch.limits import (
    CLIENT_LOOKUP_REDIRECTS_MAX,
    CLIENT_OPERATION_STUCK_S,
    CLIENT_OPERATION_TIMEOUT_S,
    CLIENT_PROBE_TIMEOUT_S,
    KEEPALIVE_INTERVAL_S,
)
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import PROTOCOL_VERSION_MAX, ProtocolConnection, Role, State
from anabranch.protocol.frames import Frame

log = logging.getLogger(__name__)
T = pb.BaseCommand
CLIENT_VERSION = f"anabranch-python-{__version__}"
DEFAULT_PORT = 6650
DEFAULT_TLS_PORT = 6651

Address = tuple[str, int]

# Responses matched to a request by their body's request_id.
_RESPONSE_BODIES: dict[int, str] = {
    T.SUCCESS: "success",
    T.ERROR: "error",
    T.PRODUCER_SUCCESS: "producer_success",
    T.LOOKUP_RESPONSE: "lookupTopicResponse",
    T.PARTITIONED_METADATA_RESPONSE: "partitionMetadataResponse",
    T.GET_LAST_MESSAGE_ID_RESPONSE: "getLastMessageIdResponse",
    T.ACK_RESPONSE: "ackResponse",
    T.SCALABLE_TOPIC_SUBSCRIBE_RESPONSE: "scalableTopicSubscribeResponse",
    T.TC_CLIENT_CONNECT_RESPONSE: "tcClientConnectResponse",
    T.NEW_TXN_RESPONSE: "newTxnResponse",
    T.END_TXN_RESPONSE: "endTxnResponse",
    T.ADD_PARTITION_TO_TXN_RESPONSE: "addPartitionToTxnResponse",
    T.GET_TOPICS_OF_NAMESPACE_RESPONSE: "getTopicsOfNamespaceResponse",
    T.WATCH_TOPIC_LIST_SUCCESS: "watchTopicListSuccess",
}
_PRODUCER_BODIES: dict[int, str] = {
    T.SEND_RECEIPT: "send_receipt",
    T.SEND_ERROR: "send_error",
    T.CLOSE_PRODUCER: "close_producer",
}
_CONSUMER_BODIES: dict[int, str] = {
    T.MESSAGE: "message",
    T.CLOSE_CONSUMER: "close_consumer",
    T.REACHED_END_OF_TOPIC: "reachedEndOfTopic",
    T.ACTIVE_CONSUMER_CHANGE: "active_consumer_change",
    T.SCALABLE_TOPIC_ASSIGNMENT_UPDATE: "scalableTopicAssignmentUpdate",
}
# DAG-watch pushes, routed by the client-chosen session id (scalable topics).
_WATCH_BODIES: dict[int, str] = {
    T.SCALABLE_TOPIC_UPDATE: "scalableTopicUpdate",
}


class Handler(Protocol):
    """What a producer or consumer implements to receive its frames."""

    def on_frame(self, frame: Frame) -> None:
        """A frame addressed to this producer/consumer id."""

    def on_connection_closed(self, conn: ClientConnection) -> None:
        """The connection went away (or the broker closed us): reconnect."""


def parse_service_url(url: str) -> Address:
    """``pulsar://host:port`` to an address (port 6650 by default).

    Example:
        >>> parse_service_url("pulsar://localhost:6651"), parse_service_url("pulsar://h")
        (('localhost', 6651), ('h', 6650))
    """
    addresses = parse_service_urls(url)
    if len(addresses) != 1:
        raise InvalidArgument(f"{url!r} names {len(addresses)} brokers, not one")
    return addresses[0]


def is_tls_url(url: str) -> bool:
    """Whether ``url`` is a ``pulsar+ssl://`` service URL.

    Example:
        >>> is_tls_url("pulsar+ssl://h:6651"), is_tls_url("pulsar://h")
        (True, False)
    """
    return url.startswith("pulsar+ssl://")


def parse_service_urls(url: str) -> tuple[Address, ...]:
    """A service URL naming one or several brokers, as upstream clients accept it:
    ``pulsar://h1:6650,h2:6651,h3`` (port 6650 by default, IPv6 hosts in brackets);
    ``pulsar+ssl://`` (TLS, port 6651 by default).

    Example:
        >>> parse_service_urls("pulsar://a:6651,b,[::1]:7000")
        (('a', 6651), ('b', 6650), ('::1', 7000))
        >>> parse_service_urls("pulsar+ssl://a")
        (('a', 6651),)
    """
    scheme, sep, hosts = url.partition("://")
    if scheme not in ("pulsar", "pulsar+ssl") or not sep:
        raise InvalidArgument(
            f"service URL {url!r} is not pulsar[+ssl]://host[:port][,host[:port]...]"
        )
    default_port = DEFAULT_TLS_PORT if scheme == "pulsar+ssl" else DEFAULT_PORT
    hosts = hosts.rstrip("/")
    addresses: list[Address] = []
    for host in hosts.split(","):
        try:
            parts = urlsplit(f"pulsar://{host.strip()}")
            port = parts.port
        except ValueError as err:
            raise InvalidArgument(f"service URL {url!r}: bad host {host!r}: {err}") from err
        if not parts.hostname or parts.path or parts.query or parts.fragment:
            raise InvalidArgument(f"service URL {url!r}: bad host {host!r}")
        addresses.append((parts.hostname, port or default_port))
    return tuple(addresses)


def _request_id_of(frame: Frame) -> int | None:
    field = _RESPONSE_BODIES.get(frame.type)
    if field is None:
        return None
    return int(getattr(frame.command, field).request_id)


class _Wire(asyncio.Protocol):
    """The socket side of a :class:`ClientConnection`: received bytes go straight to its frame
    decoder (no stream buffer to copy them through and no task woken per read), and
    ``drain`` waits while the transport's write buffer is over its high-water mark."""

    def __init__(self, conn: ClientConnection) -> None:
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = loop.create_future()
        self._resumed: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.conn._on_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.resume_writing()
        self.conn._on_lost(exc)

    def pause_writing(self) -> None:
        if self._resumed is None:
            self._resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        resumed, self._resumed = self._resumed, None
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    async def drain(self) -> None:
        if self._resumed is not None:
            await asyncio.shield(self._resumed)


class _AnswerWatchdog:
    """Times one request out: at each ``operation_stuck_s`` without an answer it probes
    the connection (a dead one is closed, failing the request); at the operation timeout
    it fails the request with ``OperationTimeout``."""

    __slots__ = ("_conn", "_deadline", "_fut", "_handle", "_loop", "_probe", "_request_id")

    def __init__(self, conn: ClientConnection, fut: asyncio.Future[Frame], request_id: int) -> None:
        self._conn = conn
        self._fut = fut
        self._request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + conn.operation_timeout_s
        self._probe: asyncio.Task[None] | None = None
        self._handle = self._arm()

    def _arm(self) -> asyncio.TimerHandle:
        when = min(self._deadline, self._loop.time() + self._conn.operation_stuck_s)
        return self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        if self._fut.done():
            return
        if self._loop.time() >= self._deadline:
            self._fut.set_exception(
                OperationTimeout(
                    f"no answer to request {self._request_id} from {self._conn._peer()}"
                )
            )
            return
        # A slow answer (a lookup waiting for a dead owner's record, a ledger recovery)
        # from a live broker keeps waiting; a broker that answers nothing is left.
        self._probe = self._loop.create_task(self._probe_then_rearm())

    async def _probe_then_rearm(self) -> None:
        if await self._conn.probe() and not self._fut.done():
            self._handle = self._arm()

    def cancel(self) -> None:
        self._handle.cancel()
        if self._probe is not None:
            self._probe.cancel()


class ClientConnection:
    """One connection to one broker (see the module docstring).

    ``handshake_timeout_s`` bounds connecting and the CONNECT/CONNECTED exchange: by
    default ``operation_stuck_s + probe_timeout_s`` (a CONNECT is an operation, and its
    own probe, since no PING may precede it), at most the operation timeout.
    ``on_unresponsive`` is told the address when a probe or a handshake gets no answer.
    """

    def __init__(
        self,
        address: Address,
        *,
        keepalive_interval_s: float = KEEPALIVE_INTERVAL_S,
        operation_timeout_s: float = CLIENT_OPERATION_TIMEOUT_S,
        operation_stuck_s: float = CLIENT_OPERATION_STUCK_S,
        probe_timeout_s: float = CLIENT_PROBE_TIMEOUT_S,
        handshake_timeout_s: float | None = None,
        on_unresponsive: Callable[[Address], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        auth: Authentication | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.address = address
        self.auth = auth
        self.ssl_context = ssl_context
        self.operation_timeout_s = operation_timeout_s
        self.operation_stuck_s = operation_stuck_s
        self.probe_timeout_s = probe_timeout_s
        if handshake_timeout_s is None:
            handshake_timeout_s = operation_stuck_s + probe_timeout_s
        self.handshake_timeout_s = min(handshake_timeout_s, operation_timeout_s)
        self._on_unresponsive = on_unresponsive
        self._probe_task: asyncio.Task[bool] | None = None
        self._heard: asyncio.Future[None] | None = None
        """Resolved by the next bytes received while a probe waits for them."""
        self._clock = clock
        self._proto = ProtocolConnection(
            Role.CLIENT, now=clock(), keepalive_interval_s=keepalive_interval_s
        )
        self._wire: _Wire | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._producers: dict[int, Handler] = {}
        self._consumers: dict[int, Handler] = {}
        self._watches: dict[int, Handler] = {}
        self._request_ids = itertools.count(1)
        self._out: list[bytes] = []
        """Frames written in this loop iteration, sent together at its end."""
        self._loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        self._connected: asyncio.Future[None] = self._loop.create_future()

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        """True until the connection is closed."""
        return not self._closed.is_set()

    @property
    def max_message_size(self) -> int:
        """The broker's advertised max message size (CONNECTED)."""
        return self._proto.max_message_size

    @property
    def supports_topic_watchers(self) -> bool:
        """Whether the broker advertised topic-list watchers (PIP-145) in CONNECTED."""
        return bool(self._proto.peer_feature_flags.supports_topic_watchers)

    @property
    def protocol_version(self) -> int:
        """The negotiated protocol version."""
        return self._proto.protocol_version

    async def open(self) -> None:
        """Connect the socket and complete the CONNECT/CONNECTED handshake."""
        host, port = self.address
        loop = asyncio.get_running_loop()
        try:
            _transport, self._wire = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Wire(self),
                    host,
                    port,
                    ssl=self.ssl_context,
                    server_hostname=host if self.ssl_context is not None else None,
                ),
                self.handshake_timeout_s,
            )
        except ssl.SSLError as err:
            self._closed.set()
            raise TlsHandshakeFailed(f"TLS handshake with {host}:{port} failed: {err}") from err
        except (OSError, TimeoutError) as err:
            self._closed.set()
            raise ConnectionClosed(f"cannot connect to {host}:{port}: {err}") from err
        self._tasks = [asyncio.create_task(self._keepalive_loop())]
        flags = pb.FeatureFlags(
            supports_auth_refresh=True,
            supports_broker_entry_metadata=True,
            supports_scalable_topics=True,
        )
        method, data = self._credentials()
        connect = commands.connect(CLIENT_VERSION, PROTOCOL_VERSION_MAX, flags, method, data)
        self._write(self._proto.send(connect))
        try:
            await asyncio.wait_for(asyncio.shield(self._connected), self.handshake_timeout_s)
        except TimeoutError as err:
            await self.close()
            # TCP is up (a paused broker's kernel accepts connections) but nothing answers.
            if self._on_unresponsive is not None:
                self._on_unresponsive(self.address)
            raise BrokerUnresponsive(
                f"no CONNECTED from {host}:{port} within {self.handshake_timeout_s}s"
            ) from err
        except BaseException:
            await self.close()
            raise

    def _credentials(self) -> tuple[str | None, bytes | None]:
        auth = self.auth
        if auth is None or not auth.method:
            return None, None
        try:
            return auth.method, auth.auth_data()
        except Exception as err:  # a token supplier that failed (file gone, ...)
            raise AuthenticationFailed(f"cannot get {auth.method} credentials: {err}") from err

    def _answer_challenge(self) -> None:
        """AUTH_RESPONSE to the broker's AUTH_CHALLENGE (it found our token expired): the
        authentication's current credentials (a token callable is asked again)."""
        try:
            method, data = self._credentials()
        except AuthenticationFailed as err:
            log.warning("%s: %s", self._peer(), err)
            method, data = None, None
        response = pb.AuthData(auth_method_name=method or "", auth_data=data or b"")
        body = pb.CommandAuthResponse(
            client_version=CLIENT_VERSION,
            response=response,
            protocol_version=PROTOCOL_VERSION_MAX,
        )
        self.send_command(pb.BaseCommand(type=T.AUTH_RESPONSE, authResponse=body))

    async def wait_closed(self) -> None:
        """Return once the connection has closed (for whatever reason)."""
        await self._closed.wait()

    async def close(self) -> None:
        """Close the socket; pending requests fail and handlers are told. Idempotent."""
        self._shutdown(ConnectionClosed(f"connection to {self._peer()} closed"))
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for task in self._tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._wire is not None:
            with contextlib.suppress(Exception):
                await self._wire.lost

    def _shutdown(self, error: AnabranchError) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._proto.close()
        self.flush()  # what was written before the close goes first (CLOSE_PRODUCER, ...)
        if self._wire is not None and self._wire.transport is not None:
            self._wire.transport.close()
        if not self._connected.done():
            self._connected.set_exception(error)
            self._connected.exception()  # retrieved here: open() may already be gone
        if self._heard is not None and not self._heard.done():
            self._heard.set_result(None)  # a probe in progress ends (and sees the close)
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)
        handlers = [*self._producers.values(), *self._consumers.values(), *self._watches.values()]
        self._producers.clear()
        self._consumers.clear()
        self._watches.clear()
        for handler in handlers:
            handler.on_connection_closed(self)

    def _peer(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    # --- sending ---------------------------------------------------------------------------

    def new_request_id(self) -> int:
        """A request id unique on this connection."""
        return next(self._request_ids)

    def _write(self, data: bytes) -> None:
        """Queue ``data``; everything written in one loop iteration goes to the socket in
        one system call at its end (a loopback send costs tens of microseconds of kernel
        time: a transaction's NEW_TXN, SEND and END_TXN of several producers share one)."""
        wire = self._wire
        if wire is None or wire.transport is None or self._closed.is_set():
            raise ConnectionClosed(f"connection to {self._peer()} is closed")
        out = self._out
        if not out:
            self._loop.call_soon(self.flush)
        out.append(data)

    def flush(self) -> None:
        """Hand the queued frames to the socket now (in order)."""
        out = self._out
        if not out:
            return
        self._out = []
        wire = self._wire
        if wire is None or wire.transport is None or wire.transport.is_closing():
            return  # closed meanwhile: its requests fail with the close
        wire.transport.write(b"".join(out))  # one frame: join returns it, no copy

    def send_command(
        self,
        command: pb.BaseCommand,
        metadata: pb.MessageMetadata | None = None,
        payload: bytes | None = None,
    ) -> None:
        """Write a command that expects no response (FLOW, ACK, SEND, ...)."""
        if self._closed.is_set():
            raise ConnectionClosed(f"connection to {self._peer()} is closed")
        self._write(self._proto.send(command, metadata, payload))

    async def request(self, command: pb.BaseCommand, request_id: int) -> Frame:
        """Send ``command`` (whose body carries ``request_id``) and await its response.

        The command goes out with everything else written in this loop turn (one system
        call: a transaction's END_TXN and the NEW_TXN of its replacement spare share
        one). An ERROR response (or a failed lookup) raises the mapped typed exception.
        """
        return await self._response(self._send_request(command, request_id), request_id)

    def request_now(self, command: pb.BaseCommand, request_id: int) -> Awaitable[Frame]:
        """:meth:`request` with ``command`` on the wire before this returns (a caller
        that does not yield to the loop soon still gets it sent now)."""
        fut = self._send_request(command, request_id)
        self.flush()
        return self._response(fut, request_id)

    def _send_request(self, command: pb.BaseCommand, request_id: int) -> asyncio.Future[Frame]:
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        try:
            self.send_command(command)
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        return fut

    async def _response(self, fut: asyncio.Future[Frame], request_id: int) -> Frame:
        try:
            frame = await self._answer(fut, request_id)
        finally:
            self._pending.pop(request_id, None)
        if frame.type == T.ERROR:
            body = frame.command.error
            raise from_server_error(int(body.error), body.message)
        return frame

    async def _answer(self, fut: asyncio.Future[Frame], request_id: int) -> Frame:
        """``fut``'s frame within the operation timeout, probing the connection each time
        the wait passes ``operation_stuck_s`` (a failed probe closes the connection, which
        fails ``fut``).

        One timer per request instead of ``wait_for(shield(fut))`` (a waiter, an outer
        future and their callbacks per round trip: ~25 us, a tenth of a transaction
        request's client time)."""
        watchdog = _AnswerWatchdog(self, fut, request_id)
        try:
            return await fut
        finally:
            watchdog.cancel()

    async def probe(self) -> bool:
        """Whether the broker still answers: a PING, then anything received within
        ``probe_timeout_s``. Otherwise the connection is closed with ``BrokerUnresponsive``
        (pending requests fail, producers and consumers reconnect) and False returned.
        Concurrent callers share one probe.

        Example (a connected ``conn``)::

            if not await conn.probe():
                ...  # conn is closed now; look the topic up again
        """
        if self._closed.is_set():
            return False
        task = self._probe_task
        if task is None:
            task = self._probe_task = asyncio.get_running_loop().create_task(self._run_probe())
        return await asyncio.shield(task)

    async def _run_probe(self) -> bool:
        heard = self._heard = asyncio.get_running_loop().create_future()
        try:
            self._write(self._proto.ping(self._clock()))
            await asyncio.wait_for(heard, self.probe_timeout_s)
        except AnabranchError:  # closed before the PING went out
            return False
        except TimeoutError:
            if self._closed.is_set():
                return False
            log.warning(
                "%s answered nothing within %.1fs of a PING: closing the connection",
                self._peer(),
                self.probe_timeout_s,
            )
            if self._on_unresponsive is not None:
                self._on_unresponsive(self.address)
            self._shutdown(BrokerUnresponsive(f"{self._peer()} stopped answering"))
            return False
        finally:
            self._heard = None
            self._probe_task = None
        return not self._closed.is_set()

    async def drain(self) -> None:
        """Wait until the socket's write buffer is below its high-water mark."""
        self.flush()
        if self._wire is not None and not self._closed.is_set():
            await self._wire.drain()

    # --- handlers --------------------------------------------------------------------------

    def register_producer(self, producer_id: int, handler: Handler) -> None:
        """Route this producer id's frames to ``handler``."""
        self._check_open()
        self._producers[producer_id] = handler

    def register_consumer(self, consumer_id: int, handler: Handler) -> None:
        """Route this consumer id's frames to ``handler``."""
        self._check_open()
        self._consumers[consumer_id] = handler

    def register_watch(self, session_id: int, handler: Handler) -> None:
        """Route SCALABLE_TOPIC_UPDATE frames of this DAG-watch session to ``handler``."""
        self._check_open()
        self._watches[session_id] = handler

    def unregister_watch(self, session_id: int) -> None:
        """Stop routing this DAG-watch session's updates."""
        self._watches.pop(session_id, None)

    def unregister_producer(self, producer_id: int) -> None:
        """Stop routing frames to this producer id."""
        self._producers.pop(producer_id, None)

    def unregister_consumer(self, consumer_id: int) -> None:
        """Stop routing frames to this consumer id."""
        self._consumers.pop(consumer_id, None)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ConnectionClosed(f"connection to {self._peer()} is closed")

    # --- receiving -------------------------------------------------------------------------

    def _on_data(self, data: bytes) -> None:
        if self._closed.is_set():
            return
        heard = self._heard
        if heard is not None and not heard.done():
            heard.set_result(None)  # any bytes from the broker prove it is alive
        try:
            for frame in self._proto.receive_data(data, now=self._clock()):
                self._dispatch(frame)
        except AnabranchError as err:
            log.warning("closing connection to %s: %s", self._peer(), err)
            self._shutdown(ConnectionClosed(f"protocol error from {self._peer()}: {err}"))
        except Exception:
            log.exception("closing connection to %s: a frame handler failed", self._peer())
            self._shutdown(ConnectionClosed(f"connection to {self._peer()} failed"))

    def _on_lost(self, exc: Exception | None) -> None:
        refused_tls = exc is None and self.ssl_context is not None
        if not self._connected.done() and (isinstance(exc, ssl.SSLError) or refused_tls):
            # TLS 1.3: the broker checks our certificate after our side of the handshake
            # and hangs up before answering CONNECT when it does not trust it (or requires
            # one we did not send). Reconnects of live producers/consumers still retry.
            self._shutdown(
                TlsHandshakeFailed(
                    f"{self._peer()} closed the TLS session before CONNECTED "
                    "(client certificate missing or not trusted?)"
                )
            )
        elif exc is None:
            self._shutdown(ConnectionClosed(f"{self._peer()} closed the connection"))
        else:
            self._shutdown(ConnectionClosed(f"connection to {self._peer()} failed: {exc}"))

    def _dispatch(self, frame: Frame) -> None:
        kind = frame.type
        if kind == T.CONNECTED:
            if not self._connected.done():
                self._connected.set_result(None)
            return
        if kind == T.PING:
            self.send_command(commands.pong())
            return
        if kind == T.PONG:
            return
        if kind == T.AUTH_CHALLENGE:
            self._answer_challenge()
            return
        if kind == T.ERROR and self._proto.state is not State.CONNECTED:
            body = frame.command.error
            if not self._connected.done():
                self._connected.set_exception(from_server_error(int(body.error), body.message))
            return
        request_id = _request_id_of(frame)
        if request_id is not None:
            fut = self._pending.get(request_id)
            if fut is not None and not fut.done():
                fut.set_result(frame)
            return
        if kind in _PRODUCER_BODIES:
            pid = int(getattr(frame.command, _PRODUCER_BODIES[kind]).producer_id)
            handler = self._producers.get(pid)
            if kind == T.CLOSE_PRODUCER:
                self._producers.pop(pid, None)
        elif kind in _CONSUMER_BODIES:
            cid = int(getattr(frame.command, _CONSUMER_BODIES[kind]).consumer_id)
            handler = self._consumers.get(cid)
            if kind == T.CLOSE_CONSUMER:
                self._consumers.pop(cid, None)
        elif kind in _WATCH_BODIES:
            handler = self._watches.get(int(getattr(frame.command, _WATCH_BODIES[kind]).session_id))
        elif kind == T.WATCH_TOPIC_UPDATE:
            # Topic-list watchers share the watch routes: both ids come from new_handler_id.
            handler = self._watches.get(int(frame.command.watchTopicUpdate.watcher_id))
        else:
            log.debug("ignoring %s from %s", frame.type_name, self._peer())
            return
        if handler is None:
            return
        if kind in (T.CLOSE_PRODUCER, T.CLOSE_CONSUMER):
            # The broker closed us (unload, seek, failover): reconnect like after a drop.
            handler.on_connection_closed(self)
        else:
            handler.on_frame(frame)

    async def _keepalive_loop(self) -> None:
        # Tick a few times per interval so a missing PONG is noticed within ~1/4 interval.
        tick = self._proto.keepalive_interval_s / 4
        while not self._closed.is_set():
            await asyncio.sleep(tick)
            now = self._clock()
            if self._proto.idle_timed_out(now):
                log.warning("connection to %s timed out (no PONG/handshake)", self._peer())
                self._shutdown(OperationTimeout(f"{self._peer()} stopped answering PING"))
                return
            if self._proto.ping_due(now):
                self._write(self._proto.ping(now))


class ConnectionPool:
    """One open connection per broker address, plus topic lookups.

    Example::

        pool = ConnectionPool("pulsar://127.0.0.1:6650")
        partitions = await pool.partitioned_metadata("persistent://public/default/t")
    """

    def __init__(
        self,
        service_url: str,
        *,
        keepalive_interval_s: float = KEEPALIVE_INTERVAL_S,
        operation_timeout_s: float = CLIENT_OPERATION_TIMEOUT_S,
        operation_stuck_s: float = CLIENT_OPERATION_STUCK_S,
        probe_timeout_s: float = CLIENT_PROBE_TIMEOUT_S,
        lookup_redirects_max: int = CLIENT_LOOKUP_REDIRECTS_MAX,
        random: Callable[[], float] = _random.random,
        auth: Authentication | None = None,
        tls: TlsOptions | None = None,
        listener_name: str | None = None,
    ) -> None:
        self.auth = auth
        self.listener_name = listener_name or None
        """The broker's advertised listener lookups ask for (``advertised_listener_name``)."""
        self.use_tls = is_tls_url(service_url)
        self.ssl_context: ssl.SSLContext | None = None
        if self.use_tls:
            tls = tls or TlsOptions()
            if auth is not None and auth.tls_cert_chain is not None:
                tls = replace(tls, cert_chain=auth.tls_cert_chain)
            self.ssl_context = client_ssl_context(tls)
        if operation_stuck_s <= 0 or probe_timeout_s <= 0:
            raise InvalidArgument("operation_stuck_s and probe_timeout_s must be > 0")
        self.random = random
        self.service_url = service_url
        self.service_addresses = parse_service_urls(service_url)
        self._service_index = 0
        self.keepalive_interval_s = keepalive_interval_s
        self.operation_timeout_s = operation_timeout_s
        self.operation_stuck_s = operation_stuck_s
        self.probe_timeout_s = probe_timeout_s
        self.lookup_redirects_max = lookup_redirects_max
        self._unresponsive: set[Address] = set()
        """Brokers that failed a probe and have not completed a handshake since (at most
        every broker the client ever talked to, a handful)."""
        self._connections: dict[Address, asyncio.Future[ClientConnection]] = {}
        self._handler_ids = itertools.count(1)
        self._closed = False

    def new_handler_id(self) -> int:
        """A producer/consumer id unique within this client (so, on every connection)."""
        return next(self._handler_ids)

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
        return self._closed

    def unresponsive(self, address: Address) -> bool:
        """Whether ``address`` failed a probe and has not answered a handshake since."""
        return address in self._unresponsive

    def _mark_unresponsive(self, address: Address) -> None:
        self._unresponsive.add(address)

    @property
    def service_address(self) -> Address:
        """The service URL's broker used now (the next one is tried when it is unreachable)."""
        return self.service_addresses[self._service_index]

    async def get(self, address: Address | None = None) -> ClientConnection:
        """An open connection to ``address``; by default to a service-URL broker, trying each
        of several in turn until one answers (upstream's rule for ``pulsar://a,b,c``)."""
        if address is not None:
            return await self._get(address)
        if self.service_address in self._unresponsive:
            # Ask a service-URL broker that answers, while there is one.
            count = len(self.service_addresses)
            for step in range(1, count):
                candidate = (self._service_index + step) % count
                if self.service_addresses[candidate] not in self._unresponsive:
                    self._service_index = candidate
                    break
        for _ in range(len(self.service_addresses) - 1):
            current = self._service_index
            try:
                return await self._get(self.service_addresses[current])
            except (ConnectionClosed, OperationTimeout) as err:
                if self._service_index == current:  # a concurrent get may have moved on
                    self._service_index = (current + 1) % len(self.service_addresses)
                log.info("%s; trying %s:%d next", err, *self.service_address)
        return await self._get(self.service_address)

    async def _get(self, address: Address) -> ClientConnection:
        if self._closed:
            raise Closed("the client is closed")
        fut = self._connections.get(address)
        if fut is not None:
            if not fut.done():
                return await asyncio.shield(fut)
            if fut.exception() is None and fut.result().is_open:
                return fut.result()
        fut = asyncio.get_running_loop().create_future()
        self._connections[address] = fut
        suspect = address in self._unresponsive
        conn = ClientConnection(
            address,
            keepalive_interval_s=self.keepalive_interval_s,
            operation_timeout_s=self.operation_timeout_s,
            operation_stuck_s=self.operation_stuck_s,
            probe_timeout_s=self.probe_timeout_s,
            # A broker that failed a probe gets the probe's time to answer, not the
            # operation timeout: a paused one would hold every reconnect for that long.
            handshake_timeout_s=min(self.probe_timeout_s, self.operation_timeout_s)
            if suspect
            else None,
            on_unresponsive=self._mark_unresponsive,
            auth=self.auth,
            ssl_context=self.ssl_context,
        )
        try:
            await conn.open()
        except BaseException as err:
            if self._connections.get(address) is fut:
                del self._connections[address]
            fut.set_exception(err)
            fut.exception()  # consumed: waiters (if any) got it through shield
            raise
        self._unresponsive.discard(address)
        fut.set_result(conn)
        return conn

    async def lookup(self, topic: str) -> Address:
        """The address of the broker that owns ``topic``, following redirects."""
        conn = await self.get()
        authoritative = False
        for _ in range(self.lookup_redirects_max + 1):
            request_id = conn.new_request_id()
            body = pb.CommandLookupTopic(
                topic=topic, request_id=request_id, authoritative=authoritative
            )
            if self.listener_name:
                body.advertised_listener_name = self.listener_name
            frame = await conn.request(pb.BaseCommand(type=T.LOOKUP, lookupTopic=body), request_id)
            resp = frame.command.lookupTopicResponse
            if resp.response == pb.CommandLookupTopicResponse.Failed:
                if self.listener_name and resp.message == str(ListenerNotFound(self.listener_name)):
                    # A configuration error, not a transient state: fail now, not at the
                    # operation timeout (upstream answers it as a retriable ServiceNotReady).
                    raise ListenerNotFound(self.listener_name)
                raise from_server_error(int(resp.error), resp.message)
            if resp.proxy_through_service_url:
                address = self.service_address
            else:
                address = parse_service_url(self.broker_url_of(resp))
            if resp.response == pb.CommandLookupTopicResponse.Connect:
                return address
            authoritative = bool(resp.authoritative)
            conn = await self.get(address)
        raise LookupFailed(f"lookup of {topic} exceeded {self.lookup_redirects_max} redirects")

    def broker_url_of(self, resp: pb.CommandLookupTopicResponse) -> str:
        """The broker URL of a lookup answer this client connects to: the TLS one on a
        ``pulsar+ssl://`` client (LookupFailed if the broker has no TLS listener)."""
        if not self.use_tls:
            return resp.brokerServiceUrl
        if resp.brokerServiceUrlTls:
            return resp.brokerServiceUrlTls
        if is_tls_url(resp.brokerServiceUrl):
            return resp.brokerServiceUrl
        raise LookupFailed("the topic's broker has no TLS listener (brokerServiceUrlTls)")

    async def partitioned_metadata(self, topic: str) -> int:
        """The number of partitions of ``topic`` (0: not partitioned, or a partition)."""
        name = parse_name(topic)
        if isinstance(name, SegmentName) or name.partition is not None:
            return 0  # partitions and segments are never partitioned: no broker to ask
        conn = await self.get()
        request_id = conn.new_request_id()
        body = pb.CommandPartitionedTopicMetadata(topic=topic, request_id=request_id)
        frame = await conn.request(
            pb.BaseCommand(type=T.PARTITIONED_METADATA, partitionMetadata=body), request_id
        )
        resp = frame.command.partitionMetadataResponse
        if resp.response == pb.CommandPartitionedTopicMetadataResponse.Failed:
            raise from_server_error(int(resp.error), resp.message)
        return int(resp.partitions)

    async def close(self) -> None:
        """Close every connection; later ``get`` calls raise ``Closed``."""
        self._closed = True
        futures, self._connections = list(self._connections.values()), {}
        for fut in futures:
            if fut.done() and fut.exception() is None:
                await fut.result().close()

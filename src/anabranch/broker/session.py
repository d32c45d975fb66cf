"""One client connection: the protocol state, a dispatch table, producers and consumers.

Theory of operation
-------------------
The server feeds received bytes to :meth:`Session.data_received`. The sans-IO
``ProtocolConnection`` turns them into frames, checking framing, direction and handshake
state; any ``ProtocolError`` there (oversized length prefix, ``cmdSize`` over the frame,
a broker-only command, anything before CONNECT) is answered with ERROR and the connection
is closed. Frames are then handled in arrival order by one worker task per connection:

* *inline* handlers (SEND, ACK, FLOW, CLOSE_*, ...) run in order; SEND never waits for the
  disk (the producer queues receipts), so a producer pipelines freely;
* *spawned* handlers (PRODUCER, SUBSCRIBE, lookups, schemas) may wait on metadata or
  storage, so they run as tasks and never hold up the connection; at most
  ``limits.SESSION_HANDLER_TASKS_MAX`` at once, past which the worker waits for one to end.

Authentication (``service.authentication``, None while disabled): CONNECT's
``auth_method_name``/``auth_data`` (and a TLS connection's verified client certificate) go
to the providers; success sets :attr:`Session.role`, the role authorization checks
(None while authentication is disabled). Bad credentials are refused with
AuthenticationError: our client gets ERROR and the close at once; other clients (the
official C++ core retries a refused handshake until its operation timeout) get CONNECTED
and then that error as the answer to their first request, and the close. Either way
nothing is served. A token that expires on a live connection gets an AUTH_CHALLENGE; the
connection closes unless the AUTH_RESPONSE carries valid credentials for the same role.

Handlers raise ``anabranch.errors`` exceptions for per-request failures; the session maps
them to ERROR with ``error_codes.server_error`` and keeps the connection. Any other
exception is logged and answered with UnknownError: client input never kills the broker.

Dispatch is one static table, ``command_table.TABLE``: command type → handler, inline or
spawned, and the permission it needs. With authentication on (``role`` set at CONNECT),
a spawned command's permission is checked before its handler runs; a refusal is answered
in the command's own response shape and runs nothing. Inline commands (the hot SEND, ACK,
FLOW) act on producers and consumers whose creation was checked, so they pay no check. A
client command absent from the table gets ERROR and a close. When the connection closes,
``command_table.CLOSE_HOOKS`` run.

Reading from the socket pauses while too many appends are pending, too many commands
are queued, or the socket's output buffer is over its high-water mark
(``limits.SESSION_*``), and resumes below the low marks; it also pauses for as long as a
topic the connection just published to is over its publish rate (:meth:`Session.throttle`),
and, for a connection with sends in flight, while the broker's publish buffer is over its
limit (``broker/publish_buffer.py``). The worker itself stops taking commands while
``SESSION_PENDING_APPENDS_MAX`` appends are pending, and while a publish-rate pause lasts,
so those bounds hold exactly (frames already read wait in the queue, which the pause
bounds).

Example:
    >>> # server.py: session = Session(service, transport); session.data_received(data)
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.broker import command_table
from anabranch.broker.authorization import NONE_RESOURCE
from anabranch.broker.command_table import AUTH_REFRESH, SERVER_VERSION, TABLE, Command
from anabranch.broker.error_codes import client_message, server_error
from anabranch.broker.producer import Producer
from anabranch.errors import (
    AnabranchError,
    AuthenticationError,
    BadFrameLength,
    FrameTooLarge,
    ProtocolError,
)
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import ProtocolConnection, Role, State
from anabranch.protocol.frames import Frame, encode_command

if TYPE_CHECKING:
    from anabranch.broker.service import BrokerService

log = logging.getLogger(__name__)
T = pb.BaseCommand

__all__ = ["SERVER_VERSION", "NotSupported", "Session"]

FRAMES_PER_STEP = 32
"""Inline handlers run back to back without yielding; after this many frames the worker
lets the loop run others (a client pipelining hundreds of cheap commands held every other
connection, a PING included, for the whole batch)."""


class Session:
    """One connection's broker-side state (see the module docstring)."""

    def __init__(
        self,
        service: BrokerService,
        transport: asyncio.Transport,
        *,
        keepalive_interval_s: float = limits.KEEPALIVE_INTERVAL_S,
        handshake_timeout_s: float = limits.HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.service = service
        self.transport = transport
        max_frame = max(
            limits.FRAME_SIZE_MAX_BYTES,
            service.config.max_message_size + limits.FRAME_PADDING_BYTES,
        )
        self.protocol = ProtocolConnection(
            Role.BROKER,
            max_frame_size=max_frame,
            now=service.clock.monotonic(),
            keepalive_interval_s=keepalive_interval_s,
            handshake_timeout_s=handshake_timeout_s,
            handshake_frame_size=limits.HANDSHAKE_FRAME_SIZE_MAX_BYTES,
        )
        self.role: str | None = None
        """The authenticated role (set by CONNECT); None while authentication is disabled."""
        self.auth_method = ""
        self.auth_expires_at: float | None = None
        """Unix time the connection's credentials expire (a token's ``exp``), if ever."""
        self.auth_challenged_at: float | None = None
        """Monotonic time an AUTH_CHALLENGE went out and is unanswered."""
        self.auth_checked_at = service.clock.monotonic()
        self.auth_failure: AuthenticationError | None = None
        """A failed CONNECT answered CONNECTED for a client that retries a refused handshake
        until it times out: its first request gets this error, then the close."""
        self.producers: dict[int, Producer] = {}
        self.creating_producers: set[int] = set()
        self.consumers: dict[int, Any] = {}
        self.topic_list_watchers: dict[int, Any] = {}
        """WATCH_TOPIC_LIST watchers by id (``topic_list_watchers``)."""
        self.pending_appends = 0
        self.pending_lookups = 0
        """LOOKUP/PARTITIONED_METADATA being answered (``SESSION_PENDING_LOOKUPS_MAX``)."""
        self.refusal: AnabranchError | None = None
        """Set by the server for a connection over its caps: CONNECT answers it and closes."""
        self.closed = False
        self._queue: deque[Frame] = deque()
        self._wakeup = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._task_slots = asyncio.Semaphore(limits.SESSION_HANDLER_TASKS_MAX)
        self._write_paused = False
        self._reading_paused = False
        self._throttle: asyncio.TimerHandle | None = None
        """Ends a pause of reading for a topic over its publish rate (:meth:`throttle`)."""
        self._on_close: list[Callable[[Session], None]] = []
        self._closing: set[asyncio.Future[Any]] = set()
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []
        self._out_bytes = 0
        """Bytes in ``_out``: queued this loop iteration, not yet in the transport."""
        peer = transport.get_extra_info("peername")
        self._remote = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._worker = asyncio.ensure_future(self._run())

    @property
    def remote_address(self) -> str:
        """``host:port`` of the client."""
        return self._remote

    @property
    def is_tls(self) -> bool:
        """Whether the client connected to the TLS listener."""
        return self.transport.get_extra_info("sslcontext") is not None

    @property
    def peer_certificate(self) -> dict[str, object] | None:
        """The verified client certificate of a TLS connection (None: plain TCP or none)."""
        cert = self.transport.get_extra_info("peercert")
        return cert if isinstance(cert, dict) and cert else None

    def _refuse_request(self, frame: Frame, err: AuthenticationError) -> None:
        """Answer a request of an unauthenticated session with ``err`` in the form its
        client waits for (lookups have their own failure responses), then close."""
        code, message = server_error(err), client_message(err)
        body = frame.body
        request_id = getattr(body, "request_id", None)
        if frame.type == T.PARTITIONED_METADATA:
            failed = pb.CommandPartitionedTopicMetadataResponse(
                request_id=request_id,
                response=pb.CommandPartitionedTopicMetadataResponse.Failed,
                error=code,  # type: ignore[arg-type]
                message=message,
            )
            self.write(
                pb.BaseCommand(
                    type=T.PARTITIONED_METADATA_RESPONSE, partitionMetadataResponse=failed
                )
            )
        elif frame.type == T.LOOKUP:
            lookup = pb.CommandLookupTopicResponse(
                request_id=request_id,
                response=pb.CommandLookupTopicResponse.Failed,
                error=code,  # type: ignore[arg-type]
                message=message,
            )
            self.write(pb.BaseCommand(type=T.LOOKUP_RESPONSE, lookupTopicResponse=lookup))
        elif request_id is not None:
            self.reply_error(int(request_id), code, message)
        log.info("%s: refused %s: %s", self._remote, frame.type_name, err)
        self.close()

    def refuse_authentication(self, err: AuthenticationError) -> None:
        """ERROR(AuthenticationError) and close (a failed CONNECT or AUTH_RESPONSE)."""
        log.info("%s: %s", self._remote, err)
        self.service.counters.authentication_failures += 1
        if not self.closed:
            self.flush()
            self.transport.write(
                encode_command(commands.error(0, server_error(err), client_message(err)))
            )
        self.close()

    # --- output ---------------------------------------------------------------------------

    def write(self, command: pb.BaseCommand) -> None:
        """Encode ``command`` and queue it on the socket (dropped once closed)."""
        if self.closed:
            return
        try:
            data = self.protocol.send(command)
        except ProtocolError as err:
            log.warning("%s: not sending %s: %s", self._remote, command.type, err)
            return
        self.write_bytes(data)

    def write_message(self, command: pb.BaseCommand, entry: bytes) -> None:
        """Queue a MESSAGE frame around a stored entry (no re-encoding)."""
        if self.closed:
            return
        self.write_bytes(self.protocol.send_entry(command, entry))

    def write_bytes(self, data: bytes) -> None:
        """Queue encoded frames. Everything written in one loop iteration goes to the
        socket in one ``transport.write`` at its end (receipts and MESSAGEs of a batch
        of completions share one system call)."""
        if self.closed:
            return
        out = self._out
        if not out:
            self._loop.call_soon(self.flush)
        out.append(data)
        self._out_bytes += len(data)

    def write_parts(self, head: bytes, body: bytes) -> None:
        """Queue one frame given as two parts (``write_bytes`` of ``head + body``, without
        the copy: a MESSAGE's stored entry is written as it is)."""
        if self.closed:
            return
        out = self._out
        if not out:
            self._loop.call_soon(self.flush)
        out += (head, body)
        self._out_bytes += len(head) + len(body)

    def flush(self) -> None:
        """Hand what ``write_bytes`` queued to the transport now (a vectored write: the
        parts are not joined into one copy first)."""
        out = self._out
        if out:
            over = self._out_bytes > limits.SESSION_OUTPUT_BYTES_MAX
            self._out = []
            self._out_bytes = 0
            if len(out) == 1:
                self.transport.write(out[0])
            else:
                self.transport.writelines(out)
            if over and not self._write_paused:
                # Dispatchers stopped on the queued bytes (``write_paused``) and the
                # socket took them all: nothing else would wake them.
                self._wake_consumers()

    def reply_error(self, request_id: int, code: int, message: str) -> None:
        """ERROR for a request; ``code`` is a ``pb.ServerError`` value."""
        self.write(commands.error(request_id, code, message))

    def reply_success(self, request_id: int) -> None:
        """SUCCESS for a request."""
        self.write(commands.success(request_id))

    # --- input ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        """Decode and queue frames; a protocol error closes the connection."""
        if self.closed:
            return
        try:
            frames = self.protocol.receive_data(data, now=self.service.clock.monotonic())
        except ProtocolError as err:
            self._protocol_failure(err)
            return
        if frames:
            self._queue.extend(frames)
            self._wakeup.set()
            self.update_reading()

    def _protocol_failure(self, err: ProtocolError) -> None:
        log.info("%s: protocol error, closing: %s", self._remote, err)
        counters = self.service.counters
        if isinstance(err, (FrameTooLarge, BadFrameLength)):
            counters.bad_frames += 1  # refused from the length prefix, before allocating
        else:
            counters.protocol_errors += 1
        # The state machine is CLOSED already, so the ERROR is encoded directly.
        code = server_error(err)
        if not self.closed:
            self.flush()
            self.transport.write(encode_command(commands.error(0, code, client_message(err))))
        self.close()

    async def _run(self) -> None:
        while not self.closed:
            await self._wakeup.wait()
            self._wakeup.clear()
            handled = 0
            while self._queue and not self.closed:
                if self.pending_appends >= limits.SESSION_PENDING_APPENDS_MAX:
                    break  # the rest waits for receipts; update_reading wakes us
                if self._throttle is not None:
                    break  # over a publish rate: frames read already wait too
                frame = self._queue.popleft()
                await self._dispatch(frame)
                handled += 1
                if handled % FRAMES_PER_STEP == 0:
                    await asyncio.sleep(0)  # let other connections run (fuzz: stalls)
            self.update_reading()

    async def _dispatch(self, frame: Frame) -> None:
        kind = frame.type
        if self.auth_failure is not None and kind not in (T.PING, T.PONG):
            self._refuse_request(frame, self.auth_failure)
            return
        entry = TABLE.get(kind)
        if entry is None:
            self._protocol_failure(NotSupported(frame.type_name))
            return
        if entry.spawned:
            # At SESSION_HANDLER_TASKS_MAX running handlers the worker waits for one to
            # end: later frames queue and reading pauses (bounded tasks, backpressure).
            await self._task_slots.acquire()
            if self.closed:
                self._task_slots.release()
                return
            task = asyncio.ensure_future(self._guard(entry, frame))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)
        else:
            await self._guard(entry, frame)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._task_slots.release()

    async def _guard(self, entry: Command, frame: Frame) -> None:
        try:
            # Inline rows (SEND, ACK, FLOW, ...) are never checked: their objects were.
            checked = entry.spawned and entry.checked and self.role is not None
            if checked and not await self._authorized(entry, frame):
                return
            result = entry.handler(self, frame)
            if result is not None:
                await result
        except ProtocolError as err:
            self._protocol_failure(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self._request_failed(frame, err)

    async def _authorized(self, entry: Command, frame: Frame) -> bool:
        """Check the row's permission; a refusal (or a resource name that cannot be
        parsed) is answered in the command's own shape."""
        try:
            resource = entry.resource(frame.body) if entry.resource else NONE_RESOURCE
            what = frame.type_name.lower()
            await self.service.authorizer.check(
                self.role, entry.need, resource, what, missing_tenant=entry.missing_tenant
            )
        except AnabranchError as err:
            if entry.reject is None:
                self._request_failed(frame, err)
            else:
                entry.reject(self, frame.body, err)
            return False
        return True

    def _request_failed(self, frame: Frame, err: Exception) -> None:
        if not isinstance(err, AnabranchError):
            log.error("%s: %s failed unexpectedly", self._remote, frame.type_name, exc_info=err)
        request_id = getattr(frame.body, "request_id", None)
        if request_id is None:
            log.info("%s: %s failed: %s", self._remote, frame.type_name, err)
            return
        self.reply_error(int(request_id), server_error(err), client_message(err))

    # --- flow control ---------------------------------------------------------------------

    def set_write_paused(self, paused: bool) -> None:
        """The transport's output buffer crossed a water mark. Dispatchers skip this
        connection's consumers while it is over (``Consumer.ready``); below again, they
        are woken."""
        self._write_paused = paused
        self.update_reading()
        if not paused:
            self._wake_consumers()

    def _wake_consumers(self) -> None:
        for consumer in list(self.consumers.values()):
            writable_again = getattr(consumer, "writable_again", None)
            if writable_again is not None:
                writable_again()

    def throttle(self, delay_s: float) -> None:
        """Stop reading this connection for ``delay_s`` seconds (or longer, if a pause
        already runs that long): a topic it publishes to is over its publish rate, as
        upstream stops reading a throttled producer's connection."""
        until = self._loop.time() + delay_s
        if self.closed or (self._throttle is not None and self._throttle.when() >= until):
            return
        if self._throttle is not None:
            self._throttle.cancel()
        self._throttle = self._loop.call_at(until, self._end_throttle)
        self.update_reading()

    def _end_throttle(self) -> None:
        self._throttle = None
        self.update_reading()

    def update_reading(self) -> None:
        """Pause or resume reading the socket per the bounds in the module docstring."""
        if self.closed:
            return
        pending, queued = self.pending_appends, len(self._queue)
        if queued and pending < limits.SESSION_PENDING_APPENDS_MAX and self._throttle is None:
            self._wakeup.set()  # the worker stopped at a bound; there is room again
        # Over the broker's publish buffer, only connections with sends in flight pause.
        buffer = self.service.publish_buffer
        buffer_full = pending > 0 and buffer.over
        if self._reading_paused:
            if (
                not self._write_paused
                and self._throttle is None
                and pending <= limits.SESSION_PENDING_APPENDS_MAX // 2
                and queued <= limits.SESSION_COMMAND_QUEUE_MAX // 2
                and not buffer_full
            ):
                self._reading_paused = False
                self.transport.resume_reading()
        elif (
            self._write_paused
            or self._throttle is not None
            or pending >= limits.SESSION_PENDING_APPENDS_MAX
            or queued > limits.SESSION_COMMAND_QUEUE_MAX
            or buffer_full
        ):
            self._reading_paused = True
            self.transport.pause_reading()
        if buffer_full:
            buffer.wait(self.update_reading)

    @property
    def reading_paused(self) -> bool:
        return self._reading_paused

    @property
    def write_paused(self) -> bool:
        """Whether the socket's output buffer, or what this loop iteration queued for it,
        is over its high-water mark: the peer reads slower than we write. Dispatchers
        send nothing more meanwhile (non-persistent ones drop)."""
        return self._write_paused or self._out_bytes > limits.SESSION_OUTPUT_BYTES_MAX

    # --- timers and closing ---------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Handshake timeout and keepalive, from the server's timer."""
        if self.closed:
            return
        if self.protocol.idle_timed_out(now):
            log.info("%s: %s timed out, closing", self._remote, _phase(self.protocol.state))
            self.close()
            return
        if self.protocol.ping_due(now):
            self.write_bytes(self.protocol.ping(now))
        if self.auth_expires_at is not None:
            self._check_credentials(now)

    def _check_credentials(self, now: float) -> None:
        """Every ``auth_refresh_check_s``: challenge expired credentials (Pulsar's
        AUTH_CHALLENGE with ``PulsarAuthRefresh``); close when the client cannot answer
        or left a challenge unanswered for a whole check interval."""
        interval = self.service.config.auth_refresh_check_s
        if now - self.auth_checked_at < interval:
            return
        self.auth_checked_at = now
        expires_at = self.auth_expires_at
        if expires_at is None or self.service.clock.wall_ms() / 1000 < expires_at:
            return
        can_refresh = self.protocol.peer_feature_flags.supports_auth_refresh
        if self.auth_challenged_at is not None or not can_refresh:
            self.refuse_authentication(AuthenticationError("credentials expired"))
        else:
            self.auth_challenged_at = now
            challenge = pb.AuthData(auth_method_name=self.auth_method, auth_data=AUTH_REFRESH)
            body = pb.CommandAuthChallenge(
                server_version=SERVER_VERSION,
                challenge=challenge,
                protocol_version=self.protocol.protocol_version,
            )
            self.write(pb.BaseCommand(type=T.AUTH_CHALLENGE, authChallenge=body))

    def close(self) -> None:
        """Close the connection: producers and consumers detach, tasks are cancelled."""
        if self.closed:
            return
        self.flush()  # what was written before the close still goes out
        self.closed = True
        self.service.publish_buffer.forget(self.update_reading)
        if self._throttle is not None:
            self._throttle.cancel()
            self._throttle = None
        self.protocol.close()
        self._queue.clear()
        for producer in list(self.producers.values()):
            producer.close()
        for hook in command_table.CLOSE_HOOKS:
            try:
                result = hook(self)
                if asyncio.iscoroutine(result):
                    self._closing.add(asyncio.ensure_future(result))
            except Exception:
                log.exception("%s: %s failed", self._remote, hook.__qualname__)
        self._worker.cancel()
        for task in list(self._tasks):
            task.cancel()
        self.transport.close()
        for callback in self._on_close:
            callback(self)

    def add_close_callback(self, callback: Callable[[Session], None]) -> None:
        """Run ``callback(session)`` once the session closes."""
        self._on_close.append(callback)

    async def wait_closed(self) -> None:
        """Wait until the worker and every spawned handler have ended."""
        await asyncio.wait([self._worker, *self._tasks, *self._closing])


class NotSupported(ProtocolError):
    """A client command this broker has no handler for (DESIGN.md §3.2: error + close)."""

    wire_code = "NotAllowedError"

    def __init__(self, command: str) -> None:
        super().__init__(f"command {command} is not supported by this broker")
        self.command = command


def _phase(state: State) -> str:
    return "keepalive" if state is State.CONNECTED else "handshake"

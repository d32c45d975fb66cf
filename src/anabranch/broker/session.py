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

Handlers raise ``anabranch.errors`` exceptions for per-request failures; the session maps
them to ERROR with ``error_codes.server_error`` and keeps the connection. Any other
exception is logged and answered with UnknownError: client input never kills the broker.

The dispatch table holds the core's handlers. Other command types are looked up lazily
by name, ``handle_<type name in lower case>(session, body)`` (e.g. ``handle_subscribe``,
``handle_redeliver_unacknowledged_messages``), in the modules of ``LAZY_HANDLER_MODULES``
(consumer commands, transactions, scalable topics), so those modules plug in without
touching this file. A client command that nobody handles gets ERROR and a close.
When the connection closes, each such module's ``on_session_closed(session)`` runs.

Reading from the socket pauses while too many appends are pending, too many commands
are queued, or the socket's output buffer is over its high-water mark
(``limits.SESSION_*``), and resumes below the low marks. The worker itself stops taking
commands while ``SESSION_PENDING_APPENDS_MAX`` appends are pending, so that bound holds
exactly (frames already read wait in the queue, which the pause bounds).

Example:
    >>> # server.py: session = Session(service, transport); session.data_received(data)
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.broker.error_codes import client_message, server_error
from anabranch.broker.lookup import (
    handle_get_or_create_schema,
    handle_get_schema,
    handle_get_topics_of_namespace,
    handle_lookup,
    handle_partitioned_metadata,
)
from anabranch.broker.producer import Producer, handle_producer
from anabranch.errors import (
    AnabranchError,
    BadFrameLength,
    FrameTooLarge,
    NotAllowed,
    NotOwner,
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

SERVER_VERSION = "anabranch-0.1"

LAZY_HANDLER_MODULES = (
    "anabranch.broker.consumer_commands",
    "anabranch.broker.txn_commands",
    "anabranch.broker.scalable_commands",
)
"""Modules searched for ``handle_<command>`` functions the table below does not hold."""

SPAWNED = frozenset(
    {
        T.PRODUCER, T.SUBSCRIBE, T.PARTITIONED_METADATA, T.LOOKUP, T.GET_TOPICS_OF_NAMESPACE,
        T.GET_SCHEMA, T.GET_OR_CREATE_SCHEMA, T.CLOSE_PRODUCER,
        T.SCALABLE_TOPIC_LOOKUP, T.SCALABLE_TOPIC_SUBSCRIBE, T.SCALABLE_TOPIC_UNSUBSCRIBE,
        T.WATCH_SCALABLE_TOPICS,
        T.TC_CLIENT_CONNECT_REQUEST, T.NEW_TXN, T.ADD_PARTITION_TO_TXN,
        T.ADD_SUBSCRIPTION_TO_TXN, T.END_TXN,
    }
)  # fmt: skip
"""Command types whose handlers may wait on metadata/storage: run as tasks."""

BodyHandler = Callable[["Session", Any], Awaitable[None] | None]


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
        )
        self.producers: dict[int, Producer] = {}
        self.creating_producers: set[int] = set()
        self.consumers: dict[int, Any] = {}
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
        self._on_close: list[Callable[[Session], None]] = []
        self._closing: set[asyncio.Future[Any]] = set()
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []
        peer = transport.get_extra_info("peername")
        self._remote = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._worker = asyncio.ensure_future(self._run())

    @property
    def remote_address(self) -> str:
        """``host:port`` of the client."""
        return self._remote

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

    def write_parts(self, head: bytes, body: bytes) -> None:
        """Queue one frame given as two parts (``write_bytes`` of ``head + body``, without
        the copy: a MESSAGE's stored entry is written as it is)."""
        if self.closed:
            return
        out = self._out
        if not out:
            self._loop.call_soon(self.flush)
        out += (head, body)

    def flush(self) -> None:
        """Hand what ``write_bytes`` queued to the transport now (a vectored write: the
        parts are not joined into one copy first)."""
        out = self._out
        if out:
            self._out = []
            if len(out) == 1:
                self.transport.write(out[0])
            else:
                self.transport.writelines(out)

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
            while self._queue and not self.closed:
                if self.pending_appends >= limits.SESSION_PENDING_APPENDS_MAX:
                    break  # the rest waits for receipts; update_reading wakes us
                frame = self._queue.popleft()
                await self._dispatch(frame)
            self.update_reading()

    async def _dispatch(self, frame: Frame) -> None:
        kind = frame.type
        handler = self._handler(kind)
        if handler is None:
            self._protocol_failure(NotSupported(frame.type_name))
            return
        if kind in SPAWNED:
            # At SESSION_HANDLER_TASKS_MAX running handlers the worker waits for one to
            # end: later frames queue and reading pauses (bounded tasks, backpressure).
            await self._task_slots.acquire()
            if self.closed:
                self._task_slots.release()
                return
            task = asyncio.ensure_future(self._guard(handler, frame))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)
        else:
            await self._guard(handler, frame)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._task_slots.release()

    def _handler(self, kind: int) -> Callable[[Session, Frame], Awaitable[None] | None] | None:
        handler = _FRAME_HANDLERS.get(kind)
        if handler is not None:
            return handler
        body_handler = _BODY_HANDLERS.get(kind) or _lazy_handler(kind)
        if body_handler is None:
            return None
        return lambda session, frame: body_handler(session, frame.body)

    async def _guard(
        self, handler: Callable[[Session, Frame], Awaitable[None] | None], frame: Frame
    ) -> None:
        try:
            result = handler(self, frame)
            if result is not None:
                await result
        except ProtocolError as err:
            self._protocol_failure(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self._request_failed(frame, err)

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
        """The transport's output buffer crossed a water mark."""
        self._write_paused = paused
        self.update_reading()

    def update_reading(self) -> None:
        """Pause or resume reading the socket per the bounds in the module docstring."""
        if self.closed:
            return
        pending, queued = self.pending_appends, len(self._queue)
        if queued and pending < limits.SESSION_PENDING_APPENDS_MAX:
            self._wakeup.set()  # the worker stopped at the bound; there is room again
        if self._reading_paused:
            if (
                not self._write_paused
                and pending <= limits.SESSION_PENDING_APPENDS_MAX // 2
                and queued <= limits.SESSION_COMMAND_QUEUE_MAX // 2
            ):
                self._reading_paused = False
                self.transport.resume_reading()
        elif (
            self._write_paused
            or pending >= limits.SESSION_PENDING_APPENDS_MAX
            or queued > limits.SESSION_COMMAND_QUEUE_MAX
        ):
            self._reading_paused = True
            self.transport.pause_reading()

    @property
    def reading_paused(self) -> bool:
        return self._reading_paused

    # --- timers and closing ---------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Handshake timeout and keepalive, from the server's timer."""
        if self.closed:
            return
        if self.protocol.idle_timed_out(now):
            log.info("%s: %s timed out, closing", self._remote, _phase(self.protocol.state))
            self.close()
        elif self.protocol.ping_due(now):
            self.write_bytes(self.protocol.ping(now))

    def close(self) -> None:
        """Close the connection: producers and consumers detach, tasks are cancelled."""
        if self.closed:
            return
        self.flush()  # what was written before the close still goes out
        self.closed = True
        self.protocol.close()
        self._queue.clear()
        for producer in list(self.producers.values()):
            producer.close()
        for name in LAZY_HANDLER_MODULES:
            module = _module(name)
            hook = getattr(module, "on_session_closed", None) if module else None
            if hook is not None:
                try:
                    result = hook(self)
                    if asyncio.iscoroutine(result):
                        self._closing.add(asyncio.ensure_future(result))
                except Exception:
                    log.exception("%s: %s.on_session_closed failed", self._remote, name)
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


# --- the core's handlers -------------------------------------------------------------------


def _handle_connect(session: Session, frame: Frame) -> None:
    refusal = session.refusal
    if refusal is not None:
        session.flush()
        error = commands.error(0, server_error(refusal), client_message(refusal))
        session.transport.write(encode_command(error))
        session.close()
        return
    flags = pb.FeatureFlags(supports_scalable_topics=True)
    version = session.protocol.negotiate_version()
    max_size = session.service.config.max_message_size
    session.write(commands.connected(SERVER_VERSION, version, max_size, flags))


def _handle_ping(session: Session, frame: Frame) -> None:
    session.write(commands.pong())


def _handle_pong(session: Session, frame: Frame) -> None:
    return None  # the protocol object clears the outstanding PING


def _handle_send(session: Session, frame: Frame) -> None:
    cmd = frame.command.send
    producer = session.producers.get(cmd.producer_id)
    if producer is None:
        err = NotAllowed(f"producer {cmd.producer_id} is not open on this connection")
        session.write(
            commands.send_error(
                cmd.producer_id, cmd.sequence_id, server_error(err), client_message(err)
            )
        )
        return
    ownership = session.service.ownership
    if ownership is not None and not ownership.serving(producer.topic.name):
        # Cluster mode: the topic moved (or our session ran out): the client reconnects.
        moved = NotOwner(producer.topic.name, None)
        session.write(
            commands.send_error(cmd.producer_id, cmd.sequence_id, server_error(moved), str(moved))
        )
        return
    producer.send(frame)


async def _handle_close_producer(session: Session, frame: Frame) -> None:
    cmd = frame.command.close_producer
    producer = session.producers.get(cmd.producer_id)
    if producer is not None:
        producer.close()
        # Receipts of sends still being written go out before the SUCCESS.
        pending = [f for _, _, f in producer.pending if not f.done()]
        if pending:
            await asyncio.wait(pending)
    session.reply_success(cmd.request_id)


_FRAME_HANDLERS: dict[int, Callable[[Session, Frame], Awaitable[None] | None]] = {
    T.CONNECT: _handle_connect,
    T.PING: _handle_ping,
    T.PONG: _handle_pong,
    T.SEND: _handle_send,
    T.CLOSE_PRODUCER: _handle_close_producer,
}

_BODY_HANDLERS: dict[int, BodyHandler] = {
    T.PRODUCER: handle_producer,
    T.PARTITIONED_METADATA: handle_partitioned_metadata,
    T.LOOKUP: handle_lookup,
    T.GET_TOPICS_OF_NAMESPACE: handle_get_topics_of_namespace,
    T.GET_SCHEMA: handle_get_schema,
    T.GET_OR_CREATE_SCHEMA: handle_get_or_create_schema,
}


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise  # the module exists but is broken: say so loudly
        return None


def _lazy_handler(kind: int) -> BodyHandler | None:
    try:
        name = "handle_" + T.Type.Name(kind).lower()
    except ValueError:
        return None
    for module_name in LAZY_HANDLER_MODULES:
        module = _module(module_name)
        handler = getattr(module, name, None) if module is not None else None
        if handler is not None:
            return handler  # type: ignore[no-any-return]
    return None

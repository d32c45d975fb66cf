"""Connection state of the Pulsar protocol for either side, without I/O (h11-style).

Theory of operation: the shell (broker session or client connection) feeds received bytes
to ``receive_data`` and writes whatever ``send`` returns. The object checks every command
against the table of who may send what (``commands.CLIENT_COMMANDS`` /
``BROKER_COMMANDS``) and against the handshake state, and keeps keepalive bookkeeping
from the ``now`` values it is given. It never reads a clock or touches a socket.

Handshake states::

    AWAIT_CONNECT --CONNECT--> AWAIT_CONNECTED --CONNECTED--> CONNECTED
          (ERROR or AUTH_CHALLENGE/AUTH_RESPONSE keep AWAIT_CONNECTED)
    any state --close()/protocol error--> CLOSED

Before CONNECTED only CONNECT, CONNECTED, ERROR, AUTH_CHALLENGE and AUTH_RESPONSE are legal;
anything else raises ``UnexpectedCommand`` and the shell closes the connection.

Example:
    >>> from anabranch.protocol import commands
    >>> client, broker = ProtocolConnection(Role.CLIENT), ProtocolConnection(Role.BROKER)
    >>> [f.type_name for f in broker.receive_data(client.send(commands.connect("c", 21)))]
    ['CONNECT']
    >>> reply = broker.send(commands.connected("anabranch", broker.negotiate_version(), 5242880))
    >>> [f.type_name for f in client.receive_data(reply)], client.state, broker.protocol_version
    (['CONNECTED'], <State.CONNECTED: 3>, 21)
"""

from __future__ import annotations

from enum import Enum, IntEnum

from anabranch.errors import UnexpectedCommand
from anabranch.limits import (
    FRAME_SIZE_MAX_BYTES,
    HANDSHAKE_TIMEOUT_S,
    KEEPALIVE_INTERVAL_S,
    MESSAGE_SIZE_MAX_BYTES,
)
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.commands import BROKER_COMMANDS, CLIENT_COMMANDS
from anabranch.protocol.frames import (
    PAYLOAD_COMMANDS,
    Frame,
    FrameDecoder,
    encode_command,
    encode_entry_frame,
    encode_payload_frame,
    type_name,
)

T = pb.BaseCommand
PROTOCOL_VERSION_MAX = int(pb.v21)
_HANDSHAKE_COMMANDS = frozenset(
    {T.CONNECT, T.CONNECTED, T.ERROR, T.AUTH_CHALLENGE, T.AUTH_RESPONSE}
)


class Role(Enum):
    """Which end of the connection this object is."""

    CLIENT = "client"
    BROKER = "broker"


class State(IntEnum):
    """Handshake state (see the module docstring)."""

    AWAIT_CONNECT = 1
    AWAIT_CONNECTED = 2
    CONNECTED = 3
    CLOSED = 4


class ProtocolConnection:
    """One Pulsar connection's protocol state, for a client or a broker."""

    def __init__(
        self,
        role: Role,
        max_frame_size: int = FRAME_SIZE_MAX_BYTES,
        now: float = 0.0,
        keepalive_interval_s: float = KEEPALIVE_INTERVAL_S,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        *,
        handshake_frame_size: int | None = None,
    ) -> None:
        """``handshake_frame_size``: the largest frame read until this side sends
        CONNECTED (a broker's bound on what a client not yet admitted makes it buffer);
        None: ``max_frame_size`` throughout."""
        self.role = role
        self.state = State.AWAIT_CONNECT
        self.max_frame_size = max_frame_size
        self.max_message_size = MESSAGE_SIZE_MAX_BYTES
        self.protocol_version = 0
        self.peer_protocol_version = 0
        self.peer_feature_flags = pb.FeatureFlags()
        self.peer_client_version = ""
        self.keepalive_interval_s = keepalive_interval_s
        self.handshake_timeout_s = handshake_timeout_s
        self._decoder = FrameDecoder(min(max_frame_size, handshake_frame_size or max_frame_size))
        self._opened_at = now
        self._last_received_at = now
        self._ping_sent_at: float | None = None
        self._peer_may_send = CLIENT_COMMANDS if role is Role.BROKER else BROKER_COMMANDS
        self._we_may_send = BROKER_COMMANDS if role is Role.BROKER else CLIENT_COMMANDS

    # --- receiving -------------------------------------------------------------------------

    @property
    def frame_size_limit(self) -> int:
        """The largest frame read now: ``handshake_frame_size`` until CONNECTED is sent,
        then ``max_frame_size``. A broker lowers it again for a client it answered
        CONNECTED without admitting it (refused credentials, see ``command_table``)."""
        return self._decoder.max_frame_size

    @frame_size_limit.setter
    def frame_size_limit(self, size: int) -> None:
        self._decoder.max_frame_size = min(size, self.max_frame_size)

    @property
    def buffered_bytes(self) -> int:
        """Received bytes not yet returned as frames (at most one frame's worth)."""
        return self._decoder.buffered_bytes

    def receive_data(self, data: bytes, now: float | None = None) -> list[Frame]:
        """Decode ``data`` into frames, checking each against the state and direction table.

        ``now`` (seconds, any monotonic origin) records liveness for the keepalive.
        Raises a ``ProtocolError`` subclass; the connection is then CLOSED.
        """
        if self.state is State.CLOSED:
            raise UnexpectedCommand("data", "the connection is closed")
        try:
            frames = self._decoder.feed(data)
            for frame in frames:
                self._on_receive(frame)
        except Exception:
            self.state = State.CLOSED
            raise
        if frames and now is not None:
            self._last_received_at = now
        return frames

    def _on_receive(self, frame: Frame) -> None:
        kind = frame.type
        name = type_name(kind)
        if kind not in self._peer_may_send:
            raise UnexpectedCommand(name, f"a {self._peer_role()} may not send it")
        if self.state is State.AWAIT_CONNECT and self.role is Role.BROKER and kind != T.CONNECT:
            raise UnexpectedCommand(name, "sent before CONNECT")
        if self.state is not State.CONNECTED and kind not in _HANDSHAKE_COMMANDS:
            raise UnexpectedCommand(name, "sent before the handshake completed")
        if kind == T.CONNECT:
            if self.state is not State.AWAIT_CONNECT:
                raise UnexpectedCommand(name, "sent twice")
            body = frame.command.connect
            self.peer_protocol_version = int(body.protocol_version)
            self.peer_client_version = body.client_version
            self.peer_feature_flags.CopyFrom(body.feature_flags)
            self.state = State.AWAIT_CONNECTED
        elif kind == T.CONNECTED:
            if self.state is not State.AWAIT_CONNECTED:
                raise UnexpectedCommand(name, "without a CONNECT")
            body_c = frame.command.connected
            self.protocol_version = int(body_c.protocol_version)
            self.peer_protocol_version = self.protocol_version
            self.peer_feature_flags.CopyFrom(body_c.feature_flags)
            if body_c.HasField("max_message_size"):
                self.max_message_size = int(body_c.max_message_size)
            self.state = State.CONNECTED
        elif kind == T.PONG:
            self._ping_sent_at = None

    def _peer_role(self) -> str:
        return "client" if self.role is Role.BROKER else "broker"

    # --- sending ---------------------------------------------------------------------------

    def negotiate_version(self, ours: int = PROTOCOL_VERSION_MAX) -> int:
        """The version a broker answers with: the lower of the client's and ours."""
        return min(self.peer_protocol_version, ours)

    def send(
        self,
        command: pb.BaseCommand,
        metadata: pb.MessageMetadata | None = None,
        payload: bytes | None = None,
    ) -> bytes:
        """Encode ``command`` (with metadata and payload for SEND/MESSAGE) as frame bytes.

        Raises ``UnexpectedCommand`` if this side may not send it in the current state.
        """
        self._check_send(command)
        if command.type in PAYLOAD_COMMANDS:
            if metadata is None:
                raise UnexpectedCommand(type_name(command.type), "needs message metadata")
            data = encode_payload_frame(command, metadata, payload or b"")
        else:
            data = encode_command(command)
        self._after_send(command)
        return data

    def send_entry(self, command: pb.BaseCommand, entry: bytes) -> bytes:
        """Encode a MESSAGE/SEND around a stored message section (``Frame.entry``)."""
        self._check_send(command)
        data = encode_entry_frame(command, entry)
        self._after_send(command)
        return data

    def ping(self, now: float) -> bytes:
        """A PING frame; the PONG is then awaited (see ``idle_timed_out``)."""
        data = self.send(pb.BaseCommand(type=T.PING, ping=pb.CommandPing()))
        self._ping_sent_at = now
        return data

    def _check_send(self, command: pb.BaseCommand) -> None:
        kind = int(command.type)
        name = type_name(kind)
        if self.state is State.CLOSED:
            raise UnexpectedCommand(name, "the connection is closed")
        if kind not in self._we_may_send:
            raise UnexpectedCommand(name, f"a {self.role.value} may not send it")
        if kind == T.CONNECT and self.state is not State.AWAIT_CONNECT:
            raise UnexpectedCommand(name, "sent twice")
        if kind == T.CONNECTED and self.state is not State.AWAIT_CONNECTED:
            raise UnexpectedCommand(name, "no CONNECT was received")
        if self.state is not State.CONNECTED and kind not in _HANDSHAKE_COMMANDS:
            raise UnexpectedCommand(name, "the handshake has not completed")

    def _after_send(self, command: pb.BaseCommand) -> None:
        if command.type == T.CONNECT:
            self.state = State.AWAIT_CONNECTED
        elif command.type == T.CONNECTED:
            self._decoder.max_frame_size = self.max_frame_size
            self.protocol_version = int(command.connected.protocol_version)
            if command.connected.HasField("max_message_size"):
                self.max_message_size = int(command.connected.max_message_size)
            self.state = State.CONNECTED

    # --- keepalive and closing -------------------------------------------------------------

    def ping_due(self, now: float) -> bool:
        """True if the peer has been silent for a keepalive interval and no PING is out."""
        if self.state is not State.CONNECTED or self._ping_sent_at is not None:
            return False
        return now - self._last_received_at >= self.keepalive_interval_s

    def idle_timed_out(self, now: float) -> bool:
        """True if the connection should be closed: no handshake in time, or no PONG."""
        if self.state is State.CLOSED:
            return False
        if self.state is not State.CONNECTED:
            return now - self._opened_at >= self.handshake_timeout_s
        if self._ping_sent_at is None:
            return False
        return now - self._ping_sent_at >= self.keepalive_interval_s

    def close(self) -> None:
        """Mark the connection closed; further sends and receives raise."""
        self.state = State.CLOSED

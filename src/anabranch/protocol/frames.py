"""Pulsar frame encoding and an incremental, bounded frame decoder (sans-IO).

Wire layout (all integers big-endian)::

    simple:   [totalSize:4][cmdSize:4][BaseCommand]
    payload:  [totalSize:4][cmdSize:4][BaseCommand]
              ([0x0e02:2][brokerEntryMetadataSize:4][BrokerEntryMetadata])?
              ([0x0e01:2][crc32c:4])? [metadataSize:4][MessageMetadata][payload]

``totalSize`` counts every byte after itself. The CRC32-C covers ``metadataSize``,
the metadata and the payload. Only SEND and MESSAGE carry a payload.

A bad length prefix raises before a single byte is buffered for the frame; every other
defect raises a ``ProtocolError`` subclass. A payload checksum mismatch is *not* an error:
it is reported as ``Frame.checksum_ok = False`` so that a broker can answer the SEND with
SEND_ERROR(ChecksumError) and keep the connection.

Example:
    >>> from anabranch.protocol import commands
    >>> decoder = FrameDecoder()
    >>> [f.type_name for f in decoder.feed(encode_command(commands.ping()))]
    ['PING']
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Any, Final

from google.protobuf.descriptor import FieldDescriptor  # type: ignore[import-untyped]
from google.protobuf.message import DecodeError, Message  # type: ignore[import-untyped]

from anabranch.errors import BadFrameLength, FrameTooLarge, MalformedFrame
from anabranch.limits import FRAME_SIZE_MAX_BYTES
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.checksum import crc32c

log = logging.getLogger(__name__)

MAGIC_CHECKSUM: Final = 0x0E01
MAGIC_BROKER_ENTRY_METADATA: Final = 0x0E02
LENGTH_PREFIX_BYTES: Final = 4
FRAME_SIZE_MIN_BYTES: Final = 4
"""Smallest legal ``totalSize``: the frame must at least hold ``cmdSize``."""

PAYLOAD_COMMANDS: Final = frozenset({pb.BaseCommand.SEND, pb.BaseCommand.MESSAGE})

_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_U16 = struct.Struct(">H")
_BASE_FIELDS = pb.BaseCommand.DESCRIPTOR.fields_by_number
_BODY_FIELDS: dict[int, str] = {number: f.name for number, f in _BASE_FIELDS.items()}


def type_name(command_type: int) -> str:
    """Upstream's name of a BaseCommand type number ("UNKNOWN(n)" for others).

    Example:
        >>> type_name(2), type_name(99)
        ('CONNECT', 'UNKNOWN(99)')
    """
    name = _TYPE_NAMES.get(command_type)
    return f"UNKNOWN({command_type})" if name is None else name


_TYPE_NAMES: dict[int, str] = {number: name for name, number in pb.BaseCommand.Type.items()}
"""Computed once: frames name their type on every send and receive."""


def body_field(command_type: int) -> str:
    """Name of the BaseCommand field that holds the body of ``command_type``.

    Upstream numbers each body field like its type, which is what this relies on.

    Example:
        >>> body_field(pb.BaseCommand.SEND_RECEIPT)
        'send_receipt'
    """
    return str(_BASE_FIELDS[command_type].name)


@dataclass(slots=True)
class Frame:
    """One decoded frame (treat it as immutable: not frozen only because a frozen
    dataclass costs a microsecond more to build, once per frame).

    ``entry`` is the message section exactly as received (checksum header included when
    present): what a broker stores and later re-sends in a MESSAGE frame without
    re-encoding. ``checksum_ok`` is None when the sender included no checksum.
    """

    command: pb.BaseCommand
    metadata: pb.MessageMetadata | None = None
    payload: bytes = b""
    broker_entry_metadata: pb.BrokerEntryMetadata | None = None
    checksum_ok: bool | None = None
    entry: bytes = b""
    frame_size: int = 0

    @property
    def type(self) -> int:
        """The BaseCommand type number."""
        return int(self.command.type)

    @property
    def type_name(self) -> str:
        """The BaseCommand type name, e.g. ``"SEND"``."""
        return type_name(self.type)

    @property
    def body(self) -> Message:
        """The command's body message (e.g. the CommandSend of a SEND)."""
        body: Message = getattr(self.command, body_field(self.type))
        return body


# --- encoding ------------------------------------------------------------------------------


def _serialize(message: Message, what: str) -> bytes:
    if not message.IsInitialized():
        missing = ", ".join(message.FindInitializationErrors())
        raise MalformedFrame(f"refusing to encode {what} with missing fields: {missing}")
    return bytes(message.SerializeToString())


def encode_command(command: pb.BaseCommand) -> bytes:
    """Encode a simple (payload-less) frame.

    Example:
        >>> from anabranch.protocol import commands
        >>> encode_command(commands.ping()).hex()
        '00000009000000050812920100'
    """
    cmd = _serialize(command, type_name(command.type))
    return _U32.pack(len(cmd) + 4) + _U32.pack(len(cmd)) + cmd


def encode_entry(metadata: pb.MessageMetadata, payload: bytes, *, checksum: bool = True) -> bytes:
    """Encode the message section ``[0x0e01][crc32c][metadataSize][metadata][payload]``.

    Example:
        >>> md = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=0)
        >>> encode_entry(md, b"x")[:2].hex()
        '0e01'
    """
    meta = _serialize(metadata, "MessageMetadata")
    body = _U32.pack(len(meta)) + meta + payload
    if not checksum:
        return body
    return _U16.pack(MAGIC_CHECKSUM) + _U32.pack(crc32c(body)) + body


def encode_entry_frame(
    command: pb.BaseCommand,
    entry: bytes,
    broker_entry_metadata: pb.BrokerEntryMetadata | None = None,
) -> bytes:
    """Encode a payload frame around an already-encoded message section (see ``Frame.entry``).

    Example:
        >>> from anabranch.protocol import commands
        >>> md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=2)
        >>> frame = encode_entry_frame(commands.send(1, 1), encode_entry(md, b"hi"))
        >>> FrameDecoder().feed(frame)[0].payload
        b'hi'
    """
    if command.type not in PAYLOAD_COMMANDS:
        raise MalformedFrame(f"{type_name(command.type)} cannot carry a payload")
    cmd = _serialize(command, type_name(command.type))
    parts = [_U32.pack(len(cmd)), cmd]
    if broker_entry_metadata is not None:
        bem = broker_entry_metadata.SerializeToString()
        parts += [_U16.pack(MAGIC_BROKER_ENTRY_METADATA), _U32.pack(len(bem)), bem]
    parts.append(entry)
    rest = b"".join(parts)
    return _U32.pack(len(rest)) + rest


def encode_payload_frame(
    command: pb.BaseCommand,
    metadata: pb.MessageMetadata,
    payload: bytes,
    broker_entry_metadata: pb.BrokerEntryMetadata | None = None,
) -> bytes:
    """Encode a SEND or MESSAGE frame with a checksummed message section.

    Example:
        >>> from anabranch.protocol import commands
        >>> md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=2)
        >>> f = FrameDecoder().feed(encode_payload_frame(commands.send(1, 1), md, b"hi"))[0]
        >>> (f.checksum_ok, f.metadata.sequence_id)
        (True, 1)
    """
    return encode_entry_frame(command, encode_entry(metadata, payload), broker_entry_metadata)


# --- decoding ------------------------------------------------------------------------------


def _parse(message: Message, data: bytes, what: str) -> list[Any] | None:
    """Parse and check ``data`` into ``message``; returns its ListFields when the check
    needed them (None: a message without string fields)."""
    try:
        message.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as err:
        # The runtime's text names the broker's internal proto package and parser state:
        # the peer gets a fixed reason, the detail stays in the broker's debug log.
        log.debug("unparsable %s: %s", what, err)
        raise MalformedFrame(f"unparsable {what}") from err
    if not message.IsInitialized():
        missing = ", ".join(message.FindInitializationErrors())
        raise MalformedFrame(f"{what} lacks required fields: {missing}")
    descriptor = message.DESCRIPTOR
    if not (_STRINGY.get(descriptor) or _stringy(descriptor)):
        return None
    fields: list[Any] = message.ListFields()
    bad = _invalid_string_in(fields)
    if bad is not None:
        raise MalformedFrame(f"{what} field {bad} is not valid UTF-8")
    return fields


_STRING = FieldDescriptor.TYPE_STRING
_MESSAGE = FieldDescriptor.TYPE_MESSAGE
_STRINGY: dict[Any, bool] = {}
"""Per message descriptor: whether it holds a string field at any depth."""


def _stringy(descriptor: Any) -> bool:
    known = _STRINGY.get(descriptor)
    if known is None:
        known = _STRINGY[descriptor] = _reaches_string(descriptor, set())
    return known


def _reaches_string(descriptor: Any, seen: set[Any]) -> bool:
    """Depth-first: a string field in ``descriptor`` or a message type it holds (a type
    already on the path is skipped: recursive types such as MessageIdData)."""
    if descriptor in seen:
        return False
    seen.add(descriptor)
    return any(
        f.type == FieldDescriptor.TYPE_STRING
        or (f.type == FieldDescriptor.TYPE_MESSAGE and _reaches_string(f.message_type, seen))
        for f in descriptor.fields
    )


def _invalid_string(message: Message) -> str | None:
    """The name of a ``string`` field holding invalid UTF-8, if any.

    proto2 parsing does not check UTF-8: the Python runtime then hands such a field out as
    ``bytes``, which no handler expects (a bit flip in a topic name made one raise
    TypeError). Checked once here, for every parsed message, so handlers can trust the
    declared types. Messages without string fields are skipped (SEND bodies, ids).
    """
    if not _stringy(message.DESCRIPTOR):
        return None
    return _invalid_string_in(message.ListFields())


def _invalid_string_in(fields: list[Any]) -> str | None:
    """:func:`_invalid_string` of a message given its ListFields."""
    for fd, value in fields:
        kind = fd.type
        if kind == _STRING:
            if type(value) is bytes or (fd.is_repeated and any(type(v) is bytes for v in value)):
                return str(fd.name)
        elif kind == _MESSAGE and _stringy(fd.message_type):
            for item in value if fd.is_repeated else (value,):
                bad = _invalid_string(item)
                if bad is not None:
                    return f"{fd.name}.{bad}"
    return None


def _check_body(command: pb.BaseCommand, fields: list[Any]) -> None:
    """The body must be the one the type names, and the only one present (``fields``:
    the command's ListFields)."""
    kind = int(command.type)
    if len(fields) == 2 and fields[1][0].name == _BODY_FIELDS.get(kind):
        return  # type and its body: the common case, decided without building lists
    expected = body_field(kind)
    present = [f.name for f, _ in fields if f.number != 1]
    body_descriptor = _BASE_FIELDS[kind].message_type
    # PING and PONG have empty bodies that some senders leave out altogether.
    if expected not in present and body_descriptor.fields:
        raise MalformedFrame(f"{type_name(kind)} without its {expected} body")
    others = [name for name in present if name != expected]
    if others:
        raise MalformedFrame(f"{type_name(kind)} carries unrelated bodies: {', '.join(others)}")


def decode_frame(frame: bytes) -> Frame:
    """Decode one frame given without its 4-byte length prefix.

    Example:
        >>> from anabranch.protocol import commands
        >>> decode_frame(encode_command(commands.pong())[4:]).type_name
        'PONG'
    """
    size = len(frame)
    if size < 4:
        raise BadFrameLength(size, FRAME_SIZE_MIN_BYTES)
    (cmd_size,) = _I32.unpack_from(frame, 0)
    if cmd_size < 0 or cmd_size > size - 4:
        raise MalformedFrame(f"command size {cmd_size} does not fit a frame of {size} bytes")
    command = pb.BaseCommand()
    fields = _parse(command, frame[4 : 4 + cmd_size], "BaseCommand")
    _check_body(command, command.ListFields() if fields is None else fields)
    rest = frame[4 + cmd_size :]
    if command.type not in PAYLOAD_COMMANDS:
        if rest:
            raise MalformedFrame(f"{type_name(command.type)} followed by {len(rest)} bytes")
        return Frame(command=command, frame_size=size + 4)
    return _decode_payload(command, rest, size + 4)


def _decode_payload(command: pb.BaseCommand, rest: bytes, frame_size: int) -> Frame:
    broker_entry_metadata = None
    if len(rest) >= 2 and _U16.unpack_from(rest, 0)[0] == MAGIC_BROKER_ENTRY_METADATA:
        if len(rest) < 6:
            raise MalformedFrame("truncated broker entry metadata header")
        (bem_size,) = _I32.unpack_from(rest, 2)
        if bem_size < 0 or bem_size > len(rest) - 6:
            raise MalformedFrame(f"broker entry metadata size {bem_size} does not fit")
        broker_entry_metadata = pb.BrokerEntryMetadata()
        _parse(broker_entry_metadata, rest[6 : 6 + bem_size], "BrokerEntryMetadata")
        rest = rest[6 + bem_size :]
    entry = rest
    checksum_ok: bool | None = None
    if len(rest) >= 2 and _U16.unpack_from(rest, 0)[0] == MAGIC_CHECKSUM:
        if len(rest) < 6:
            raise MalformedFrame("truncated checksum header")
        (expected,) = _U32.unpack_from(rest, 2)
        rest = rest[6:]
        checksum_ok = crc32c(rest) == expected
    if len(rest) < 4:
        raise MalformedFrame(f"{type_name(command.type)} without message metadata")
    (meta_size,) = _I32.unpack_from(rest, 0)
    if meta_size < 0 or meta_size > len(rest) - 4:
        raise MalformedFrame(f"metadata size {meta_size} does not fit {len(rest) - 4} bytes")
    metadata: pb.MessageMetadata | None = pb.MessageMetadata()
    assert metadata is not None
    try:
        _parse(metadata, rest[4 : 4 + meta_size], "MessageMetadata")
    except MalformedFrame:
        if checksum_ok is not False:
            raise
        # Corrupt bytes under a failed checksum: report the mismatch, not a protocol error.
        metadata = None
    return Frame(
        command=command,
        metadata=metadata,
        payload=rest[4 + meta_size :],
        broker_entry_metadata=broker_entry_metadata,
        checksum_ok=checksum_ok,
        entry=entry,
        frame_size=frame_size,
    )


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole frames back.

    The length prefix is validated as soon as its 4 bytes arrive, before the body is
    buffered. After any error the decoder stays failed (the connection must be closed).

    Example:
        >>> from anabranch.protocol import commands
        >>> data = encode_command(commands.ping())
        >>> d = FrameDecoder()
        >>> d.feed(data[:5]), d.buffered_bytes
        ([], 5)
        >>> [f.type_name for f in d.feed(data[5:])], d.buffered_bytes
        (['PING'], 0)
    """

    def __init__(self, max_frame_size: int = FRAME_SIZE_MAX_BYTES) -> None:
        if max_frame_size < LENGTH_PREFIX_BYTES + FRAME_SIZE_MIN_BYTES:
            raise ValueError(f"max_frame_size {max_frame_size} is too small")
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()
        self._failed: Exception | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet part of a returned frame."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Add received bytes; return every frame they complete, in order."""
        if self._failed is not None:
            raise self._failed
        frames: list[Frame] = []
        try:
            self._check_next_prefix(data)
            self._buffer += data
            while True:
                frame = self._next_frame()
                if frame is None:
                    break
                frames.append(frame)
        except Exception as err:
            self._failed = err
            self._buffer = bytearray()
            raise
        return frames

    def _check_next_prefix(self, data: bytes | bytearray | memoryview) -> None:
        # Validate a prefix that this chunk completes before the chunk is buffered, so a
        # bogus length never makes the buffer grow.
        have = len(self._buffer)
        if have < LENGTH_PREFIX_BYTES and have + len(data) >= LENGTH_PREFIX_BYTES:
            prefix = bytes(self._buffer) + bytes(data[: LENGTH_PREFIX_BYTES - have])
            self._check_size(_I32.unpack(prefix)[0])

    def _check_size(self, total_size: int) -> None:
        if total_size < FRAME_SIZE_MIN_BYTES:
            raise BadFrameLength(total_size, FRAME_SIZE_MIN_BYTES)
        if total_size + LENGTH_PREFIX_BYTES > self.max_frame_size:
            raise FrameTooLarge(total_size + LENGTH_PREFIX_BYTES, self.max_frame_size)

    def _next_frame(self) -> Frame | None:
        buf = self._buffer
        if len(buf) < LENGTH_PREFIX_BYTES:
            return None
        (total_size,) = _I32.unpack_from(buf, 0)
        self._check_size(total_size)
        end = LENGTH_PREFIX_BYTES + total_size
        if len(buf) < end:
            return None
        with memoryview(buf) as view:  # one copy (a bytearray slice would make two)
            body = bytes(view[LENGTH_PREFIX_BYTES:end])
        del buf[:end]
        return decode_frame(body)

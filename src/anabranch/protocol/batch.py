"""Batch payloads: ``[singleMetaSize:4][SingleMessageMetadata][payload]`` repeated.

A batch is the (decompressed) payload of a message whose MessageMetadata says
``num_messages_in_batch``. Decoding is bounded by that count, by ``BATCH_MESSAGES_MAX``
and by the payload's own length; any mismatch is ``InvalidMessage``.

Example:
    >>> entries = [(pb.SingleMessageMetadata(payload_size=0), b"a"), (None, b"bc")]
    >>> [p for _, p in decode_batch(encode_batch(entries), 2)]
    [b'a', b'bc']
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from anabranch.errors import InvalidMessage
from anabranch.limits import BATCH_MESSAGES_MAX
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.varint import U64, varint

_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")


def encode_batch(entries: Iterable[tuple[pb.SingleMessageMetadata | None, bytes]]) -> bytes:
    """Encode (metadata, payload) pairs; ``payload_size`` is set from the payload."""
    return join_batch(
        (_encode_single(metadata, len(payload)), payload) for metadata, payload in entries
    )


def _encode_single(metadata: pb.SingleMessageMetadata | None, payload_size: int) -> bytes:
    single = pb.SingleMessageMetadata()
    if metadata is not None:
        single.CopyFrom(metadata)
    single.payload_size = payload_size
    return bytes(single.SerializeToString())


def join_batch(entries: Iterable[tuple[bytes, bytes]]) -> bytes:
    """Join (encoded ``SingleMessageMetadata``, payload) pairs into a batch payload.

    >>> join_batch([(single_metadata(1, 0), b"a")])
    b'\\x00\\x00\\x00\\x04\\x18\\x01@\\x00a'
    """
    parts: list[bytes] = []
    for metadata, payload in entries:
        parts += [_U32.pack(len(metadata)), metadata, payload]
    return b"".join(parts)


def single_metadata(
    payload_size: int,
    sequence_id: int,
    key: str | None = None,
    event_time: int | None = None,
    properties: Iterable[tuple[str, str]] = (),
) -> bytes:
    """The wire bytes of a ``SingleMessageMetadata``, written without a protobuf object.

    A producer batching 100 k messages/s cannot afford a protobuf object per message;
    the bytes are those the protobuf runtime writes (fields in number order).

    >>> pb.SingleMessageMetadata.FromString(single_metadata(5, 9, "k")).partition_key
    'k'
    """
    out = b""
    for name, value in properties:
        k, v = name.encode(), value.encode()
        kv = b"\x0a" + varint(len(k)) + k + b"\x12" + varint(len(v)) + v
        out += b"\x0a" + varint(len(kv)) + kv
    if key is not None:
        k = key.encode()
        out += b"\x12" + varint(len(k)) + k
    out += b"\x18" + varint(payload_size)
    if event_time is not None:
        out += b"\x28" + varint(event_time & U64)
    return out + b"\x40" + varint(sequence_id & U64)


def split_batch(
    data: bytes, num_messages: int, max_messages: int = BATCH_MESSAGES_MAX
) -> list[tuple[bytes, bytes]]:
    """Split a batch payload into exactly ``num_messages`` (raw metadata, payload) pairs.

    What :func:`decode_batch` does without a protobuf object per message: a consumer
    receiving 300 k messages/s needs only each message's ``payload_size`` to find the next
    one, and decodes the rest of a message's metadata when (if) it is read. The size is read
    from the layout every producer writes (properties and key, then ``payload_size``); any
    other layout is parsed by protobuf, which also says what is wrong with a broken one. (A
    metadata that repeats ``payload_size`` is read by its first, where protobuf takes the
    last: no producer writes one, and a wrong size fails the batch's length checks.)

    >>> split_batch(join_batch([(single_metadata(1, 7, "k"), b"a")]), 1)
    [(b'\\x12\\x01k\\x18\\x01@\\x07', b'a')]
    """
    if num_messages < 0 or num_messages > max_messages:
        raise InvalidMessage(f"batch declares {num_messages} messages (limit {max_messages})")
    out: list[tuple[bytes, bytes]] = []
    append = out.append
    unpack = _I32.unpack_from
    total = len(data)
    offset = 0
    for index in range(num_messages):
        if total - offset < 4:
            raise InvalidMessage(f"batch truncated before message {index}")
        (meta_size,) = unpack(data, offset)
        start = offset + 4
        end = start + meta_size
        if meta_size < 0 or end > total:
            raise InvalidMessage(f"message {index}: metadata size {meta_size} does not fit")
        # The common cases inline: a one-byte size, after no key or a short key.
        tag = data[start] if meta_size else 0
        if tag == _SIZE_TAG and meta_size >= 2 and data[start + 1] < 0x80:
            size = data[start + 1]
        elif (
            tag == _KEY_TAG
            and meta_size >= 4
            and (at := start + 2 + data[start + 1]) < end - 1
            and data[start + 1] < 0x80
            and data[at] == _SIZE_TAG
            and data[at + 1] < 0x80
        ):
            size = data[at + 1]
        else:
            size = _payload_size(data, start, end, index)
        offset = end + size
        if offset > total:
            raise InvalidMessage(f"message {index}: payload size {size} does not fit")
        append((data[start:end], data[end:offset]))
    if offset != total:
        raise InvalidMessage(f"{total - offset} bytes after the last batch message")
    return out


_SIZE_TAG = 0x18  # SingleMessageMetadata field 3 (payload_size), varint
_KEY_TAG = 0x12  # field 2 (partition_key), length-delimited
_SKIPPABLE_TAGS = (0x0A, _KEY_TAG)  # fields 1 (properties) and 2 (partition_key), length-delimited


def _payload_size(data: bytes, start: int, end: int, index: int) -> int:
    """The ``payload_size`` of the metadata at ``data[start:end]``."""
    pos = start
    while pos < end:
        tag = data[pos]
        if tag == _SIZE_TAG:
            size, pos = _read_varint(data, pos + 1, end)
            if pos >= 0:
                return size
            break
        if tag not in _SKIPPABLE_TAGS:
            break
        length, pos = _read_varint(data, pos + 1, end)
        if pos < 0:
            break
        pos += length
    return _parsed_payload_size(data[start:end], index)


def _read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it), or (0, -1) when no complete varint of at most five bytes
    (sizes are int32) lies before ``end``."""
    value = shift = 0
    while pos < end and shift < 35:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return 0, -1


def _parsed_payload_size(raw: bytes, index: int) -> int:
    single = pb.SingleMessageMetadata()
    try:
        single.ParseFromString(raw)
    except DecodeError as err:
        raise InvalidMessage(f"message {index}: unparsable metadata") from err
    if not single.IsInitialized():
        raise InvalidMessage(f"message {index}: metadata lacks payload_size")
    size = int(single.payload_size)
    if size < 0:
        raise InvalidMessage(f"message {index}: payload size {size} does not fit")
    return size


def compacted_out(raw: bytes) -> bool:
    """Whether the raw ``SingleMessageMetadata`` says its message was compacted out.

    Only a metadata holding the field's tag byte (0x20) can say so; those few are parsed.
    """
    if 0x20 not in raw:
        return False
    try:
        return bool(pb.SingleMessageMetadata.FromString(raw).compacted_out)
    except DecodeError:
        return False


def decode_batch(
    data: bytes, num_messages: int, max_messages: int = BATCH_MESSAGES_MAX
) -> list[tuple[pb.SingleMessageMetadata, bytes]]:
    """Split a batch payload into exactly ``num_messages`` (metadata, payload) pairs."""
    if num_messages < 0 or num_messages > max_messages:
        raise InvalidMessage(f"batch declares {num_messages} messages (limit {max_messages})")
    out: list[tuple[pb.SingleMessageMetadata, bytes]] = []
    offset = 0
    for index in range(num_messages):
        if len(data) - offset < 4:
            raise InvalidMessage(f"batch truncated before message {index}")
        (meta_size,) = _I32.unpack_from(data, offset)
        offset += 4
        if meta_size < 0 or meta_size > len(data) - offset:
            raise InvalidMessage(f"message {index}: metadata size {meta_size} does not fit")
        single = pb.SingleMessageMetadata()
        try:
            single.ParseFromString(data[offset : offset + meta_size])
        except DecodeError as err:
            raise InvalidMessage(f"message {index}: unparsable metadata") from err
        if not single.IsInitialized():
            raise InvalidMessage(f"message {index}: metadata lacks payload_size")
        offset += meta_size
        size = single.payload_size
        if size < 0 or size > len(data) - offset:
            raise InvalidMessage(f"message {index}: payload size {size} does not fit")
        out.append((single, data[offset : offset + size]))
        offset += size
    if offset != len(data):
        raise InvalidMessage(f"{len(data) - offset} bytes after the last batch message")
    return out

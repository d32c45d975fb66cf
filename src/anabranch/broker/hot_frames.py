"""Hand-encoded frames for the broker's hot paths: SEND_RECEIPT (one per stored send) and
MESSAGE (one per dispatched entry).

Building ``pb.BaseCommand`` objects and serializing them costs several microseconds per
frame; these functions write the same protobuf wire bytes directly (fields in number
order, as the protobuf runtime writes them), so a receiver cannot tell the difference.
Tests compare them with ``protocol.frames`` byte for byte.

Example:
    >>> from anabranch.protocol.frames import decode_frame
    >>> frame = decode_frame(encode_send_receipt(1, 7, 3, 300)[4:])
    >>> r = frame.command.send_receipt
    >>> (r.producer_id, r.sequence_id, r.message_id.ledgerId, r.message_id.entryId)
    (1, 7, 3, 300)
"""

from __future__ import annotations

import struct

from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.varint import U64, varint

_PACK_U32 = struct.Struct(">I").pack
_RECEIPT_HEAD = bytes([0x08, pb.BaseCommand.SEND_RECEIPT, 0x3A])
"""BaseCommand ``type`` (field 1) = SEND_RECEIPT, then the tag of ``send_receipt`` (7)."""
_MESSAGE_HEAD = bytes([0x08, pb.BaseCommand.MESSAGE, 0x4A])
"""BaseCommand ``type`` (field 1) = MESSAGE, then the tag of ``message`` (9)."""


def _message_id(ledger_id: int, entry_id: int, partition: int = -1) -> bytes:
    data = b"\x08" + varint(ledger_id & U64) + b"\x10" + varint(entry_id & U64)
    if partition != -1:
        data += b"\x18" + varint(partition & U64)  # int32: negative values sign-extend
    return data


def encode_send_receipt(
    producer_id: int,
    sequence_id: int,
    ledger_id: int,
    entry_id: int,
    highest_sequence_id: int | None = None,
) -> bytes:
    """A whole SEND_RECEIPT frame, as ``encode_command(commands.send_receipt(...))``.

    >>> from anabranch.protocol import commands
    >>> from anabranch.protocol.frames import encode_command
    >>> encode_send_receipt(1, 2, 3, 4, 5) == encode_command(commands.send_receipt(1, 2, 3, 4, 5))
    True
    """
    message_id = _message_id(ledger_id, entry_id)
    body = (
        b"\x08"
        + varint(producer_id)
        + b"\x10"
        + varint(sequence_id)
        + b"\x1a"
        + varint(len(message_id))
        + message_id
    )
    if highest_sequence_id is not None:
        body += b"\x20" + varint(highest_sequence_id & U64)
    command = _RECEIPT_HEAD + varint(len(body)) + body
    size = len(command)
    return _PACK_U32(size + 4) + _PACK_U32(size) + command


def encode_message_head(  # noqa: PLR0917 (the wire fields, in order)
    consumer_id: int,
    ledger_id: int,
    entry_id: int,
    partition: int,
    redelivery_count: int,
    consumer_epoch: int,
    entry_size: int,
) -> bytes:
    """The bytes of a MESSAGE frame before its stored entry of ``entry_size`` bytes (no
    ``ack_set``), as ``encode_entry_frame`` writes them for the same ``CommandMessage``: a
    sender writes the two parts one after the other, without joining a copy of the entry.

    >>> from anabranch.protocol.frames import decode_frame
    >>> from anabranch.protocol.frames import encode_entry
    >>> md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=2)
    >>> entry = encode_entry(md, b"hi")
    >>> frame = decode_frame((encode_message_head(5, 3, 9, -1, 0, 0, len(entry)) + entry)[4:])
    >>> (frame.command.message.consumer_id, frame.command.message.message_id.entryId, frame.payload)
    (5, 9, b'hi')
    """
    message_id = _message_id(ledger_id, entry_id, partition)
    body = b"\x08" + varint(consumer_id) + b"\x12" + varint(len(message_id)) + message_id
    if redelivery_count:
        body += b"\x18" + varint(redelivery_count)
    if consumer_epoch:
        body += b"\x28" + varint(consumer_epoch)
    command = _MESSAGE_HEAD + varint(len(body)) + body
    size = len(command)
    return _PACK_U32(size + 4 + entry_size) + _PACK_U32(size) + command

"""The transaction id inside a stored entry's MessageMetadata.

A transactional entry carries its TxnID in ``txnid_most_bits`` (field 23) and
``txnid_least_bits`` (field 22) of its MessageMetadata, as upstream's entries do. The
transaction buffer stamps every entry it appends for a transaction, so a restarted
broker can find a transaction's entries by reading the ledger after the op record's
``first_after`` (the positions themselves are only kept in memory).

Entries are the message section of a SEND (``protocol/frames.py``):
``([0x0e01][crc32c])? [metadataSize][MessageMetadata][payload]``; the checksum, when
present, covers everything after it and is recomputed when the metadata changes.

A batch transaction's entry also names its **branch** (the task attempt that wrote it)
in the reserved property ``__txn_branch`` of its MessageMetadata; a batched entry carries
it in the batch's own metadata (our producer never mixes branches in one batch).

Example:
    >>> from anabranch.protocol.frames import encode_entry
    >>> entry = encode_entry(pb.MessageMetadata(producer_name="p", sequence_id=0,
    ...                                         publish_time=0), b"x")
    >>> entry_txn(entry) is None
    True
    >>> stamped = stamp_txn(entry, TxnId(2, 9))
    >>> entry_txn(stamped)
    TxnId(most_bits=2, least_bits=9)
    >>> stamp_txn(stamped, TxnId(2, 9)) is stamped
    True
    >>> md = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=0)
    >>> _ = md.properties.add(key=BRANCH_PROPERTY, value="3-a")
    >>> stamped, branch = stamp_txn_branch(encode_entry(md, b"x"), TxnId(2, 9))
    >>> branch, entry_txn_branch(stamped)
    ('3-a', (TxnId(most_bits=2, least_bits=9), '3-a'))
"""

from __future__ import annotations

import struct

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from anabranch import limits
from anabranch.core.txn_id import BRANCH_PROPERTY, TxnId
from anabranch.errors import InvalidArgument, MalformedFrame
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import MAGIC_CHECKSUM, encode_entry

_U16 = struct.Struct(">H")
_I32 = struct.Struct(">i")


def _split(entry: bytes) -> tuple[bool, pb.MessageMetadata, bytes]:
    """(has checksum, metadata, payload) of an entry; MalformedFrame if it is not one."""
    checksum = len(entry) >= 6 and _U16.unpack_from(entry, 0)[0] == MAGIC_CHECKSUM
    offset = 6 if checksum else 0
    if len(entry) < offset + 4:
        raise MalformedFrame("entry too short for its metadata size")
    (size,) = _I32.unpack_from(entry, offset)
    if size < 0 or offset + 4 + size > len(entry):
        raise MalformedFrame(f"metadata size {size} does not fit the entry")
    metadata = pb.MessageMetadata()
    try:
        metadata.ParseFromString(entry[offset + 4 : offset + 4 + size])
    except DecodeError as err:
        raise MalformedFrame(f"entry metadata does not parse: {err}") from err
    return checksum, metadata, entry[offset + 4 + size :]


def entry_txn(entry: bytes) -> TxnId | None:
    """The transaction an entry was written in, or None (also for unparsable bytes: the
    recovery scan must not stop at a foreign entry)."""
    try:
        _, metadata, _ = _split(entry)
    except MalformedFrame:
        return None
    if not (metadata.HasField("txnid_most_bits") or metadata.HasField("txnid_least_bits")):
        return None
    return TxnId(metadata.txnid_most_bits, metadata.txnid_least_bits)


def _branch(metadata: pb.MessageMetadata) -> str | None:
    for prop in metadata.properties:
        if prop.key == BRANCH_PROPERTY:
            return str(prop.value)
    return None


def entry_txn_branch(entry: bytes) -> tuple[TxnId | None, str | None]:
    """The transaction and branch an entry was written in (None for either when absent or
    unparsable: the recovery scan must not stop at a foreign entry)."""
    try:
        _, metadata, _ = _split(entry)
    except MalformedFrame:
        return None, None
    if not (metadata.HasField("txnid_most_bits") or metadata.HasField("txnid_least_bits")):
        return None, _branch(metadata)
    return TxnId(metadata.txnid_most_bits, metadata.txnid_least_bits), _branch(metadata)


def stamp_txn_branch(entry: bytes, txn: TxnId) -> tuple[bytes, str | None]:
    """:func:`stamp_txn` plus the entry's branch (one parse); InvalidArgument when the
    branch is longer than ``TXN_BRANCH_ID_BYTES_MAX``."""
    checksum, metadata, payload = _split(entry)
    branch = _branch(metadata)
    if branch is not None and len(branch.encode()) > limits.TXN_BRANCH_ID_BYTES_MAX:
        raise InvalidArgument(
            f"branch id of {len(branch.encode())} bytes is over {limits.TXN_BRANCH_ID_BYTES_MAX}"
        )
    if (
        metadata.HasField("txnid_most_bits")
        and metadata.HasField("txnid_least_bits")
        and (metadata.txnid_most_bits, metadata.txnid_least_bits) == txn
    ):
        return entry, branch
    metadata.txnid_most_bits = txn.most_bits
    metadata.txnid_least_bits = txn.least_bits
    return encode_entry(metadata, payload, checksum=checksum), branch


def stamp_txn(entry: bytes, txn: TxnId) -> bytes:
    """``entry`` with its metadata naming ``txn`` (the same object when it already does).

    The broker's TxnID (from the SEND command) wins over one the client put in the
    metadata. MalformedFrame if ``entry`` is not an encoded message section.
    """
    checksum, metadata, payload = _split(entry)
    if (
        metadata.HasField("txnid_most_bits")
        and metadata.HasField("txnid_least_bits")
        and (metadata.txnid_most_bits, metadata.txnid_least_bits) == txn
    ):
        return entry
    metadata.txnid_most_bits = txn.most_bits
    metadata.txnid_least_bits = txn.least_bits
    return encode_entry(metadata, payload, checksum=checksum)

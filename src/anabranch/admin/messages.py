"""Looking at and expiring stored messages: pulsar-admin's peek, examine, get-by-id and
expire, over a persistent topic's managed ledger.

A stored entry answers as upstream's admin API does: the body is the entry's payload,
decompressed (a batch stays one body: ``X-Pulsar-num-batch-message`` says how many
messages it holds and :func:`split_batch` splits it), and the message metadata travels in
``X-Pulsar-*`` headers (``X-Pulsar-Message-ID: ledger:entry``, ``X-Pulsar-publish-time``,
``X-Pulsar-PROPERTY-<key>``, ...).

Positions counted by peek and examine are entries, as upstream counts them: a batch is one.

Example:
    >>> md = pb.MessageMetadata(producer_name="p", sequence_id=4, publish_time=1_700_000_000_000)
    >>> _ = md.properties.add(key="k", value="v")
    >>> headers = entry_headers(Position(3, 9), md)
    >>> headers["X-Pulsar-Message-ID"], headers["X-Pulsar-PROPERTY-k"]
    ('3:9', 'v')
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from anabranch import limits
from anabranch.broker.dispatcher_entries import find_by_publish_time
from anabranch.errors import InvalidArgument, InvalidMessage, NotFound
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.batch import decode_batch
from anabranch.protocol.compression import decompress
from anabranch.protocol.frames import MAGIC_CHECKSUM
from anabranch.storage.api import EARLIEST, Entry, ManagedLedger, Position

if TYPE_CHECKING:
    from anabranch.broker.topic import PersistentTopic

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

POSITION_MAX = 1_000_000
"""The deepest peek/examine position served: each step may read an entry."""
SCAN_BATCH_ENTRIES = 256


class StoredMessage(NamedTuple):
    """An entry split into its metadata and decompressed payload."""

    position: Position
    metadata: pb.MessageMetadata
    payload: bytes


def split_entry(entry: Entry) -> StoredMessage:
    """Metadata and decompressed payload of a stored entry; InvalidMessage if damaged.

    Example:
        >>> from anabranch.protocol.frames import encode_entry
        >>> md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=7)
        >>> split_entry(Entry(Position(1, 2), encode_entry(md, b"hi"))).payload
        b'hi'
    """
    data = entry.data
    try:
        offset = 6 if len(data) >= 2 and _U16.unpack_from(data, 0)[0] == MAGIC_CHECKSUM else 0
        (size,) = _U32.unpack_from(data, offset)
        start = offset + 4
        if size > len(data) - start:
            raise InvalidMessage(f"entry {entry.position}: metadata does not fit")
        metadata = pb.MessageMetadata()
        metadata.ParseFromString(data[start : start + size])
    except (struct.error, DecodeError) as err:
        raise InvalidMessage(f"entry {entry.position}: unreadable metadata ({err})") from None
    payload = data[start + size :]
    if metadata.compression != pb.NONE:
        payload = decompress(
            int(metadata.compression), payload, metadata.uncompressed_size,
            limits.MESSAGE_SIZE_CAP_BYTES,
        )  # fmt: skip
    return StoredMessage(entry.position, metadata, payload)


def split_batch(message: StoredMessage) -> list[tuple[pb.SingleMessageMetadata | None, bytes]]:
    """The messages of an entry: one (None, payload) for a non-batched entry."""
    if not message.metadata.HasField("num_messages_in_batch"):
        return [(None, message.payload)]
    singles = decode_batch(message.payload, message.metadata.num_messages_in_batch)
    return [(single, payload) for single, payload in singles]


def _time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def entry_headers(position: Position, md: pb.MessageMetadata) -> dict[str, str]:
    """Upstream's ``X-Pulsar-*`` response headers of a stored message."""
    headers = {
        "X-Pulsar-Message-ID": f"{position.ledger_id}:{position.entry_id}",
        "X-Pulsar-publish-time": _time(md.publish_time),
        "X-Pulsar-producer-name": md.producer_name,
        "X-Pulsar-sequence-id": str(md.sequence_id),
    }
    for prop in md.properties:
        # Header values must be one line; a property that is not cannot be a header.
        if "\n" not in prop.key + prop.value and "\r" not in prop.key + prop.value:
            headers[f"X-Pulsar-PROPERTY-{prop.key}"] = prop.value
    if md.HasField("partition_key"):
        headers["X-Pulsar-partition-key"] = md.partition_key.replace("\n", " ")
        headers["X-Pulsar-Base64-encoded-keys"] = str(md.partition_key_b64_encoded).lower()
    if md.HasField("ordering_key"):
        headers["X-Pulsar-ordering-key"] = base64.b64encode(md.ordering_key).decode()
    if md.HasField("event_time"):
        headers["X-Pulsar-event-time"] = _time(md.event_time)
    if md.HasField("num_messages_in_batch"):
        headers["X-Pulsar-num-batch-message"] = str(md.num_messages_in_batch)
    if md.HasField("null_value"):
        headers["X-Pulsar-null-value"] = str(md.null_value).lower()
    if md.HasField("schema_version"):
        headers["X-Pulsar-schema-version"] = base64.b64encode(md.schema_version).decode()
    if md.HasField("uncompressed_size"):
        headers["X-Pulsar-uncompressed-size"] = str(md.uncompressed_size)
    if md.HasField("txnid_most_bits"):
        headers["X-Pulsar-txn-uncommitted"] = "true"
    return headers


def _check_position(n: int) -> None:
    if n < 1 or n > POSITION_MAX:
        raise InvalidArgument(f"message position {n} is outside [1, {POSITION_MAX}]")


async def read_at(ledger: ManagedLedger, position: Position) -> Entry:
    """The entry at ``position``; NotFound when the ledger has none there."""
    if position.ledger_id < 0 or position.entry_id < 0 or position > ledger.last_confirmed:
        raise NotFound(f"message {position.ledger_id}:{position.entry_id}")
    entries = await ledger.read(position, max_entries=1)
    if not entries or entries[0].position != position:
        raise NotFound(f"message {position.ledger_id}:{position.entry_id}")
    return entries[0]


async def nth_unacknowledged(topic: PersistentTopic, subscription: str, n: int) -> Entry:
    """The ``n``-th (1-based) entry of a subscription's backlog (upstream's peek)."""
    _check_position(n)
    cursor = next((c for c in topic.ledger.cursors() if c.name == subscription), None)
    if cursor is None:
        raise NotFound(f"subscription {subscription} on {topic.name}")
    seen = 0
    start = cursor.read_position
    while True:
        entries = await topic.ledger.read(start, max_entries=SCAN_BATCH_ENTRIES)
        if not entries:
            raise NotFound(f"{topic.name}/{subscription} has fewer than {n} messages to peek")
        for entry in entries:
            if not cursor.is_acknowledged(entry.position):
                seen += 1
                if seen == n:
                    return entry
        start = entries[-1].position.next()


def _spans(ledger: ManagedLedger) -> list[tuple[int, int]]:
    infos = getattr(ledger, "ledgers", None) or ()
    return [(i.ledger_id, i.entries) for i in infos if i.entries > 0]


async def nth_from(ledger: ManagedLedger, initial: str, n: int) -> Entry:
    """The ``n``-th entry from the earliest or the latest retained one (examine)."""
    _check_position(n)
    if initial not in ("earliest", "latest"):
        raise InvalidArgument(f"initialPosition {initial!r}: earliest or latest")
    spans = _spans(ledger)
    if spans:
        total = sum(count for _, count in spans)
        if n > total:
            raise NotFound(f"the topic holds {total} entries, fewer than {n}")
        index = n - 1 if initial == "earliest" else total - n
        for ledger_id, count in spans:
            if index < count:
                return await read_at(ledger, Position(ledger_id, index))
            index -= count
    # A backend without a ledger list: scan forward (bounded by POSITION_MAX).
    window: list[Entry] = []
    start = EARLIEST
    while True:
        entries = await ledger.read(start, max_entries=SCAN_BATCH_ENTRIES)
        if not entries:
            break
        if initial == "earliest" and len(window) + len(entries) >= n:
            return entries[n - len(window) - 1]
        window = (window + entries)[-n:] if initial == "latest" else window + entries
        start = entries[-1].position.next()
    if initial == "latest" and len(window) >= n:
        return window[-n]
    raise NotFound(f"the topic holds fewer than {n} entries")


async def expire(topic: PersistentTopic, subscription: str, older_than_ms: int) -> bool:
    """Acknowledge every message of ``subscription`` published before ``older_than_ms``
    (never moves the cursor back); whether anything was acknowledged."""
    sub = topic.subscriptions.get(subscription)
    cursor = next((c for c in topic.ledger.cursors() if c.name == subscription), None)
    if sub is None or cursor is None:
        raise NotFound(f"subscription {subscription} on {topic.name}")
    first_kept = await find_by_publish_time(topic.ledger, older_than_ms)
    if first_kept <= cursor.read_position:
        return False
    expired: list[Position] = []
    start = cursor.read_position
    while start < first_kept:
        entries = await topic.ledger.read(start, max_entries=SCAN_BATCH_ENTRIES)
        chosen = [e.position for e in entries if e.position < first_kept]
        expired.extend(p for p in chosen if not cursor.is_acknowledged(p))
        if not entries or len(chosen) < len(entries):
            break
        start = entries[-1].position.next()
        if len(expired) >= SCAN_BATCH_ENTRIES:
            await cursor.acknowledge(expired)
            expired = []
    if expired:
        await cursor.acknowledge(expired)
    return True


def decode_peeked(headers: Mapping[str, str], body: bytes) -> list[dict[str, Any]]:
    """What a peek/examine/get-by-id answer holds, one dict per message (a batch split):
    ``messageId``, ``publishTime``, ``producerName``, ``key``, ``properties``, ``payload``.

    Example:
        >>> [m] = decode_peeked({"X-Pulsar-Message-ID": "3:9", "X-Pulsar-PROPERTY-a": "b"}, b"hi")
        >>> m["messageId"], m["properties"], m["payload"]
        ('3:9', {'a': 'b'}, b'hi')
    """
    lower = {k.lower(): v for k, v in headers.items()}
    message_id = lower.get("x-pulsar-message-id", "")
    properties = {
        k[len("X-Pulsar-PROPERTY-") :]: v
        for k, v in headers.items()
        if k.lower().startswith("x-pulsar-property-")
    }
    common = {
        "publishTime": lower.get("x-pulsar-publish-time"),
        "producerName": lower.get("x-pulsar-producer-name"),
    }
    count = lower.get("x-pulsar-num-batch-message")
    if count is None:
        key = lower.get("x-pulsar-partition-key")
        return [{"messageId": message_id, **common, "key": key, "properties": properties,
                 "payload": body}]  # fmt: skip
    out = []
    for index, (single, payload) in enumerate(decode_batch(body, int(count))):
        props = {p.key: p.value for p in single.properties}
        key = single.partition_key if single.HasField("partition_key") else None
        out.append({"messageId": f"{message_id}:{index}", **common, "key": key,
                    "properties": props, "payload": payload})  # fmt: skip
    return out

"""The key slots of a batch entry: how a broker routes a mixed-key batch by key without
opening it (PIP-460 "Message Entry Format: Batch Routing and Key_Shared-style Dispatch").

A Pulsar batch entry carries one MessageMetadata for all its messages; the keys are in the
per-message SingleMessageMetadata inside the (possibly compressed) payload. Upstream's
Key_Shared therefore asks producers for ``BatcherBuilder.KEY_BASED`` (one key per batch);
anything else routes the whole batch by its outer key (none: ``NONE_KEY``), which sends a
key's batched messages to another consumer than its single ones and breaks per-key order.

Here a producer that batches messages of several keys writes the batch's distinct
Key_Shared slots into one property of the *outer* metadata, ``__key_slots``: 4 hex digits
per slot, sorted. The broker already parses that metadata for every dispatch, so reading
the slots costs no decompression, no payload parse and no hashing. Key_Shared dispatch
treats such an entry as holding *all* of its slots: it goes to one consumer only while no
other consumer holds unacknowledged messages of any of them, and until it is acknowledged
its slots stay with that consumer (the "draining hashes" rule of
``broker/dispatcher_key_shared``). A key's messages thus never overtake each other, with
no producer-side key-based batching and no re-encoding; the price is that a mixed batch
pins its keys to one consumer until it is acknowledged.

Example:
    >>> value = encode_key_slots([b"a", b"b", b"a"])
    >>> decode_key_slots(value) == tuple(sorted({key_slot(b"a"), key_slot(b"b")}))
    True
    >>> encode_key_slots([b"a", b"a"]) is None   # one key: the outer key routes it
    True
"""

from __future__ import annotations

from collections.abc import Iterable

import mmh3

KEY_SLOTS_PROPERTY = "__key_slots"
"""Outer-metadata property of a mixed-key batch: its distinct slots, 4 hex digits each."""

HASH_SLOTS = 65536
"""Key_Shared hash slots (upstream ``StickyKeyConsumerSelector.DEFAULT_RANGE_SIZE``)."""

NONE_KEY = b"NONE_KEY"
"""The sticky key of a message without ordering or partition key (upstream's NONE_KEY)."""

KEY_SLOTS_MAX = 4096
"""Slots read from one entry's property (a batch holds at most this many messages here)."""


def key_slot(key: bytes) -> int:
    """Key_Shared slot: ``(Murmur3_32(key) & 0x7fffffff) % 65536`` as upstream.

    >>> key_slot(b"hello") == (0x248bfa47 & 0x7fffffff) % 65536
    True
    """
    return (mmh3.hash(key, 0, signed=False) & 0x7FFFFFFF) % HASH_SLOTS


def encode_key_slots(keys: Iterable[bytes]) -> str | None:
    """The ``__key_slots`` value of a batch with these sticky keys (None: one key only)."""
    slots = sorted({key_slot(k) for k in set(keys)})
    if len(slots) <= 1:
        return None
    return "".join(f"{s:04x}" for s in slots)


def decode_key_slots(value: str) -> tuple[int, ...]:
    """The slots of a ``__key_slots`` value; () if it is malformed (a producer's bytes must
    not break dispatch: the entry is then routed by its outer key, as upstream does).

    >>> decode_key_slots("0001ffff"), decode_key_slots("xyz")
    ((1, 65535), ())
    """
    if len(value) % 4 or len(value) > 4 * KEY_SLOTS_MAX:
        return ()
    try:
        return tuple(sorted({int(value[i : i + 4], 16) for i in range(0, len(value), 4)}))
    except ValueError:
        return ()


__all__ = [
    "HASH_SLOTS",
    "KEY_SLOTS_MAX",
    "KEY_SLOTS_PROPERTY",
    "NONE_KEY",
    "decode_key_slots",
    "encode_key_slots",
    "key_slot",
]

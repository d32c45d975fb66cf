"""The key slots of a batch entry: how a broker routes a mixed-key batch by key without
opening it (PIP-460 "Message Entry Format: Batch Routing and Key_Shared-style Dispatch").

A Pulsar batch entry carries one MessageMetadata for all its messages; the keys are in the
per-message SingleMessageMetadata inside the (possibly compressed) payload. Upstream's
Key_Shared therefore asks producers for ``BatcherBuilder.KEY_BASED`` (one key per batch);
anything else routes the whole batch by its outer key (none: ``NONE_KEY``), which sends a
key's batched messages to another consumer than its single ones and breaks per-key order.

Here a producer that batches messages of several keys writes each message's Key_Shared
slot into one property of the *outer* metadata, ``__key_slots``: 4 hex digits per message,
in batch order. The broker already parses that metadata for every dispatch, so reading the
slots costs no decompression, no payload parse and no hashing. Key_Shared dispatch then
splits the entry by consumer (``broker/dispatcher_key_shared``): every consumer that owns
some of its slots gets the same stored bytes with an ``ack_set`` that leaves only its own
messages unacknowledged (the wire's batch-index mechanism: the client skips the others), so
nothing is re-encoded and no producer-side key-based batching is needed. Each part obeys
the per-key ordering rule on its own slots; a consumer's ack of its part acknowledges only
its indexes, and the entry is acknowledged once every part is.

Example:
    >>> value = encode_key_slots([b"a", b"b", b"a"])
    >>> decode_key_slots(value, 3) == (key_slot(b"a"), key_slot(b"b"), key_slot(b"a"))
    True
    >>> encode_key_slots([b"a", b"a"]) is None   # one key: the outer key routes it
    True
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import mmh3

KEY_SLOTS_PROPERTY = "__key_slots"
"""Outer-metadata property of a mixed-key batch: each message's slot, 4 hex digits each."""

HASH_SLOTS = 65536
"""Key_Shared hash slots (upstream ``StickyKeyConsumerSelector.DEFAULT_RANGE_SIZE``)."""

NONE_KEY = b"NONE_KEY"
"""The sticky key of a message without ordering or partition key (upstream's NONE_KEY)."""


def key_slot(key: bytes) -> int:
    """Key_Shared slot: ``(Murmur3_32(key) & 0x7fffffff) % 65536`` as upstream.

    >>> key_slot(b"hello") == (0x248bfa47 & 0x7fffffff) % 65536
    True
    """
    return (mmh3.hash(key, 0, signed=False) & 0x7FFFFFFF) % HASH_SLOTS


def encode_key_slots(keys: Iterable[bytes]) -> str | None:
    """The ``__key_slots`` value of a batch whose messages have these sticky keys, in
    order (None when they are all one slot: the outer key routes the entry)."""
    memo: dict[bytes, int] = {}
    slots = [memo[k] if k in memo else memo.setdefault(k, key_slot(k)) for k in keys]
    if len(set(slots)) <= 1:
        return None
    return "".join(f"{s:04x}" for s in slots)


def decode_key_slots(value: str, count: int) -> tuple[int, ...]:
    """Each message's slot from a ``__key_slots`` value of a ``count``-message batch; ()
    if it is malformed or of another length (a producer's bytes must not break dispatch:
    the entry is then routed whole by its outer key, as upstream does).

    >>> decode_key_slots("0001ffff", 2), decode_key_slots("0001ffff", 3)
    ((1, 65535), ())
    >>> decode_key_slots("xyz!", 1), decode_key_slots(" 0001", 1)
    ((), ())
    """
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        return ()
    if len(raw) != 2 * count or len(value) != 4 * count:
        return ()
    return struct.unpack(f">{count}H", raw)


__all__ = [
    "HASH_SLOTS",
    "KEY_SLOTS_PROPERTY",
    "NONE_KEY",
    "decode_key_slots",
    "encode_key_slots",
    "key_slot",
]

"""What the scalable-topic controller needs from the data plane, and one implementation.

The controller never touches a managed ledger itself: it creates, seals, inspects and
deletes segment topics through :class:`SegmentOps` (upstream routes these calls through
the Segments admin API to whichever broker owns the segment). Every method is idempotent,
because a new leader re-runs the steps of a split or merge that a previous leader left
half done.

:class:`StorageSegmentOps` implements it directly over a
:class:`~anabranch.storage.api.ManagedLedgerFactory`: a segment's managed ledger has the
same name the broker gives it (:func:`segment_ledger_name`), subscriptions are its
cursors, sealing is ``terminate()``. It is honest about dedup: the snapshot it returns is
rebuilt from the sealed ledger's entries (the last sequence id each producer persisted).
What it cannot do is close producers attached to a broker's topic of the segment; the
broker's own implementation, which seals through its ``PersistentTopic``, replaces it.

Example:
    >>> from anabranch.core.names import HashRange, TopicName
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo(ops: SegmentOps, segment: SegmentName) -> None:
    ...     await ops.create_segment(segment, ["billing"])
    ...     snapshot = await ops.terminate_segment(segment)   # JSON {"producer": last_seq}
    ...     assert await ops.segment_subscriptions(segment) == ["billing"]
    ...     print(snapshot, await ops.segment_backlog(segment, "billing"))
    >>> async def main() -> None:
    ...     topic = TopicName.parse("topic://public/default/orders")
    ...     ops = StorageSegmentOps(MemoryManagedLedgerFactory())
    ...     await demo(ops, SegmentName(topic, HashRange(0, 0xFFFF), 0))
    ...     await ops.close()
    >>> asyncio.run(main())
    b'{}' 0
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from anabranch.core.names import SegmentName
from anabranch.errors import LedgerFenced
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import MAGIC_CHECKSUM
from anabranch.storage.api import EARLIEST, ManagedLedger, ManagedLedgerFactory

log = logging.getLogger(__name__)

_U16 = struct.Struct(">H")
_I32 = struct.Struct(">i")
_REPLAY_BATCH_ENTRIES = 1000
"""Entries read per call while rebuilding a sealed segment's dedup snapshot."""


@dataclass(frozen=True, slots=True)
class SegmentLoad:
    """A segment's load as its owner counts it: cumulative messages and bytes in and out
    since its topic was loaded (plain counters the data path already keeps), and the
    backlog of its slowest subscription. The autoscaler turns readings into rates.

    Example:
        >>> SegmentLoad.from_dict(SegmentLoad(1, 2, 3, 4, 5).to_dict())
        SegmentLoad(msg_in=1, bytes_in=2, msg_out=3, bytes_out=4, backlog=5)
    """

    msg_in: int = 0
    bytes_in: int = 0
    msg_out: int = 0
    bytes_out: int = 0
    backlog: int = 0

    def counters(self) -> tuple[int, int, int, int]:
        """The cumulative counters, in and out."""
        return (self.msg_in, self.bytes_in, self.msg_out, self.bytes_out)

    def to_dict(self) -> dict[str, int]:
        """The JSON form owners answer the controller with."""
        return {
            "msgInCounter": self.msg_in,
            "bytesInCounter": self.bytes_in,
            "msgOutCounter": self.msg_out,
            "bytesOutCounter": self.bytes_out,
            "backlog": self.backlog,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> SegmentLoad:
        """Inverse of :meth:`to_dict` (missing values are 0)."""
        return cls(
            int(doc.get("msgInCounter", 0)),
            int(doc.get("bytesInCounter", 0)),
            int(doc.get("msgOutCounter", 0)),
            int(doc.get("bytesOutCounter", 0)),
            int(doc.get("backlog", 0)),
        )


class SegmentOps(Protocol):
    """Segment-topic lifecycle as the controller sees it; every method is idempotent."""

    async def create_segment(self, segment: SegmentName, subscriptions: list[str]) -> None:
        """Create the segment's topic (if absent) with a cursor at EARLIEST for each of
        ``subscriptions`` (existing cursors are left where they are)."""
        ...

    async def terminate_segment(self, segment: SegmentName) -> bytes:
        """Seal the segment (later appends fail) and return its dedup snapshot: JSON
        ``{producer_name: last_persisted_sequence_id}``."""
        ...

    async def seed_dedup(self, segment: SegmentName, parent_snapshots: list[bytes]) -> None:
        """A split/merge child, before the layout names it: reject sequence ids its parents
        persisted (``parent_snapshots`` as :meth:`terminate_segment` returned them)."""
        ...

    async def segment_subscriptions(self, segment: SegmentName) -> list[str]:
        """Sorted names of the segment's subscriptions (its cursors)."""
        ...

    async def segment_backlog(self, segment: SegmentName, subscription: str) -> int:
        """Unacknowledged entries of ``subscription`` on the segment (0 without a cursor).

        A 0 answer for an existing cursor means that cursor is durable (flushed) as it is:
        the controller hands a drained parent's children out on it."""
        ...

    async def remove_subscription(self, segment: SegmentName, subscription: str) -> None:
        """Delete the subscription's cursor on the segment, if any."""
        ...

    async def segment_load(self, segment: SegmentName) -> SegmentLoad:
        """The segment's load counters on its owner (zeros while nobody has it loaded)."""
        ...

    async def delete_segment(self, segment: SegmentName) -> None:
        """Delete the segment's topic, data and cursors (nothing if absent)."""
        ...


def segment_ledger_name(segment: SegmentName) -> str:
    """The managed ledger of a segment topic: the broker's naming, so both open the same one.

    Example:
        >>> segment_ledger_name(SegmentName.parse("segment://public/default/orders/0000-7fff-1"))
        'public/default/segment/orders/0000-7fff-1'
    """
    topic = segment.topic
    return f"{topic.tenant}/{topic.namespace}/segment/{topic.local_name}/{segment.descriptor}"


def dedup_snapshot_from_entry(entry: bytes, into: dict[str, int]) -> None:
    """Fold one stored entry's (producer name, last sequence id) into ``into``.

    A stored entry is ``[0x0e01][crc32c]`` (optional) ``[metadataSize][MessageMetadata]
    [payload]``; a batch covers ``sequence_id .. sequence_id + count - 1`` (or up to
    ``highest_sequence_id``). Entries without parsable metadata are skipped: they carry
    no producer to deduplicate.

    Example:
        >>> from anabranch.protocol.frames import encode_entry
        >>> md = pb.MessageMetadata(producer_name="p", sequence_id=4, publish_time=0,
        ...                         num_messages_in_batch=3)
        >>> marks: dict[str, int] = {}
        >>> dedup_snapshot_from_entry(encode_entry(md, b"x"), marks); marks
        {'p': 6}
    """
    try:
        offset = 6 if len(entry) >= 6 and _U16.unpack_from(entry, 0)[0] == MAGIC_CHECKSUM else 0
        (size,) = _I32.unpack_from(entry, offset)
        metadata = pb.MessageMetadata()
        metadata.ParseFromString(entry[offset + 4 : offset + 4 + size])
    except (struct.error, ValueError, DecodeError) as err:
        log.debug("entry without metadata skipped in dedup replay: %s", err)
        return
    if not metadata.producer_name:
        return
    last = metadata.sequence_id + max(metadata.num_messages_in_batch, 1) - 1
    if metadata.HasField("highest_sequence_id"):
        last = max(last, metadata.highest_sequence_id)
    into[metadata.producer_name] = max(into.get(metadata.producer_name, -1), last)


class StorageSegmentOps:
    """:class:`SegmentOps` straight over managed ledgers (one broker, or tests).

    Ledgers are opened once and kept open (opening fences the previous owner, so reopening
    per call would fence ourselves); :meth:`close` closes them.

    Example:
        >>> from anabranch.core.names import HashRange, TopicName
        >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
        >>> async def demo(factory: ManagedLedgerFactory, segment: SegmentName) -> None:
        ...     ops = StorageSegmentOps(factory)
        ...     await ops.create_segment(segment, ["s"])
        ...     print(await ops.segment_subscriptions(segment))
        ...     await ops.close()
        >>> segment = SegmentName(TopicName.parse("topic://t/ns/x"), HashRange(0, 0xFFFF), 0)
        >>> asyncio.run(demo(MemoryManagedLedgerFactory(), segment))
        ['s']
    """

    def __init__(self, ledgers: ManagedLedgerFactory) -> None:
        self._factory = ledgers
        self._open: dict[str, ManagedLedger] = {}
        self._lock = asyncio.Lock()

    async def _ledger(self, segment: SegmentName) -> ManagedLedger:
        name = segment_ledger_name(segment)
        # One lock: two concurrent first opens of a name would fence each other.
        async with self._lock:
            ledger = self._open.get(name)
            if ledger is None:
                ledger = await self._factory.open(name)
                self._open[name] = ledger
            return ledger

    async def _reopened_on_fence(self, segment: SegmentName) -> ManagedLedger:
        """Forget a ledger another owner took over and open it again (taking it back)."""
        name = segment_ledger_name(segment)
        async with self._lock:
            stale = self._open.pop(name, None)
        if stale is not None:
            await stale.close()
        return await self._ledger(segment)

    async def create_segment(self, segment: SegmentName, subscriptions: list[str]) -> None:
        ledger = await self._ledger(segment)
        for name in subscriptions:
            cursor = await ledger.open_cursor(name, EARLIEST)
            try:
                await cursor.flush()  # the cursor must survive a crash right after this step
            except LedgerFenced:
                ledger = await self._reopened_on_fence(segment)
                await (await ledger.open_cursor(name, EARLIEST)).flush()

    async def terminate_segment(self, segment: SegmentName) -> bytes:
        ledger = await self._ledger(segment)
        try:
            await ledger.terminate()
        except LedgerFenced:
            ledger = await self._reopened_on_fence(segment)
            await ledger.terminate()
        marks: dict[str, int] = {}
        position = EARLIEST
        while entries := await ledger.read(position, max_entries=_REPLAY_BATCH_ENTRIES):
            for entry in entries:
                dedup_snapshot_from_entry(entry.data, marks)
            position = entries[-1].position.next()
        return encode_dedup_snapshot(marks)

    async def seed_dedup(self, segment: SegmentName, parent_snapshots: list[bytes]) -> None:
        # No topic lives here: a broker seeds a child from ``.../sealed/{id}`` when it loads.
        return None

    async def segment_subscriptions(self, segment: SegmentName) -> list[str]:
        ledger = await self._ledger(segment)
        return sorted(c.name for c in ledger.cursors())

    async def segment_backlog(self, segment: SegmentName, subscription: str) -> int:
        ledger = await self._ledger(segment)
        for cursor in ledger.cursors():
            if cursor.name == subscription:
                backlog = cursor.backlog()
                if backlog == 0:
                    await cursor.flush()  # the contract: drained means durably drained
                return backlog
        return 0

    async def segment_load(self, segment: SegmentName) -> SegmentLoad:
        # No topic counts traffic here; only the backlog is known.
        ledger = await self._ledger(segment)
        return SegmentLoad(backlog=max((c.backlog() for c in ledger.cursors()), default=0))

    async def remove_subscription(self, segment: SegmentName, subscription: str) -> None:
        ledger = await self._ledger(segment)
        if any(c.name == subscription for c in ledger.cursors()):
            await ledger.delete_cursor(subscription)

    async def delete_segment(self, segment: SegmentName) -> None:
        ledger = await self._ledger(segment)
        async with self._lock:
            self._open.pop(segment_ledger_name(segment), None)
        await ledger.delete()

    async def close(self) -> None:
        """Close every ledger this object opened. Idempotent."""
        async with self._lock:
            ledgers, self._open = list(self._open.values()), {}
        for ledger in ledgers:
            await ledger.close()


def encode_dedup_snapshot(marks: Mapping[str, int]) -> bytes:
    """The snapshot wire form: sorted JSON ``{producer: last_sequence_id}``.

    >>> encode_dedup_snapshot({"b": 2, "a": 1})
    b'{"a": 1, "b": 2}'
    """
    return json.dumps(dict(sorted(marks.items()))).encode()


def decode_dedup_snapshot(data: bytes) -> dict[str, int]:
    """Inverse of :func:`encode_dedup_snapshot`.

    >>> decode_dedup_snapshot(b'{"a": 1}')
    {'a': 1}
    """
    decoded = json.loads(data)
    return {str(k): int(v) for k, v in decoded.items()}

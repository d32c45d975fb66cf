"""The broker's :class:`~anabranch.scalable.segment_ops.SegmentOps`: segment topics through
the topics this broker has loaded.

The controller creates, seals, inspects and deletes segment topics through this object,
so every step acts on the broker's own :class:`~anabranch.broker.topic.PersistentTopic`
(never on a second handle of its managed ledger, which would fence the broker's one):

* ``create_segment`` loads the segment topic and opens each subscription's cursor at
  EARLIEST (existing cursors stay where they are);
* ``terminate_segment`` seals it through the topic: in-flight appends finish, later
  sends fail with ``TopicTerminated``, consumers that read everything get
  ``REACHED_END_OF_TOPIC``; it returns the topic's dedup marks
  ``{producer: last persisted sequence id}`` (``{}`` when deduplication is off);
* ``seed_dedup`` merges the parents' marks into a child before the layout names it;
* backlog, subscriptions, removal and deletion go through the loaded topic.

Example:
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> from anabranch.core.names import HashRange, SegmentName, TopicName
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(service: BrokerService, segment: SegmentName) -> None:
    ...     ops = BrokerSegmentOps(service)
    ...     await ops.create_segment(segment, ["billing"])
    ...     marks = decode_dedup_snapshot(await ops.terminate_segment(segment))
    ...     print(await ops.segment_subscriptions(segment), marks)  # {}: no deduplication
    ...     print(service.loaded_topic(str(segment)).ledger.is_terminated)
    >>> async def main() -> None:
    ...     topic = TopicName.parse("topic://public/default/orders")
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             await demo(broker.service, SegmentName(topic, HashRange(0, 0xFFFF), 0))
    >>> asyncio.run(main())
    ['billing'] {}
    True
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from anabranch import failpoints
from anabranch.broker.retention import COMPACTION_CURSOR
from anabranch.core.names import SegmentName
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.scalable.segment_ops import (
    SegmentLoad,
    decode_dedup_snapshot,
    encode_dedup_snapshot,
)
from anabranch.storage.api import EARLIEST

if TYPE_CHECKING:
    from anabranch.broker.service import BrokerService
    from anabranch.broker.topic import PersistentTopic

log = logging.getLogger(__name__)


class BrokerSegmentOps:
    """:class:`~anabranch.scalable.segment_ops.SegmentOps` over one broker's topics."""

    def __init__(self, service: BrokerService) -> None:
        self.service = service

    async def _topic(self, segment: SegmentName) -> PersistentTopic:
        # Segment topics need no registration: loading one creates it if absent.
        return await self.service.get_topic(str(segment), create=True)

    async def create_segment(self, segment: SegmentName, subscriptions: list[str]) -> None:
        topic = await self._topic(segment)
        for name in subscriptions:
            if name not in topic.subscriptions:
                # The type is the next consumer's (a subscription without consumers takes it).
                await topic.get_or_create_subscription(
                    name, pb.CommandSubscribe.Exclusive, EARLIEST
                )

    async def terminate_segment(self, segment: SegmentName) -> bytes:
        topic = await self._topic(segment)
        await topic.terminate()
        await topic.wait_inflight()  # their dedup marks count: they are in the ledger
        return encode_dedup_snapshot(topic.dedup.snapshot() if topic.dedup is not None else {})

    async def seed_dedup(self, segment: SegmentName, parent_snapshots: list[bytes]) -> None:
        topic = await self._topic(segment)
        topic.seed_dedup([decode_dedup_snapshot(s) for s in parent_snapshots])

    async def segment_subscriptions(self, segment: SegmentName) -> list[str]:
        topic = await self._topic(segment)
        # The compaction cursor is the segment's own, not a subscription of the topic: it
        # must neither spread to children nor keep a drained segment from being pruned.
        return sorted(c.name for c in topic.ledger.cursors() if c.name != COMPACTION_CURSOR)

    async def segment_backlog(self, segment: SegmentName, subscription: str) -> int:
        topic = await self._topic(segment)
        for cursor in topic.ledger.cursors():
            if cursor.name == subscription:
                backlog = cursor.backlog()
                if backlog == 0 and not failpoints.enabled(failpoints.SKIP_PARENT_CURSOR_FLUSH):
                    # A drained sealed parent's children are handed out on this answer: its
                    # cursor must be durable first. Cursors persist lazily; after a failover
                    # a lazily saved one rewinds, and the parent's messages would reach a
                    # consumer after its children's (parent-before-child broken, issue 19).
                    await cursor.flush()
                return backlog
        return 0

    async def segment_load(self, segment: SegmentName) -> SegmentLoad:
        # Only a loaded topic counts: loading one to read zeros would be wasted work.
        topic = self.service.loaded_topic(str(segment))
        if topic is None:
            return SegmentLoad()
        backlog = max((c.backlog() for c in topic.ledger.cursors()), default=0)
        return SegmentLoad(
            topic.msg_in_counter,
            topic.bytes_in_counter,
            topic.msg_out_counter,
            topic.bytes_out_counter,
            backlog,
        )

    async def remove_subscription(self, segment: SegmentName, subscription: str) -> None:
        topic = await self._topic(segment)
        if subscription in topic.subscriptions or any(
            c.name == subscription for c in topic.ledger.cursors()
        ):
            await topic.remove_subscription(subscription)

    async def delete_segment(self, segment: SegmentName) -> None:
        await self._topic(segment)  # load it (creating it if absent) so there is one owner
        await self.service.delete_topic(str(segment))

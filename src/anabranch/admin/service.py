"""The admin operations, free of HTTP: what each admin v2 route does to the broker.

Every method raises :mod:`anabranch.errors` classes for refusals (the HTTP layer maps
them through ``errors.HTTP_STATUS``) and returns plain JSON-able values or msgspec
structs. Topic arguments are full names (``persistent://t/ns/x``); invalid names raise
InvalidArgument before anything is written.

Example:
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(admin: AdminService) -> None:
    ...     await admin.create_partitioned_topic("persistent://public/default/orders", 4)
    ...     assert await admin.list_topics("public/default") == [
    ...         f"persistent://public/default/orders-partition-{i}" for i in range(4)]
    ...     print(await admin.policies.get_partitions("persistent://public/default/orders"))
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             await demo(AdminService(broker.service))
    >>> asyncio.run(main())
    4
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from anabranch.admin.models import LookupData, MessageIdBody
from anabranch.core.names import NamespaceName, SegmentName, TopicDomain, TopicName, parse_name
from anabranch.core.segment_layout import SegmentLayout, segment_is_active, segment_name
from anabranch.errors import (
    AlreadyExists,
    InvalidArgument,
    LedgerFenced,
    NotEmpty,
    NotFound,
    NotLeader,
    NotOwner,
    SegmentActive,
    TransactionCoordinatorNotFound,
    TransactionNotFound,
)
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.scalable.paths import TopicPaths
from anabranch.scalable.segment_ops import SegmentOps, decode_dedup_snapshot
from anabranch.scalable.service import ScalableTopicService, scalable_topic_name
from anabranch.storage.api import EARLIEST, LATEST, Position
from anabranch.transactions.batches import TxnBatches
from anabranch.transactions.buffer import NoTransactionBuffer
from anabranch.transactions.ids import TxnId
from anabranch.transactions.pending_ack import NoPendingAckStore

if TYPE_CHECKING:
    from anabranch.broker.policies import Policies
    from anabranch.broker.service import BrokerService
    from anabranch.broker.topic import PersistentTopic
    from anabranch.storage.api import Cursor
    from anabranch.transactions.coordinator import TransactionCoordinator
    from anabranch.transactions.keys import TransactionKeys

log = logging.getLogger(__name__)

SKIP_READ_BATCH_ENTRIES = 1_000
"""Entries read per step while finding the N unacknowledged entries to skip."""

SLOW_TRANSACTIONS_MAX = 1_000
"""Most transactions one ``slowTransactions`` answer lists (oldest first)."""

TXN_LEAST_BITS_MAX = 2**63 - 1
"""A TxnID half is a signed 64-bit long upstream; ids past it cannot exist."""


def persistent_topic(text: str) -> TopicName:
    """A ``persistent://`` topic name (InvalidArgument otherwise).

    Example:
        >>> str(persistent_topic("persistent://t/ns/x"))
        'persistent://t/ns/x'
    """
    name = TopicName.parse(text)
    if name.domain is not TopicDomain.PERSISTENT:
        raise InvalidArgument(f"{name} is not a persistent:// topic")
    return name


def position_text(position: Position) -> str:
    """Pulsar's ``ledger:entry`` text of a position."""
    return f"{position.ledger_id}:{position.entry_id}"


class AdminService:
    """Admin operations over one broker's :class:`BrokerService`."""

    def __init__(
        self,
        broker: BrokerService,
        http_url: str = "",
        *,
        scalable: ScalableTopicService | None = None,
    ) -> None:
        self.broker = broker
        self.http_url = http_url
        self._scalable = scalable

    async def close(self) -> None:
        """Nothing to release: the scalable-topic service belongs to the broker (or to
        whoever passed it in)."""

    @property
    def policies(self) -> Policies:
        return self.broker.policies

    # --- topics ---------------------------------------------------------------------------

    async def topic_exists(self, name: TopicName) -> bool:
        """Registered in the metadata store or loaded here."""
        if self.broker.loaded_topic(str(name)) is not None:
            return True
        if await self.policies.topic_exists(name):
            return True
        # A partition exists with its partitioned topic even before it is first loaded.
        return name.partition is not None and name.partition < await self.policies.get_partitions(
            name.base
        )

    async def existing_topic(self, text: str) -> PersistentTopic:
        """The loaded persistent topic ``text`` names; NotFound unless it exists (a
        partitioned topic's base name is NotFound too: its partitions are the topics)."""
        return await self._existing_topic(text)

    async def _existing_topic(self, text: str) -> PersistentTopic:
        name = persistent_topic(text)
        if not await self.topic_exists(name):
            if await self.policies.get_partitions(name) > 0:
                raise NotFound(f"{name} is a partitioned topic: address its partitions")
            raise NotFound(f"topic {name}")
        return await self.broker.get_topic(str(name), create=False)

    async def list_topics(self, namespace: str) -> list[str]:
        """Registered and loaded persistent topics (partitions included), sorted."""
        ns = NamespaceName.parse(namespace)
        names = set(await self.policies.list_topics(ns))
        for topic in self.broker.loaded_topics():
            # Segments of scalable topics load as topics too; they are listed with their
            # scalable topic, not here.
            parsed = parse_name(topic.name)
            if (
                isinstance(parsed, TopicName)
                and parsed.namespace_name == ns
                and parsed.domain is TopicDomain.PERSISTENT
            ):
                names.add(topic.name)
        return sorted(names)

    async def list_partitioned_topics(self, namespace: str) -> list[str]:
        """Partitioned topics of a namespace (NotFound if the namespace is absent)."""
        ns = NamespaceName.parse(namespace)
        await self.policies.namespace_policies(ns)
        return await self.policies.list_partitioned_topics(ns)

    async def create_topic(self, text: str) -> None:
        """Create a non-partitioned topic; AlreadyExists (409) if it (or a partitioned
        topic of that name) exists."""
        name = persistent_topic(text)
        if name.partition is not None:
            raise InvalidArgument(f"{name} is a partition name; create the partitioned topic")
        if await self.policies.get_partitions(name) > 0:
            raise AlreadyExists(f"partitioned topic {name}")
        if not await self.policies.register_topic(name):
            raise AlreadyExists(f"topic {name}")
        await self.broker.get_topic(str(name), create=True)

    async def delete_topic(self, text: str, *, force: bool = False) -> None:
        """Delete a topic; NotEmpty (409) while it has producers or consumers, unless
        ``force`` (which disconnects them). A topic whose ledger's storage was lost never
        loads (LedgerFenced), so it has no clients: the broker deletes what is left."""
        try:
            topic = await self._existing_topic(text)
        except LedgerFenced:
            name = str(persistent_topic(text))
        else:
            name = topic.name
            if not force:
                consumers = sum(_consumer_count(sub) for sub in topic.subscriptions.values())
                if topic.producers or consumers:
                    raise NotEmpty(
                        topic.name,
                        f"{len(topic.producers)} producers and {consumers} consumers are connected",
                    )
        await self.broker.delete_topic(name)
        deleted = parse_name(name)
        if isinstance(deleted, TopicName) and deleted.partition is None:
            await self.policies.forget_topic_permissions(deleted)

    async def create_partitioned_topic(self, text: str, partitions: int) -> None:
        """Record the partition count and register every partition."""
        name = persistent_topic(text)
        await self.policies.create_partitioned_topic(name, partitions)
        for index in range(partitions):
            await self.policies.register_topic(name.with_partition(index))

    async def update_partitioned_topic(self, text: str, partitions: int) -> None:
        """Raise the partition count (InvalidArgument on a decrease)."""
        name = persistent_topic(text)
        await self.policies.update_partitioned_topic(name, partitions)
        for index in range(partitions):
            await self.policies.register_topic(name.with_partition(index))

    async def get_partitions(self, text: str) -> dict[str, int]:
        """``{"partitions": N}``; 0 for a non-partitioned topic (as Pulsar answers)."""
        return {"partitions": await self.policies.get_partitions(persistent_topic(text))}

    async def delete_partitioned_topic(self, text: str, *, force: bool = False) -> None:
        """Delete every partition, then the partitioned metadata."""
        name = persistent_topic(text)
        partitions = await self.policies.get_partitions(name)
        if partitions == 0:
            raise NotFound(f"partitioned topic {name}")
        for index in range(partitions):
            partition = name.with_partition(index)
            if await self.policies.topic_exists(partition) or self.broker.loaded_topic(
                str(partition)
            ):
                try:
                    await self.delete_topic(str(partition), force=force)
                except NotFound:
                    pass
            await self.policies.unregister_topic(partition)
        await self.policies.delete_partitioned_topic(name)
        await self.broker.topic_policies.delete(name)
        await self.broker.schemas.delete(name, force=True)
        await self.policies.forget_topic_permissions(name)

    async def stats(self, text: str) -> dict[str, Any]:
        """Pulsar ``TopicStats`` JSON of a (loaded or loadable) topic."""
        topic = await self._existing_topic(text)
        stats = dict(topic.stats())
        for key in ("msgRateIn", "msgRateOut", "msgThroughputIn", "msgThroughputOut"):
            stats.setdefault(key, 0.0)
        msg_in = int(stats.get("msgInCounter", 0))
        stats.setdefault(
            "averageMsgSize", stats.get("bytesInCounter", 0) / msg_in if msg_in else 0.0
        )
        stats.setdefault("replication", {})
        stats["deduplicationStatus"] = "Enabled" if topic.dedup is not None else "Disabled"
        return stats

    async def partitioned_stats(self, text: str) -> dict[str, Any]:
        """Sums over the partitions plus each partition's stats (``?perPartition``)."""
        name = persistent_topic(text)
        partitions = await self.policies.get_partitions(name)
        if partitions == 0:
            raise NotFound(f"partitioned topic {name}")
        total: dict[str, Any] = {"metadata": {"partitions": partitions}, "partitions": {}}
        summed = ("msgRateIn", "msgRateOut", "msgThroughputIn", "msgThroughputOut",
                  "msgInCounter", "bytesInCounter", "msgOutCounter", "bytesOutCounter",
                  "storageSize")  # fmt: skip
        for key in summed:
            total[key] = 0
        for index in range(partitions):
            partition = str(name.with_partition(index))
            try:
                stats = await self.stats(partition)
            except NotFound:
                continue
            total["partitions"][partition] = stats
            for key in summed:
                total[key] += stats.get(key, 0)
        return total

    async def internal_stats(self, text: str) -> dict[str, Any]:
        """Pulsar ``PersistentTopicInternalStats`` JSON from the managed ledger."""
        topic = await self._existing_topic(text)
        ledger = topic.ledger
        cursors: dict[str, Any] = {}
        for cursor in ledger.cursors():
            cursors[cursor.name] = _cursor_stats(cursor)
        ledgers = [
            {
                "ledgerId": getattr(info, "ledger_id", 0),
                "entries": getattr(info, "entries", 0),
                "size": getattr(info, "size", 0),
                "offloaded": getattr(info, "offload", None) is not None,
            }
            for info in getattr(ledger, "ledgers", [])
        ]
        total_size = sum(item["size"] for item in ledgers)
        current = ledgers[-1] if ledgers else {"entries": 0, "size": 0}
        return {
            "entriesAddedCounter": getattr(ledger, "entries_added", ledger.entry_count),
            "numberOfEntries": ledger.entry_count,
            "totalSize": total_size,
            "storageSize": total_size,
            "currentLedgerEntries": current["entries"],
            "currentLedgerSize": current["size"],
            "lastConfirmedEntry": position_text(ledger.last_confirmed),
            "state": "Terminated" if ledger.is_terminated else "LedgerOpened",
            "ledgers": ledgers,
            "cursors": cursors,
        }

    async def terminate(self, text: str) -> MessageIdBody:
        """Seal the topic; returns the last message id."""
        topic = await self._existing_topic(text)
        position = await topic.terminate()
        partition = TopicName.parse(topic.name).partition
        return MessageIdBody.of(position, -1 if partition is None else partition)

    # --- subscriptions --------------------------------------------------------------------

    async def list_subscriptions(self, text: str) -> list[str]:
        """Durable subscriptions (cursors) of the topic."""
        topic = await self._existing_topic(text)
        names = set(topic.subscriptions) | {c.name for c in topic.ledger.cursors()}
        return sorted(names)

    async def create_subscription(self, text: str, sub: str, start: Position = LATEST) -> None:
        """Create a durable subscription at ``start``; AlreadyExists (409) if present."""
        _check_subscription_name(sub)
        topic = await self._existing_topic(text)
        if sub in topic.subscriptions or any(c.name == sub for c in topic.ledger.cursors()):
            raise AlreadyExists(f"subscription {sub} on {topic.name}")
        initial = start if start in (EARLIEST, LATEST) else EARLIEST
        caps = await self.broker.topic_limits(parse_name(topic.name))
        subscription = await topic.get_or_create_subscription(
            sub, pb.CommandSubscribe.Exclusive, initial, caps=caps
        )
        if initial != start:
            await subscription.seek(position=start)

    async def _subscription(self, text: str, sub: str) -> tuple[PersistentTopic, Any]:
        topic = await self._existing_topic(text)
        subscription = topic.subscriptions.get(sub)
        if subscription is None:
            raise NotFound(f"subscription {sub} on {topic.name}")
        return topic, subscription

    async def delete_subscription(self, text: str, sub: str, *, force: bool = False) -> None:
        """Delete a subscription; NotEmpty (409) while consumers are connected unless
        ``force``."""
        topic, subscription = await self._subscription(text, sub)
        consumers = _consumer_count(subscription)
        if consumers and not force:
            raise NotEmpty(f"{topic.name}/{sub}", f"{consumers} consumers are connected")
        await topic.remove_subscription(sub)

    async def skip_all(self, text: str, sub: str) -> None:
        """Acknowledge the whole backlog of the subscription."""
        topic, subscription = await self._subscription(text, sub)
        await subscription.seek(position=topic.ledger.last_confirmed.next())

    async def skip(self, text: str, sub: str, count: int) -> None:
        """Acknowledge the next ``count`` unacknowledged entries."""
        if count < 0:
            raise InvalidArgument(f"cannot skip {count} messages")
        topic, _ = await self._subscription(text, sub)
        cursor = _cursor(topic, sub)
        chosen: list[Position] = []
        start = cursor.read_position
        while len(chosen) < count:
            entries = await topic.ledger.read(start, max_entries=SKIP_READ_BATCH_ENTRIES)
            if not entries:
                break
            for entry in entries:
                if not cursor.is_acknowledged(entry.position):
                    chosen.append(entry.position)
                    if len(chosen) == count:
                        break
            start = entries[-1].position.next()
        if chosen:
            # Through the cursor: acked entries are never dispatched again, and an entry
            # already in flight is dropped when its (now redundant) ack arrives.
            await cursor.acknowledge(chosen)

    async def reset_cursor_to_time(self, text: str, sub: str, timestamp_ms: int) -> None:
        """Rewind/forward the subscription to the first message published at or after
        ``timestamp_ms``."""
        _, subscription = await self._subscription(text, sub)
        await subscription.seek(timestamp_ms=timestamp_ms)

    async def reset_cursor(self, text: str, sub: str, message_id: MessageIdBody) -> None:
        """Move the subscription to ``message_id`` (that message is redelivered unless
        ``isExcluded``)."""
        _, subscription = await self._subscription(text, sub)
        await subscription.seek(position=message_id.position())

    # --- scalable topics (PIP-468) ---------------------------------------------------------

    async def scalable(self) -> ScalableTopicService:
        """The scalable-topic service: the broker's own (shared with its binary sessions,
        sealing segments through the topics it has loaded) unless one was passed in. Its
        controllers advertise the broker's HTTP URL, where a non-leader redirects
        mutations (HTTP 307)."""
        return self._scalable if self._scalable is not None else self.broker.scalable

    async def segment_ops(self) -> SegmentOps:
        """The segment-topic operations the scalable-topic service uses."""
        return (await self.scalable()).ops

    async def scalable_stats(self, topic: str, *, to_leader: bool = False) -> dict[str, Any]:
        """Layout summary plus, per segment (sealed included): state, range, backlog per
        subscription, and the broker's message counters when it has the segment loaded;
        per subscription, its assignment state (``core/assignment_stats``) when this
        broker leads the topic's controller, and the Key_Shared hash ranges of segments
        whose consumers share them and that this broker serves.

        ``to_leader``: raise NotLeader (the HTTP layer's 307) when another broker leads
        the controller, since the assignment and autoscaler state live there."""
        service = await self.scalable()
        name = scalable_topic_name(topic)
        if to_leader and not service.leads(name):
            leader = await service.leader_url(name)
            if leader and leader.rstrip("/") != service.broker_url.rstrip("/"):
                raise NotLeader(str(name), leader)
        summary = await service.stats(name)
        layout = await service.get_metadata(name)
        ops = service.ops
        segments: dict[str, Any] = {}
        for segment in sorted(layout, key=lambda s: s.segment_id):
            seg = segment_name(name, segment)
            entry: dict[str, Any] = {
                "segmentId": segment.segment_id,
                "name": str(seg),
                "state": segment.state.value,
                "hashRange": segment.hash_range.to_hex(),
                "createdAtEpoch": segment.created_at_epoch,
                "sealedAtEpoch": segment.sealed_at_epoch,
                "backlog": {
                    sub: await ops.segment_backlog(seg, sub) for sub in summary["subscriptions"]
                },
            }
            loaded = self.broker.loaded_topic(str(seg))
            if loaded is not None:
                stats = loaded.stats()
                for key in ("msgInCounter", "bytesInCounter", "msgOutCounter", "bytesOutCounter"):
                    entry[key] = stats.get(key, 0)
                ranges = {
                    sub: sub_stats["consumerHashRanges"]
                    for sub, sub_stats in stats.get("subscriptions", {}).items()
                    if sub_stats.get("consumerHashRanges")
                }
                if ranges:
                    entry["keySharedHashRanges"] = ranges
            segments[str(segment.segment_id)] = entry
        summary["segments"] = segments
        # The autoscaler's view (rates, next intent) lives on the controller leader only.
        autoscale = self.broker.autoscaler.topic_stats(name)
        for sid, view in (autoscale or {}).get("segments", {}).items():
            if sid in segments:
                segments[sid].update(view)
        summary["autoscale"] = autoscale
        summary["subscriptionStates"] = service.assignment_stats(name, summary["subscriptions"])
        return summary

    async def scalable_layout(self, topic: str) -> SegmentLayout:
        """The stored layout of a scalable topic (NotFound if absent)."""
        return await (await self.scalable()).get_metadata(topic)

    async def create_segment(self, segment: SegmentName, subscriptions: list[str]) -> None:
        """Create a segment topic with a cursor at EARLIEST per subscription."""
        for sub in subscriptions:
            _check_subscription_name(sub)
        await (await self.segment_ops()).create_segment(segment, subscriptions)

    async def terminate_segment(self, segment: SegmentName) -> dict[str, int]:
        """Seal a segment topic; its dedup snapshot ``{producer: last_sequence_id}``."""
        return decode_dedup_snapshot(await (await self.segment_ops()).terminate_segment(segment))

    async def delete_segment(self, segment: SegmentName) -> None:
        """Delete a segment topic, its data and cursors (SegmentActive, 409, while its
        topic's layout lists it as active)."""
        await self.check_segment_deletable(segment)
        await (await self.segment_ops()).delete_segment(segment)

    async def check_segment_deletable(self, segment: SegmentName) -> None:
        """Refuse (SegmentActive) to delete a segment its topic's layout lists as ACTIVE,
        unless the topic is being deleted; a sealed segment, one the layout no longer has
        (pruned) and one of a topic that no longer exists may go."""
        paths = TopicPaths(segment.topic)
        record = await self.broker.store.get(paths.layout)
        if record is None or await self.broker.store.get(paths.deleting) is not None:
            return
        if segment_is_active(SegmentLayout.from_json(record.value), segment):
            raise SegmentActive(str(segment))

    # --- transactions (PIP-473) -----------------------------------------------------------

    def txn_coordinator(self) -> TransactionCoordinator:
        """This broker's coordinator; TransactionCoordinatorNotFound (503) when transactions
        are disabled."""
        coordinator = self.broker.txn_coordinator
        if coordinator is None:
            raise TransactionCoordinatorNotFound("transactions are not enabled on this broker")
        return coordinator

    def txn_batches(self) -> TxnBatches:
        """The exactly-once sink's batch transactions (``transactions/batches.py``) over
        this broker's coordinator; 503 while transactions are disabled."""
        return TxnBatches(self.broker.store, self.txn_coordinator(), self.broker.clock)

    async def coordinator_stats(self, coordinator_id: int | None = None) -> dict[str, Any]:
        """The coordinator's stats: totals plus ``perPartition`` (every coordinator
        partition), or one partition's (``coordinatorId``; NotFound past the count).

        Counts are this broker's since it started (any broker serves every partition);
        ``open`` is the transactions this broker opened that are still open.
        """
        stats = self.txn_coordinator().stats()
        per_partition: dict[str, dict[str, Any]] = stats.get("perPartition", {})
        for key, entry in per_partition.items():
            entry.setdefault("coordinatorId", int(key))
            entry.setdefault("state", "Ready")
            entry.setdefault("ongoingTxnSize", entry.get("open", 0))
        if coordinator_id is None:
            return stats
        if coordinator_id < 0:
            raise InvalidArgument(f"coordinatorId {coordinator_id} is negative")
        one = per_partition.get(str(coordinator_id))
        if one is None:
            count = stats.get("partitions", 0)
            raise NotFound(f"transaction coordinator {coordinator_id} (there are {count})")
        return one

    async def transaction_metadata(self, most_bits: int, least_bits: int) -> dict[str, Any]:
        """Header fields and op-record summary of one transaction (TransactionNotFound,
        404, when it never existed or was collected; InvalidArgument for negative ids)."""
        coordinator = self.txn_coordinator()
        _check_txn_bits(most_bits, least_bits)
        if most_bits >= coordinator.partitions:
            raise TransactionNotFound(
                f"transaction {most_bits}_{least_bits} not found "
                f"(there are {coordinator.partitions} coordinator partitions)"
            )
        return await coordinator.transaction_metadata(TxnId(most_bits, least_bits))

    # --- transaction keys (the key-fencing PIP) ---------------------------------------------

    def txn_keys(self) -> TransactionKeys:
        """This broker's transaction keys; 503 when transactions are disabled."""
        self.txn_coordinator()
        keys = self.broker.txn_keys
        if keys is None:
            raise TransactionCoordinatorNotFound("transactions are not enabled on this broker")
        return keys

    async def list_transaction_keys(self) -> list[dict[str, Any]]:
        """Every transaction key (owner, transactionKey, epoch, txnId, createdAt,
        updatedAt, ageMs), in key order, at most ``limits.TXN_KEYS_LIST_MAX``."""
        return await self.txn_keys().list_keys()

    async def get_transaction_key(self, key: str, owner: str = "") -> dict[str, Any]:
        """One key's epoch, current transaction (``txnId``, ``txnStatus``), owner and age;
        NotFound (404). ``owner`` is the role that claimed it ("" without auth)."""
        return await self.txn_keys().describe(owner, key)

    async def delete_transaction_key(self, key: str, owner: str = "") -> dict[str, Any]:
        """Delete a key: its open transaction is aborted and a connection holding it is
        fenced at its next command. Returns the deleted record; NotFound (404)."""
        return await self.txn_keys().delete(owner, key)

    async def slow_transactions(
        self, older_than_ms: int, coordinator_id: int | None = None
    ) -> dict[str, dict[str, Any]]:
        """OPEN transactions created more than ``older_than_ms`` ago, keyed by txnId as
        upstream answers (oldest deadline first, at most SLOW_TRANSACTIONS_MAX)."""
        if older_than_ms < 0:
            raise InvalidArgument(f"timeout {older_than_ms} ms is negative")
        if coordinator_id is not None and coordinator_id < 0:
            raise InvalidArgument(f"coordinatorId {coordinator_id} is negative")
        found = await self.txn_coordinator().slow_transactions(
            older_than_ms, limit=SLOW_TRANSACTIONS_MAX
        )
        answer: dict[str, dict[str, Any]] = {}
        for entry in found:
            txn_id = str(entry.get("txnId", ""))
            if coordinator_id is not None and not txn_id.startswith(f"{coordinator_id}_"):
                continue
            answer[txn_id] = entry
        return answer

    async def transaction_buffer_stats(self, text: str) -> dict[str, Any]:
        """The transaction buffer stats of a persistent topic (loaded here, as ``stats``
        does; a non-owner in a cluster answers 307)."""
        self.txn_coordinator()
        topic = await self._existing_topic(text)
        return _participant_stats(topic.transaction_buffer, f"topic {topic.name}")

    async def segment_transaction_buffer_stats(self, segment: SegmentName) -> dict[str, Any]:
        """The transaction buffer stats of a segment topic served by this broker."""
        self.txn_coordinator()
        topic = await self._loaded_segment(segment)
        return _participant_stats(topic.transaction_buffer, f"segment {segment}")

    async def pending_ack_stats(self, text: str, sub: str) -> dict[str, Any]:
        """The pending-ack store stats of a durable subscription of a persistent topic."""
        self.txn_coordinator()
        topic, subscription = await self._subscription(text, sub)
        return _participant_stats(
            getattr(subscription, "pending_acks", None), f"subscription {sub} on {topic.name}"
        )

    async def segment_pending_ack_stats(self, segment: SegmentName, sub: str) -> dict[str, Any]:
        """The pending-ack store stats of a subscription on a segment served here."""
        self.txn_coordinator()
        topic = await self._loaded_segment(segment)
        subscription = topic.subscriptions.get(sub)
        if subscription is None:
            raise NotFound(f"subscription {sub} on {segment}")
        return _participant_stats(
            getattr(subscription, "pending_acks", None), f"subscription {sub} on {segment}"
        )

    async def _loaded_segment(self, segment: SegmentName) -> PersistentTopic:
        """A segment topic loaded on this broker. Reading stats never loads (or creates) a
        segment: in a cluster another owner answers 307 (NotOwner), else NotFound."""
        topic = self.broker.loaded_topic(str(segment))
        if topic is not None:
            return topic
        from anabranch.admin.routes_cluster import cluster_of  # cluster mode: the owner

        ownership = cluster_of(self)
        if ownership is not None:
            owner = await ownership.owner(str(segment))
            if owner is not None and owner.broker_id != ownership.broker_id:
                raise NotOwner(str(segment), owner.http_url, owner.pulsar_url)
        raise NotFound(f"segment {segment} (not served by this broker)")

    # --- lookup ---------------------------------------------------------------------------

    def lookup(self, topic: str) -> LookupData:
        """This broker serves every topic and segment: answer its own URLs."""
        parse_name(topic)  # InvalidArgument
        url = self.broker.advertised_url
        return LookupData(
            broker_url=url,
            native_url=url,
            http_url=self.http_url,
            broker_url_tls=getattr(self.broker, "advertised_url_tls", None) or "",
            http_url_tls=getattr(self.broker, "http_url_tls", None) or "",
        )


def _consumer_count(subscription: Any) -> int:
    consumers = getattr(subscription, "consumers", None)
    if consumers is None:
        return 0
    return len(consumers)


def _cursor(topic: PersistentTopic, sub: str) -> Cursor:
    for cursor in topic.ledger.cursors():
        if cursor.name == sub:
            return cursor
    raise NotFound(f"subscription {sub} on {topic.name}")


def _cursor_stats(cursor: Cursor) -> dict[str, Any]:
    return {
        "markDeletePosition": position_text(cursor.mark_delete_position),
        "readPosition": position_text(cursor.read_position),
        "messagesConsumedCounter": 0,
        "numberOfEntriesSinceFirstNotAckedMessage": cursor.backlog(),
        "individuallyDeletedMessages": str(getattr(cursor, "individually_deleted", "[]")),
        "state": "Open",
    }


def _check_txn_bits(most_bits: int, least_bits: int) -> None:
    for name, value in (("mostSigBits", most_bits), ("leastSigBits", least_bits)):
        if not 0 <= value <= TXN_LEAST_BITS_MAX:
            raise InvalidArgument(f"{name} {value} is not a transaction id half")


def _participant_stats(participant: Any, what: str) -> dict[str, Any]:
    """``participant.stats()``; a topic or subscription that is no transaction participant
    (transactions off when it loaded, or a non-durable subscription) answers 503."""
    stats = getattr(participant, "stats", None)
    if (
        participant is None
        or isinstance(participant, NoTransactionBuffer | NoPendingAckStore)
        or not callable(stats)
    ):
        raise TransactionCoordinatorNotFound(f"{what} is not a transaction participant")
    return dict(stats())


def _check_subscription_name(sub: str) -> None:
    if not sub or len(sub) > 255 or any(ord(ch) < 0x20 or ch == "/" for ch in sub):
        raise InvalidArgument(f"invalid subscription name {sub!r}")

"""The broker's periodic policy sweeps: retention, message TTL, backlog quotas, segment
pruning, unused topics and subscriptions, and publish rates.

Theory of operation
-------------------
Periodic :class:`~anabranch.supervisor.Supervised` loops on the broker's clock (an
exception in one sweep is logged and the loop sleeps and sweeps again; one topic's failure
does not stop the others):

* every ``retention_check_interval_s``: each loaded topic's managed ledger takes its
  retention (the topic's override, else its namespace's, else the broker's default; the
  same order for TTL and quotas) and trims ledgers that every cursor has
  passed and that are out of retention; then each scalable topic this broker leads prunes
  the sealed root segments every subscription has drained and whose retention (timed from
  the seal) expired (PIP-468 ``pruneSegment``: the layout first, then the data). A
  scalable topic with a CHECKPOINT subscription is left alone: its readers keep their
  positions themselves, so the broker cannot know what they consumed;
* every ``ttl_check_interval_s``: with a namespace message TTL, every subscription's
  expired prefix of messages is acknowledged (the cursor moves; retention then deletes);
* every ``backlog_quota_check_interval_s``: a topic whose slowest subscription is over a
  ``destination_storage`` (estimated backlog bytes) or ``message_age`` (oldest unacked
  publish time) quota either evicts (``consumer_backlog_eviction``: the slowest cursors
  move forward) or blocks producers (:class:`~anabranch.broker.backlog_quota.QuotaGate`);
* every ``delete_inactive_topics_frequency_s``: a topic unused for longer than its
  inactive-topic policy allows (:mod:`anabranch.core.inactive_topics`) is deleted, data
  and subscriptions included; a load of its name waits for the deletion and starts afresh;
* every ``subscription_expiry_check_interval_s``: a durable subscription without a
  consumer for longer than the expiration time is deleted;
* every ``publish_rate_refresh_interval_s``: each loaded topic takes up its publish and
  dispatch rates, and its Shared and Key_Shared subscriptions their caps on unacknowledged
  messages, as set now (a change made on another broker of a cluster, or since they
  subscribed).

Every decision is a pure function (:mod:`anabranch.core.retention`,
:mod:`anabranch.core.inactive_topics`, ``broker/publish_throttling.py``); this module only
gathers the inputs and acts.

Example:
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> from anabranch.testing.broker import InProcessBroker
    >>> from anabranch.testing.clock import ManualClock
    >>> async def demo(service: BrokerService, clock: ManualClock) -> None:
    ...     sweeps = RetentionSweeps(service)
    ...     sweeps.start()
    ...     await sweeps.sweep_retention()      # or wait for the interval:
    ...     await clock.settle()
    ...     clock.advance(service.config.retention_check_interval_s)
    ...     await clock.settle()
    ...     print(sweeps.runs["retention"], service.counters.ledgers_trimmed)
    ...     await sweeps.close()
    >>> async def main() -> None:
    ...     clock = ManualClock()
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp), clock=clock) as broker:
    ...             await demo(broker.service, clock)
    >>> asyncio.run(main())
    1 0
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypeVar

from anabranch import limits
from anabranch.broker.config import BrokerConfig
from anabranch.broker.dispatcher_entries import entry_info
from anabranch.broker.policies import NamespacePolicies
from anabranch.broker.topic_limits import INTERNAL_SUBSCRIPTION_PREFIX
from anabranch.broker.topic_policies import TopicPolicies
from anabranch.core.inactive_topics import (
    DeleteMode,
    InactivePolicy,
    SubscriptionUsage,
    due,
    in_use,
    subscription_expired,
)
from anabranch.core.names import SegmentName, TopicName, parse_name
from anabranch.core.retention import (
    BacklogPolicy,
    BacklogQuota,
    BacklogQuotaType,
    LedgerSpan,
    Retention,
    SealedSegment,
    age_quota_exceeded,
    backlog_bytes,
    eviction_position,
    expired_prefix,
    prunable_segments,
    storage_quota_exceeded,
    ttl_cutoff_ms,
)
from anabranch.core.segment_layout import segment_name
from anabranch.errors import Closed, MetadataUnavailable, NotFound
from anabranch.metadata.api import MetadataStore
from anabranch.scalable.controller import CHECKPOINT, subscription_kind
from anabranch.scalable.paths import TopicPaths
from anabranch.storage.api import Cursor, ManagedLedger, Position
from anabranch.supervisor import Supervised

if TYPE_CHECKING:
    from anabranch.broker.nonpersistent import NonPersistentTopic
    from anabranch.broker.service import BrokerService
    from anabranch.broker.topic import PersistentTopic
    from anabranch.scalable.controller import ScalableTopicController

log = logging.getLogger(__name__)


class _Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=_Named)

COMPACTION_CURSOR = "__compaction"
"""The compaction cursor (``broker/compaction.py``): message TTL leaves it alone."""

TTL_READ_BATCH_ENTRIES = 100
"""Entries read per step while looking for a subscription's expired prefix."""
TTL_SCAN_ENTRIES_MAX = 20_000
"""At most this many entries are examined per subscription per sweep: a huge expired
backlog is acknowledged over several sweeps instead of stalling one."""


def namespace_of(name: TopicName | SegmentName) -> str:
    """``tenant/namespace`` of a topic, partition or segment.

    Example:
        >>> namespace_of(parse_name("persistent://acme/orders/t"))
        'acme/orders'
    """
    topic = name.topic if isinstance(name, SegmentName) else name
    return f"{topic.tenant}/{topic.namespace}"


def retention_of(config: BrokerConfig, policies: NamespacePolicies) -> Retention:
    """The namespace's retention, else the broker's default.

    Example:
        >>> from pathlib import Path
        >>> retention_of(BrokerConfig(data_dir=Path("d")), NamespacePolicies())
        Retention(time_ms=0, size_bytes=0)
    """
    if policies.retention is not None:
        r = policies.retention
        return Retention.of(r.retention_time_in_minutes, r.retention_size_in_mb)
    return Retention.of(config.default_retention_time_minutes, config.default_retention_size_mb)


def ttl_of(config: BrokerConfig, policies: NamespacePolicies) -> int:
    """The namespace's message TTL in seconds, else the broker's default (0: off)."""
    if policies.message_ttl_in_seconds is not None:
        return policies.message_ttl_in_seconds
    return config.ttl_duration_default_s


def quotas_of(
    config: BrokerConfig, policies: NamespacePolicies
) -> dict[BacklogQuotaType, BacklogQuota]:
    """The backlog quotas by type: the policies' own (unknown types and policies ignored),
    else the broker's defaults (Pulsar's ``backlogQuotaDefault*``; -1: none).

    Example:
        >>> from pathlib import Path
        >>> quotas_of(BrokerConfig(data_dir=Path("d")), NamespacePolicies())
        {}
    """
    out: dict[BacklogQuotaType, BacklogQuota] = {}
    default_policy = BacklogPolicy(config.backlog_quota_default_retention_policy)
    if config.backlog_quota_default_limit_bytes >= 0:
        out[BacklogQuotaType.DESTINATION_STORAGE] = BacklogQuota(
            limit_size=config.backlog_quota_default_limit_bytes, policy=default_policy
        )
    if config.backlog_quota_default_limit_second >= 0:
        out[BacklogQuotaType.MESSAGE_AGE] = BacklogQuota(
            limit_time_s=config.backlog_quota_default_limit_second, policy=default_policy
        )
    for kind, record in policies.backlog_quota_map.items():
        try:
            out[BacklogQuotaType(kind)] = BacklogQuota(
                record.limit_size, record.limit_time, BacklogPolicy(record.policy)
            )
        except ValueError:
            log.warning("ignoring backlog quota %s=%r", kind, record)
    return out


def ledger_spans(ledger: ManagedLedger) -> list[LedgerSpan]:
    """The ledger list as the pure decisions see it (empty for a backend without one)."""
    infos = getattr(ledger, "ledgers", None) or []
    return [LedgerSpan(i.ledger_id, i.entries, i.size, i.closed_ms) for i in infos]


class RetentionSweeps:
    """The three periodic sweeps of one broker (see the module docstring)."""

    def __init__(self, service: BrokerService) -> None:
        self.service = service
        self.config = service.config
        self.clock = service.clock
        self._topic_policies = service.topic_policies
        self._loops: list[Supervised] = []
        self._closed = False
        self.runs = {
            "retention": 0,
            "ttl": 0,
            "backlog_quota": 0,
            "non_persistent_idle": 0,
            "inactive_topics": 0,
            "subscription_expiry": 0,
            "rates": 0,
        }
        """Completed sweeps by kind (tests wait on them; /metrics could export them)."""
        self.counters = service.counters

    def start(self) -> None:
        """Start the periodic loops (idempotent), each :class:`Supervised`: a sweep that
        raises is logged and the next runs on time; a loop that dies anyway is restarted,
        and one that keeps dying stops the broker (``service.fatal``)."""
        if self._loops:
            return
        c = self.config
        for kind, interval, sweep in (
            ("retention", c.retention_check_interval_s, self.sweep_retention),
            ("ttl", c.ttl_check_interval_s, self.sweep_ttl),
            ("backlog_quota", c.backlog_quota_check_interval_s, self.sweep_backlog_quotas),
            (
                "non_persistent_idle",
                limits.NON_PERSISTENT_IDLE_SWEEP_S,
                self.service.sweep_idle_non_persistent,
            ),
            ("inactive_topics", c.delete_inactive_topics_frequency_s, self.sweep_inactive_topics),
            (
                "subscription_expiry",
                c.subscription_expiry_check_interval_s,
                self.sweep_expired_subscriptions,
            ),
            ("rates", c.publish_rate_refresh_interval_s, self.sweep_rates),
        ):
            loop = functools.partial(self._every, kind, interval, sweep)
            self._loops.append(
                Supervised(f"{kind}-sweeps", loop, on_give_up=self.service.fatal.fail).start()
            )

    async def _every(
        self, kind: str, interval_s: float, sweep: Callable[[], Awaitable[object]]
    ) -> None:
        while not self._closed:
            await self.clock.sleep(interval_s)
            try:
                await sweep()
            except Exception:
                self.counters.cleanup_failures += 1
                log.exception("the %s sweep failed; it runs again in %ss", kind, interval_s)
            self.runs[kind] += 1

    async def close(self) -> None:
        self._closed = True
        loops, self._loops = self._loops, []
        for loop in loops:
            await loop.stop()

    # --- helpers -----------------------------------------------------------------------------

    async def _each_topic(
        self, step: Callable[[PersistentTopic, NamespacePolicies], Awaitable[None]]
    ) -> None:
        """``step`` on each loaded persistent topic (not one sealed with no cursor left)
        with the policies in force: its own (a segment has none) over its namespace's."""

        async def merged(
            topic: PersistentTopic, policies: NamespacePolicies, own: TopicPolicies | None
        ) -> None:
            if topic.ledger.is_terminated and not topic.ledger.cursors():
                return
            await step(topic, policies if own is None else own.over(policies))

        await self._with_policies(self.service.loaded_topics(), merged, segments_own=False)

    async def _with_policies(
        self,
        topics: Iterable[T],
        step: Callable[[T, NamespacePolicies, TopicPolicies | None], Awaitable[None]],
        *,
        segments_own: bool,
    ) -> None:
        """``step(topic, namespace policies, its own policies or None)`` on each of
        ``topics`` whose namespace exists (a segment's own are its scalable topic's, if
        ``segments_own``): one read per namespace, one listing per namespace and domain,
        one read per topic with policies of its own. A step that raises is counted and
        logged; the others still run, unless the store is unreachable (the pass ends)."""
        namespaces: dict[str, NamespacePolicies | None] = {}
        overridden: dict[tuple[str, str], frozenset[str]] = {}
        for topic in topics:
            try:
                name = parse_name(topic.name)
                ns = namespace_of(name)
                if ns not in namespaces:
                    try:
                        namespaces[ns] = await self.service.policies.namespace_policies(ns)
                    except NotFound:
                        namespaces[ns] = None
                policies = namespaces[ns]
                if policies is None:
                    continue
                own = None
                base = name.topic if isinstance(name, SegmentName) else name
                if segments_own or base is name:
                    listed = (ns, base.domain.value)
                    if listed not in overridden:
                        overridden[listed] = await self._topic_policies.overridden(*listed)
                    if base.local_name in overridden[listed]:
                        own = await self._topic_policies.get(base)
                await step(topic, policies, own)
            except Closed:
                # Unloaded (ownership lost, moved, deleted) after the sweep listed it: its
                # new owner sweeps it; not a failure worth a traceback.
                log.debug("%s: unloaded during the sweep", topic.name)
            except MetadataUnavailable as err:
                # The store is out of reach for a moment: every other topic would fail the
                # same way, so the pass ends here (one line, no traceback); the next does it.
                self.counters.cleanup_failures += 1
                log.warning("%s: sweep deferred: %s", topic.name, err)
                return
            except Exception:
                self.counters.cleanup_failures += 1
                log.exception("%s: a sweep step failed", topic.name)

    # --- inactive topics ----------------------------------------------------------------------

    async def sweep_inactive_topics(self) -> None:
        """Delete each loaded topic unused for longer than its policy allows (partitions
        and segments are left alone: a partitioned topic and a scalable topic live on as a
        whole)."""

        async def check(topic: PersistentTopic, policies: NamespacePolicies) -> None:
            name = parse_name(topic.name)
            if isinstance(name, SegmentName) or name.partition is not None:
                return
            policy = inactive_policy_of(self.config, policies)
            now = self.clock.monotonic()
            if in_use(topic.usage(), policy.mode):
                topic.last_in_use_s = now
                return
            if not due(policy, last_in_use_s=topic.last_in_use_s, now_s=now):
                return
            if await self.service.delete_unused_topic(
                topic, lambda: not in_use(topic.usage(), policy.mode)
            ):
                self.counters.inactive_topics_deleted += 1
                log.info("%s: deleted after %.0fs unused", topic.name, now - topic.last_in_use_s)

        await self._each_topic(check)

    async def sweep_expired_subscriptions(self) -> None:
        """Delete each durable subscription left without a consumer for longer than its
        namespace's expiration time, else the broker's (a segment's are left alone: a
        scalable topic's subscription spans its segments)."""

        async def check(topic: PersistentTopic, policies: NamespacePolicies) -> None:
            if isinstance(parse_name(topic.name), SegmentName):
                return
            minutes = policies.subscription_expiration_time_minutes
            if minutes is None:
                minutes = self.config.subscription_expiration_time_minutes
            if minutes <= 0:
                return
            for name, sub in list(topic.subscriptions.items()):
                if name.startswith(INTERNAL_SUBSCRIPTION_PREFIX) or not sub.durable:
                    continue
                # Judged afresh after each deletion's awaits, right before this one's.
                usage = SubscriptionUsage(
                    len(sub.consumers), sub.pending_acks.open_count(), sub.last_active_s
                )
                now = self.clock.monotonic()
                if topic.subscriptions.get(name) is not sub or not subscription_expired(
                    usage, expiration_s=minutes * 60.0, now_s=now
                ):
                    continue
                await topic.remove_subscription(name)
                self.counters.subscriptions_expired += 1
                log.info("%s: subscription %s expired (%d min without a consumer)",
                         topic.name, name, minutes)  # fmt: skip

        await self._each_topic(check)

    # --- rates and caps --------------------------------------------------------------------------

    async def sweep_rates(self) -> None:
        """Put every loaded topic's current rates and subscription caps in force
        (``service.apply_policies``)."""

        async def refresh(
            topic: PersistentTopic | NonPersistentTopic,
            policies: NamespacePolicies,
            own: TopicPolicies | None,
        ) -> None:
            self.service.apply_policies(topic, policies, own)

        topics: list[PersistentTopic | NonPersistentTopic] = [
            *self.service.loaded_topics(),
            *self.service.loaded_non_persistent_topics(),
        ]
        await self._with_policies(topics, refresh, segments_own=True)

    # --- retention ----------------------------------------------------------------------------

    async def sweep_retention(self) -> None:
        """Trim every loaded topic's ledgers, then prune drained segments."""

        checkpointed: dict[TopicName, bool] = {}

        async def trim(topic: PersistentTopic, policies: NamespacePolicies) -> None:
            name = parse_name(topic.name)
            if isinstance(name, SegmentName):
                if name.topic not in checkpointed:
                    checkpointed[name.topic] = await checkpoint_subscribed(
                        self.service.store, name.topic
                    )
                if checkpointed[name.topic]:
                    return  # its readers keep their positions: nothing is known consumed
            topic.ledger.set_retention(retention_of(self.config, policies))
            await topic.ledger.roll_over_if_due()
            deleted = await topic.ledger.trim()
            self.counters.ledgers_trimmed += deleted
            if deleted:
                log.info("%s: deleted %d consumed ledgers", topic.name, deleted)
                # Aborted records of entries that are gone would stay in the metadata
                # store (and in the buffer's memory) for good.
                await topic.transaction_buffer.prune_trimmed(topic.ledger.first_stored)

        await self._each_topic(trim)
        for controller in self.service.scalable.local_controllers():
            if not controller.is_leader:
                continue
            try:
                await self.prune_segments(controller)
            except Exception:
                self.counters.cleanup_failures += 1
                log.exception("%s: pruning sealed segments failed", controller.topic)

    async def prune_segments(self, controller: ScalableTopicController) -> list[int]:
        """Prune what :func:`prunable_segments` allows; returns the pruned segment ids.

        Segment sizes are not known here (a segment may live on another broker), so the
        retained total is taken as 0: the time bound decides, and a size-only retention
        (time -1) keeps sealed segments."""
        await controller.finish_prunes()  # a deletion a failure or crash left behind
        layout = await controller.get_layout()
        roots = [s for s in layout.sealed_segments() if not s.parent_ids]
        if not roots or await checkpoint_subscribed(self.service.store, controller.topic):
            return []
        policies = await self.service.policies.namespace_policies(namespace_of(controller.topic))
        sealed: dict[int, SealedSegment] = {}
        drained: set[int] = set()
        for segment in layout.sealed_segments():
            sealed[segment.segment_id] = SealedSegment(
                segment.segment_id, segment.parent_ids, segment.child_ids, segment.sealed_at_ms
            )
        ops = controller.ops
        for segment in roots:
            name = segment_name(controller.topic, segment)
            subscriptions = await ops.segment_subscriptions(name)
            backlogs = [await ops.segment_backlog(name, sub) for sub in subscriptions]
            if all(b == 0 for b in backlogs):
                drained.add(segment.segment_id)
        retention = retention_of(self.config, policies)
        doomed = prunable_segments(sealed, drained, retention, self.clock.wall_ms(), 0)
        if doomed:
            await controller.prune(doomed)
        return doomed

    # --- message TTL ----------------------------------------------------------------------------

    async def sweep_ttl(self) -> None:
        """Acknowledge every subscription's expired messages."""

        async def expire(topic: PersistentTopic, policies: NamespacePolicies) -> None:
            cutoff = ttl_cutoff_ms(self.clock.wall_ms(), ttl_of(self.config, policies))
            if cutoff is None:
                return
            for cursor in list(topic.ledger.cursors()):
                if cursor.name == COMPACTION_CURSOR:
                    continue  # it holds what the next compaction reads (upstream skips it)
                before = cursor.backlog()
                upto = topic.transaction_buffer.max_read_position()
                if await expire_before(topic.ledger, cursor, cutoff, upto) is not None:
                    self.counters.entries_expired += before - cursor.backlog()

        await self._each_topic(expire)

    # --- backlog quotas ---------------------------------------------------------------------------

    async def sweep_backlog_quotas(self) -> None:
        """Evict or block where a topic is over a backlog quota; unblock where it is not."""

        async def check(topic: PersistentTopic, policies: NamespacePolicies) -> None:
            await self.check_quotas(topic, quotas_of(self.config, policies))

        await self._each_topic(check)

    async def check_quotas(
        self, topic: PersistentTopic, quotas: dict[BacklogQuotaType, BacklogQuota]
    ) -> None:
        """Apply ``quotas`` to ``topic`` now."""
        ledger = topic.ledger
        # The compactor's cursor is no consumer (upstream's isSystemCursor): a lagging
        # compaction must neither block producers nor have its cursor evicted forward.
        cursors = [c for c in ledger.cursors() if c.name != COMPACTION_CURSOR]
        blocked: BacklogPolicy | None = None
        storage = quotas.get(BacklogQuotaType.DESTINATION_STORAGE)
        if storage is not None and cursors:
            spans = ledger_spans(ledger)
            slowest = min(cursors, key=lambda c: c.mark_delete_position)
            if storage_quota_exceeded(backlog_bytes(spans, slowest.mark_delete_position), storage):
                if storage.policy is BacklogPolicy.CONSUMER_BACKLOG_EVICTION:
                    for cursor in cursors:
                        if backlog_bytes(spans, cursor.mark_delete_position) > storage.limit_size:
                            target = min(
                                eviction_position(
                                    spans, cursor.mark_delete_position, storage.limit_size
                                ),
                                topic.transaction_buffer.max_read_position(),
                            )
                            if target <= cursor.mark_delete_position:
                                continue
                            await cursor.acknowledge_cumulative(Position(*target))
                            self.counters.backlog_evictions += 1
                            log.info(
                                "%s/%s: backlog evicted to %s", topic.name, cursor.name, target
                            )
                else:
                    blocked = storage.policy
        age = quotas.get(BacklogQuotaType.MESSAGE_AGE)
        if age is not None and cursors:
            now = self.clock.wall_ms()
            for cursor in cursors:
                oldest = await oldest_unacked_ms(ledger, cursor)
                if not age_quota_exceeded(oldest, now, age):
                    continue
                if age.policy is BacklogPolicy.CONSUMER_BACKLOG_EVICTION:
                    before = cursor.backlog()
                    upto = topic.transaction_buffer.max_read_position()
                    await expire_before(ledger, cursor, now - age.limit_time_s * 1000, upto)
                    self.counters.entries_expired += before - cursor.backlog()
                    self.counters.backlog_evictions += 1
                elif blocked is None:
                    blocked = age.policy
        if blocked != topic.quota.blocked:
            log.info("%s: producers %s by the backlog quota", topic.name, blocked or "unblocked")
        topic.quota.set_blocked(blocked)


def inactive_policy_of(config: BrokerConfig, policies: NamespacePolicies) -> InactivePolicy:
    """The inactive-topic policy in force: the topic's or namespace's record (already
    merged into ``policies``), else the broker's settings."""
    record = policies.inactive_topic_policies
    if record is not None:
        return InactivePolicy(
            record.delete_while_inactive,
            DeleteMode(record.inactive_topic_delete_mode),
            float(record.max_inactive_duration_seconds),
        )
    duration = config.delete_inactive_topics_max_inactive_duration_s
    return InactivePolicy(
        config.delete_inactive_topics_enabled,
        DeleteMode(config.delete_inactive_topics_mode),
        config.delete_inactive_topics_frequency_s if duration is None else duration,
    )


async def checkpoint_subscribed(store: MetadataStore, topic: TopicName) -> bool:
    """Whether scalable ``topic`` has a CHECKPOINT subscription: its readers keep their
    positions themselves (no cursors), so no segment data counts as consumed and none is
    trimmed or pruned while it exists."""
    paths = TopicPaths(topic)
    for name in await store.list_children(paths.subscriptions):
        record = await store.get(paths.subscription(name))
        if record is not None and subscription_kind(record.value) == CHECKPOINT:
            return True
    return False


async def oldest_unacked_ms(ledger: ManagedLedger, cursor: Cursor) -> int | None:
    """Publish time of the first unacknowledged entry (None without a backlog)."""
    if cursor.backlog() == 0:
        return None
    entries = await ledger.read(cursor.read_position, max_entries=1)
    return entry_info(entries[0].data).publish_time_ms if entries else None


async def expire_before(
    ledger: ManagedLedger, cursor: Cursor, cutoff_ms: int, upto: Position
) -> Position | None:
    """Acknowledge ``cursor``'s messages published before ``cutoff_ms`` (a prefix, read in
    steps of ``TTL_READ_BATCH_ENTRIES``, at most ``TTL_SCAN_ENTRIES_MAX`` entries), never
    past ``upto`` (the transaction buffer's max read position: an open transaction's
    entries are not expired under it); returns the new mark-delete position, None when
    nothing expired."""
    position = cursor.read_position
    last: Position | None = None
    scanned = 0
    while cursor.backlog() > 0 and scanned < TTL_SCAN_ENTRIES_MAX:
        entries = await ledger.read(position, max_entries=TTL_READ_BATCH_ENTRIES)
        entries = [e for e in entries if e.position <= upto]
        if not entries:
            break
        scanned += len(entries)
        times = [entry_info(e.data).publish_time_ms for e in entries]
        count = expired_prefix(times, cutoff_ms)
        if count:
            last = entries[count - 1].position
        if count < len(entries):
            break
        position = entries[-1].position.next()
    if last is not None and last > cursor.mark_delete_position:
        await cursor.acknowledge_cumulative(last)
        return last
    return None

"""Topic-level overrides of retention, message TTL, backlog quotas, per-topic caps and the
rest of Pulsar's topic policies, one JSON record per topic in the metadata store.

    /admin/topic-policies/{t}/{ns}/persistent/{topic}   TopicPolicies

A field that is unset (None, or a quota type absent from the map) falls back to the
namespace's policy, then to the broker's default. A partition takes its partitioned topic's
record (policies are set on the partitioned topic, as in Pulsar). Every write is a
compare-and-set, retried a bounded number of times.

Example:
    >>> import asyncio
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo(store: MetadataStore) -> None:
    ...     tp = TopicPolicyStore(store)
    ...     topic = TopicName.parse("persistent://public/default/orders")
    ...     await tp.update(topic, lambda p: msgspec.structs.replace(p, message_ttl_in_seconds=60))
    ...     print((await tp.get(topic.with_partition(3))).message_ttl_in_seconds)
    ...     await store.close()
    >>> asyncio.run(demo(MemoryMetadataStore()))
    60
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from anabranch import limits
from anabranch.broker.policies import (
    BacklogQuotaRecord,
    DispatchRateRecord,
    InactiveTopicPoliciesRecord,
    NamespacePolicies,
    OffloadPoliciesRecord,
    PublishRateRecord,
    RetentionPolicies,
    SubscribeRateRecord,
)
from anabranch.core.names import TopicName
from anabranch.errors import BadVersion, InvalidArgument
from anabranch.metadata.api import MUST_NOT_EXIST, MetadataStore
from anabranch.metadata.cached_records import CachedRecords
from anabranch.metadata.record_cache import RecordCache

TOPIC_POLICIES = "/admin/topic-policies"


class TopicPolicies(msgspec.Struct, kw_only=True):
    """Pulsar's ``TopicPolicies`` fields this broker enforces; None means "inherit"."""

    retention: RetentionPolicies | None = msgspec.field(default=None, name="retentionPolicies")
    message_ttl_in_seconds: int | None = msgspec.field(default=None, name="messageTTLInSeconds")
    backlog_quota_map: dict[str, BacklogQuotaRecord] = msgspec.field(
        default_factory=dict, name="backLogQuotaMap"
    )
    schema_compatibility_strategy: str | None = msgspec.field(
        default=None, name="schemaCompatibilityStrategy"
    )
    compaction_threshold: int | None = msgspec.field(default=None, name="compactionThreshold")
    offload_policies: OffloadPoliciesRecord | None = msgspec.field(
        default=None, name="offloadPolicies"
    )
    max_producers: int | None = msgspec.field(default=None, name="maxProducerPerTopic")
    max_consumers: int | None = msgspec.field(default=None, name="maxConsumerPerTopic")
    max_consumers_per_subscription: int | None = msgspec.field(
        default=None, name="maxConsumersPerSubscription"
    )
    max_subscriptions: int | None = msgspec.field(default=None, name="maxSubscriptionsPerTopic")
    max_unacked_on_consumer: int | None = msgspec.field(
        default=None, name="maxUnackedMessagesOnConsumer"
    )
    max_unacked_on_subscription: int | None = msgspec.field(
        default=None, name="maxUnackedMessagesOnSubscription"
    )
    inactive_topic_policies: InactiveTopicPoliciesRecord | None = msgspec.field(
        default=None, name="inactiveTopicPolicies"
    )
    publish_rate: PublishRateRecord | None = msgspec.field(default=None, name="publishRate")
    """Not merged by :meth:`over` (the namespace's is per cluster): see
    ``broker/publish_throttling.py``."""
    dispatch_rate: DispatchRateRecord | None = msgspec.field(default=None, name="dispatchRate")
    subscription_dispatch_rate: DispatchRateRecord | None = msgspec.field(
        default=None, name="subscriptionDispatchRate"
    )
    """Neither dispatch rate is merged by :meth:`over` (the namespace's are per cluster):
    see ``broker/dispatch_throttling.py``."""
    subscribe_rate: SubscribeRateRecord | None = msgspec.field(default=None, name="subscribeRate")
    """Not merged by :meth:`over` either: see ``broker/subscribe_throttling.py``."""

    def over(self, namespace: NamespacePolicies) -> NamespacePolicies:
        """The namespace's policies with this topic's overrides applied.

        Example:
            >>> topic = TopicPolicies(message_ttl_in_seconds=5)
            >>> topic.over(NamespacePolicies()).message_ttl_in_seconds
            5
        """
        return msgspec.structs.replace(
            namespace,
            retention=self.retention if self.retention is not None else namespace.retention,
            message_ttl_in_seconds=(
                self.message_ttl_in_seconds
                if self.message_ttl_in_seconds is not None
                else namespace.message_ttl_in_seconds
            ),
            backlog_quota_map={**namespace.backlog_quota_map, **self.backlog_quota_map},
            schema_compatibility_strategy=(
                self.schema_compatibility_strategy
                if self.schema_compatibility_strategy is not None
                else namespace.schema_compatibility_strategy
            ),
            compaction_threshold=(
                self.compaction_threshold
                if self.compaction_threshold is not None
                else namespace.compaction_threshold
            ),
            max_producers_per_topic=_first(self.max_producers, namespace.max_producers_per_topic),
            max_consumers_per_topic=_first(self.max_consumers, namespace.max_consumers_per_topic),
            max_consumers_per_subscription=_first(
                self.max_consumers_per_subscription, namespace.max_consumers_per_subscription
            ),
            max_subscriptions_per_topic=_first(
                self.max_subscriptions, namespace.max_subscriptions_per_topic
            ),
            max_unacked_messages_per_consumer=_first(
                self.max_unacked_on_consumer, namespace.max_unacked_messages_per_consumer
            ),
            max_unacked_messages_per_subscription=_first(
                self.max_unacked_on_subscription, namespace.max_unacked_messages_per_subscription
            ),
            inactive_topic_policies=(
                self.inactive_topic_policies
                if self.inactive_topic_policies is not None
                else namespace.inactive_topic_policies
            ),
            **_offload_over(self.offload_policies, namespace),
        )


def _first(topic: int | None, namespace: int | None) -> int | None:
    return topic if topic is not None else namespace


def _offload_over(
    topic: OffloadPoliciesRecord | None, namespace: NamespacePolicies
) -> dict[str, object]:
    """A topic's ``offloadPolicies`` win over every namespace offload setting it sets."""
    if topic is None:
        return {}
    out: dict[str, object] = {"offload_policies": topic}
    if topic.managed_ledger_offload_threshold_in_bytes is not None:
        out["offload_threshold"] = -1
    if topic.managed_ledger_offload_threshold_in_seconds is not None:
        out["offload_threshold_in_seconds"] = -1
    if topic.managed_ledger_offload_deletion_lag_in_millis is not None:
        out["offload_deletion_lag_ms"] = None
    return out


def topic_policies_path(topic: TopicName) -> str:
    """The record of ``topic`` (a partition maps to its partitioned topic).

    Example:
        >>> topic_policies_path(TopicName.parse("persistent://a/b/t-partition-2"))
        '/admin/topic-policies/a/b/persistent/t'
    """
    base = topic.base
    return f"{TOPIC_POLICIES}/{base.tenant}/{base.namespace}/{base.domain.value}/{base.local_name}"


class TopicPolicyStore:
    """Reads and CAS-updates topic policies (see the module docstring)."""

    def __init__(self, store: MetadataStore, cache: RecordCache | None = None) -> None:
        self.store = store
        self._records = CachedRecords(store, cache)
        """Reads through the broker's policy cache; writes forget what they wrote."""

    async def get(self, topic: TopicName) -> TopicPolicies:
        """The topic's overrides (empty when none were set)."""
        record = await self._records.get(topic_policies_path(topic))
        if record is None:
            return TopicPolicies()
        try:
            return msgspec.json.decode(record.value, type=TopicPolicies)
        except msgspec.DecodeError as err:
            raise InvalidArgument(f"{record.path}: unreadable topic policies: {err}") from err

    async def update(
        self, topic: TopicName, change: Callable[[TopicPolicies], TopicPolicies]
    ) -> TopicPolicies:
        """Apply ``change`` and compare-and-set the result; returns it."""
        path = topic_policies_path(topic)
        for _ in range(limits.POLICIES_CAS_RETRIES_MAX):
            record = await self.store.get(path)
            current = (
                TopicPolicies()
                if record is None
                else msgspec.json.decode(record.value, type=TopicPolicies)
            )
            version = MUST_NOT_EXIST if record is None else record.stat.version
            new = change(current)
            try:
                await self._records.put(path, msgspec.json.encode(new), expected_version=version)
            except BadVersion:
                continue
            return new
        raise BadVersion(path, None, -1)

    async def overridden(self, namespace: str, domain: str = "persistent") -> frozenset[str]:
        """Local names of the ``domain`` topics of ``namespace`` (``tenant/ns``) that have
        overrides: one listing, so a sweep reads records only for those."""
        children = await self.store.list_children(f"{TOPIC_POLICIES}/{namespace}/{domain}")
        return frozenset(children)

    async def delete(self, topic: TopicName) -> None:
        """Forget the topic's overrides (the topic was deleted)."""
        await self._records.delete(topic_policies_path(topic))

"""Prometheus metrics: a custom collector that reads plain-int counters at scrape time.

Hot paths only do ``counter += 1`` on plain ints (a labelled ``prometheus_client``
counter costs microseconds per ``inc()``); this collector walks the broker's loaded
topics when Prometheus scrapes and turns those ints into metric families. Names are
``anabranch_*``; each help text names the upstream ``pulsar_*`` metric it mirrors, and
labels follow upstream (``cluster``, ``namespace``, ``topic``, ``subscription``).

What the broker provides:

* per topic (``PersistentTopic``): ``msg_in_counter``, ``bytes_in_counter``,
  ``msg_out_counter``, ``bytes_out_counter``, ``producers``, ``subscriptions``, ``ledger``;
* broker-wide: ``service.counters``, a :class:`BrokerCounters` the server and sessions
  bump (connections opened/closed, frames rejected before parsing).

Rates (``anabranch_rate_in`` ...) are computed between consecutive scrapes of one
collector, so they never disturb the admin ``/stats`` rate window.

Example:
    >>> registry = CollectorRegistry(auto_describe=False)
    >>> counters = BrokerCounters()
    >>> counters.bad_frames += 1
    >>> _ = registry.register(BrokerCollector(lambda: [], counters, cluster="standalone"))
    >>> registry.get_sample_value("anabranch_bad_frames_total", {"cluster": "standalone"})
    1
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from anabranch.broker.txn_metrics import TxnCollector
from anabranch.metadata.record_cache import RecordCache
from anabranch.storage.tail_cache import TailCacheBudget

if TYPE_CHECKING:
    from anabranch.broker.service import BrokerService
    from anabranch.broker.topic import PersistentTopic

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format's content type."""


@dataclass
class BrokerCounters:
    """Broker-wide plain-int counters; the server and sessions increment them."""

    connections_opened: int = 0
    connections_closed: int = 0
    bad_frames: int = 0
    """Frames rejected before allocation: length prefix over the max, negative, or under
    the header size (DESIGN.md §3.2 'count it in a metric')."""
    protocol_errors: int = 0
    """Connections closed for any other protocol error."""
    ledgers_trimmed: int = 0
    """Consumed ledgers deleted by the retention sweep."""
    entries_expired: int = 0
    """Entries acknowledged for a subscription by message TTL or a message_age eviction."""
    backlog_evictions: int = 0
    """Cursors moved forward by a consumer_backlog_eviction quota."""
    cleanup_failures: int = 0
    """Retention/TTL/quota sweeps (or one topic's step) that raised and were logged."""
    inactive_topics_deleted: int = 0
    """Topics deleted by the inactive-topic sweep."""
    subscriptions_expired: int = 0
    """Subscriptions deleted after their expiration time without a consumer."""
    publish_throttled: int = 0
    """Sends that put a topic over its publish rate (their connection paused reading)."""
    publish_buffer_pauses: int = 0
    """Sends that put the broker's publish buffer over its limit (``publish_buffer.py``)."""
    subscribes_throttled: int = 0
    """Subscribes refused by a topic's subscribe rate."""
    ledgers_offloaded: int = 0
    """Sealed ledgers copied to the object store (tiered storage)."""
    offload_failures: int = 0
    """Offload attempts that failed (the ledger stayed hot; retried)."""
    connections_refused: int = 0
    """Connections refused over ``max_connections`` or ``max_connections_per_ip``."""
    lookups_refused: int = 0
    """Lookups answered TooManyRequests over the pending-lookup bounds."""
    topics_refused: int = 0
    """Topic loads refused over ``max_topics_per_broker``."""
    pending_lookups: int = 0
    """Lookups being answered now (a gauge, bounded by BROKER_PENDING_LOOKUPS_MAX)."""
    topics_not_auto_created: int = 0
    """Lookups and loads of absent topics answered TopicNotFound because auto-creation is
    off or the namespace is at ``max_topics_per_namespace`` (nothing was written)."""
    authentication_failures: int = 0
    """Connections closed because CONNECT (or an AUTH_RESPONSE) had bad credentials."""
    authentication_refreshes: int = 0
    """Expired credentials a client replaced with valid ones after an AUTH_CHALLENGE."""

    @property
    def active_connections(self) -> int:
        return self.connections_opened - self.connections_closed


TOPIC_LABELS = ["cluster", "namespace", "topic"]
SUB_LABELS = [*TOPIC_LABELS, "subscription"]

# (attribute on PersistentTopic, metric suffix, help) for the monotonic counters.
_TOPIC_COUNTERS = (
    ("msg_in_counter", "in_messages", "Messages published (pulsar_in_messages_total)."),
    ("bytes_in_counter", "in_bytes", "Bytes published (pulsar_in_bytes_total)."),
    ("msg_out_counter", "out_messages", "Messages dispatched (pulsar_out_messages_total)."),
    ("bytes_out_counter", "out_bytes", "Bytes dispatched (pulsar_out_bytes_total)."),
    ("dispatch_read_failures", "dispatch_read_failures", "Dispatch reads that failed (retried)."),
)
_RATES = (
    ("msg_in_counter", "rate_in", "Messages/s published since the last scrape (pulsar_rate_in)."),
    ("bytes_in_counter", "throughput_in", "Bytes/s published (pulsar_throughput_in)."),
    ("msg_out_counter", "rate_out", "Messages/s dispatched (pulsar_rate_out)."),
    ("bytes_out_counter", "throughput_out", "Bytes/s dispatched (pulsar_throughput_out)."),
)


def _consumers(subscription: Any) -> int:
    consumers = getattr(subscription, "consumers", None)
    return 0 if consumers is None else len(consumers)


def _storage_size(topic: PersistentTopic) -> int:
    # Ledger backends that know their byte size expose it; the others count as 0.
    size = getattr(topic.ledger, "size_bytes", None)
    if isinstance(size, int):
        return size
    return sum(int(getattr(info, "size", 0)) for info in getattr(topic.ledger, "ledgers", []))


def _per_cluster(
    family: type[CounterMetricFamily] | type[GaugeMetricFamily],
    rows: Iterable[tuple[str, str, float]],
    cluster: str,
    prefix: str = "anabranch",
) -> Iterator[Metric]:
    """One metric family per (name, help, value) row, its one sample labelled ``cluster``."""
    for name, text, value in rows:
        metric = family(f"{prefix}_{name}", text, labels=["cluster"])
        metric.add_metric([cluster], value)
        yield metric


class BrokerCollector(Collector):
    """Turns the broker's plain counters into metric families at scrape time."""

    def __init__(
        self,
        topics: Callable[[], Iterable[PersistentTopic]],
        counters: BrokerCounters | None = None,
        *,
        cluster: str,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topics = topics
        self.counters = counters or BrokerCounters()
        self.cluster = cluster
        self.monotonic = monotonic
        self._marks: dict[str, tuple[float, dict[str, int]]] = {}

    def describe(self) -> list[Metric]:
        # Families are only known at scrape time; an empty describe skips the probe collect.
        return []

    def collect(self) -> Iterator[Metric]:
        prefix = "anabranch"
        now = self.monotonic()
        topics = list(self.topics())
        counters = {
            suffix: CounterMetricFamily(f"{prefix}_{suffix}", text, labels=TOPIC_LABELS)
            for _, suffix, text in _TOPIC_COUNTERS
        }
        rates = {
            suffix: GaugeMetricFamily(f"{prefix}_{suffix}", text, labels=TOPIC_LABELS)
            for _, suffix, text in _RATES
        }

        def gauge(name: str, text: str, labels: list[str] = TOPIC_LABELS) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{prefix}_{name}", text, labels=labels)

        storage = gauge("storage_size", "Bytes stored for the topic (pulsar_storage_size).")
        entries = gauge("storage_entries", "Entries retained in the topic's managed ledger.")
        backlog = gauge("msg_backlog", "Unacknowledged entries over all subscriptions "
                        "(pulsar_msg_backlog).")  # fmt: skip
        producers = gauge("producers_count", "Connected producers (pulsar_producers_count).")
        subscriptions = gauge("subscriptions_count", "Subscriptions (pulsar_subscriptions_count).")
        consumers = gauge("consumers_count", "Connected consumers (pulsar_consumers_count).")
        sub_backlog = gauge("subscription_back_log", "Unacknowledged entries of a subscription "
                            "(pulsar_subscription_back_log).", SUB_LABELS)  # fmt: skip
        sub_consumers = gauge("subscription_consumers_count", "Consumers of a subscription "
                              "(pulsar_subscription_consumers_count).", SUB_LABELS)  # fmt: skip
        seen: set[str] = set()
        for topic in topics:
            seen.add(topic.name)
            labels = [self.cluster, _namespace_of(topic.name), topic.name]
            values = {attr: int(getattr(topic, attr, 0)) for attr, _, _ in _TOPIC_COUNTERS}
            for attr, suffix, _ in _TOPIC_COUNTERS:
                counters[suffix].add_metric(labels, values[attr])
            then, old = self._marks.get(topic.name, (now, values))
            elapsed = now - then
            for attr, suffix, _ in _RATES:
                delta = values[attr] - old.get(attr, 0)
                rates[suffix].add_metric(labels, delta / elapsed if elapsed > 0 else 0.0)
            self._marks[topic.name] = (now, values)
            storage.add_metric(labels, _storage_size(topic))
            entries.add_metric(labels, topic.ledger.entry_count)
            producers.add_metric(labels, len(topic.producers))
            subscriptions.add_metric(labels, len(topic.subscriptions))
            cursor_backlog = {c.name: c.backlog() for c in topic.ledger.cursors()}
            backlog.add_metric(labels, sum(cursor_backlog.values()))
            topic_consumers = 0
            for name in sorted(set(cursor_backlog) | set(topic.subscriptions)):
                count = _consumers(topic.subscriptions.get(name))
                topic_consumers += count
                sub_backlog.add_metric([*labels, name], cursor_backlog.get(name, 0))
                sub_consumers.add_metric([*labels, name], count)
            consumers.add_metric(labels, topic_consumers)
        for gone in set(self._marks) - seen:
            del self._marks[gone]
        yield from counters.values()
        yield from rates.values()
        yield from (storage, entries, backlog, producers, subscriptions, consumers)
        yield from (sub_backlog, sub_consumers)
        yield from self._broker_families(prefix, len(topics))

    def _broker_families(self, prefix: str, topic_count: int) -> Iterator[Metric]:
        c = self.counters
        gauges = (
            ("topics_count", "Topics loaded on this broker (pulsar_topics_count).", topic_count),
            ("active_connections", "Open client connections (pulsar_active_connections).",
             c.active_connections),
        )  # fmt: skip
        yield from _per_cluster(GaugeMetricFamily, gauges, self.cluster, prefix)
        counters = (
            ("connections_opened", "Client connections accepted "
             "(pulsar_connection_created_total_count).", c.connections_opened),
            ("connections_closed", "Client connections closed "
             "(pulsar_connection_closed_total_count).", c.connections_closed),
            ("bad_frames", "Frames rejected before allocation: bad length prefix.",
             c.bad_frames),
            ("protocol_errors", "Connections closed for a protocol error.", c.protocol_errors),
            ("ledgers_trimmed", "Consumed ledgers deleted by retention.", c.ledgers_trimmed),
            ("entries_expired", "Entries acknowledged by message TTL or age eviction.",
             c.entries_expired),
            ("backlog_evictions", "Cursors moved by consumer_backlog_eviction.",
             c.backlog_evictions),
            ("cleanup_failures", "Retention/TTL/quota sweep steps that failed (logged).",
             c.cleanup_failures),
            ("inactive_topics_deleted", "Topics deleted after their inactivity period.",
             c.inactive_topics_deleted),
            ("subscriptions_expired", "Subscriptions deleted after their expiration time.",
             c.subscriptions_expired),
            ("publish_throttled", "Sends over a topic's publish rate: their connection "
             "paused (pulsar_publish_rate_limit_times).", c.publish_throttled),
            ("publish_buffer_pauses", "Times the broker's publish buffer went over "
             "max_message_publish_buffer_bytes: publishing connections paused.",
             c.publish_buffer_pauses),
            ("subscribes_throttled", "Subscribes refused by a topic's subscribe rate per "
             "consumer.", c.subscribes_throttled),
            ("ledgers_offloaded", "Sealed ledgers offloaded to the object store "
             "(brk_ledgeroffloader_*).", c.ledgers_offloaded),
            ("offload_failures", "Offload attempts that failed; the ledger stayed hot.",
             c.offload_failures),
            ("connections_refused", "Connections refused over max_connections(_per_ip).",
             c.connections_refused),
            ("lookups_refused", "Lookups refused over the pending-lookup bounds.",
             c.lookups_refused),
            ("topics_refused", "Topic loads refused over max_topics_per_broker.",
             c.topics_refused),
            ("topics_not_auto_created", "Absent topics not auto-created (disabled or at "
             "max_topics_per_namespace).", c.topics_not_auto_created),
            ("authentication_failures", "Connections refused for bad credentials.",
             c.authentication_failures),
            ("authentication_refreshes", "Expired credentials refreshed after a challenge.",
             c.authentication_refreshes),
        )  # fmt: skip
        yield from _per_cluster(CounterMetricFamily, counters, self.cluster, prefix)


def _namespace_of(topic: str) -> str:
    # "persistent://t/ns/x" -> "t/ns"; names were validated when the topic loaded.
    rest = topic.split("://", 1)[-1]
    return "/".join(rest.split("/")[:2])


class PolicyCacheCollector(Collector):
    """The broker's policy cache (``metadata/record_cache.py``): hits, misses, entries
    dropped by changes, entries held and whether its watch is live."""

    def __init__(self, cache: RecordCache, cluster: str) -> None:
        self._cache = cache
        self._cluster = cluster

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        c = self._cache
        counters = (
            ("policy_cache_hits", "Policy reads answered from memory.", c.hits),
            ("policy_cache_misses", "Policy reads that went to the metadata store.", c.misses),
            ("policy_cache_drops", "Cached policy records dropped by a change.", c.dropped),
        )  # fmt: skip
        yield from _per_cluster(CounterMetricFamily, counters, self._cluster)
        gauges = (
            ("policy_cache_entries", "Policy records held in memory.", c.size),
            ("policy_cache_live", "1 while the policy cache's watch is live.", int(c.live)),
        )  # fmt: skip
        yield from _per_cluster(GaugeMetricFamily, gauges, self._cluster)


class ScalableCollector(Collector):
    """Scalable-topic families: segments per topic (of the topics this broker's controller
    leads), split/merge/leadership/assignment counters and the open watch sessions and
    consumers. Per-segment rates and backlog are the per-topic families above: a loaded
    segment is a topic labelled with its ``segment://`` name.

    Example:
        >>> # registry.register(ScalableCollector(service))
    """

    def __init__(self, service: BrokerService) -> None:
        self.service = service

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        prefix = "anabranch_scalable"
        cluster = self.service.config.cluster_name
        scalable = self.service.scalable
        segments = GaugeMetricFamily(
            f"{prefix}_segments",
            "Segments of a scalable topic led by this broker, by state (active/sealed).",
            labels=[*TOPIC_LABELS, "state"],
        )
        epochs = GaugeMetricFamily(
            f"{prefix}_layout_epoch",
            "Layout epoch of a scalable topic led here.",
            labels=TOPIC_LABELS,
        )
        for controller in scalable.local_controllers():
            layout = controller.layout
            if not controller.is_leader or layout is None:
                continue
            name = str(controller.topic)
            labels = [cluster, _namespace_of(name), name]
            segments.add_metric([*labels, "active"], len(layout.active_segments()))
            segments.add_metric([*labels, "sealed"], len(layout.sealed_segments()))
            epochs.add_metric(labels, layout.epoch)
        yield segments
        yield epochs
        c = scalable.counters
        counters = (
            ("splits", "Segment splits completed by this broker's controllers.", c.splits),
            ("merges", "Segment merges completed by this broker's controllers.", c.merges),
            ("prunes", "Drained sealed segments pruned from the DAG.", c.prunes),
            ("controller_elections", "Controller leaderships acquired by this broker "
             "(each fail-over to it counts one).", c.leader_elections),
            ("assignment_changes", "Assignment pushes to stream/checkpoint consumers.",
             c.assignment_changes),
            ("controller_sessions_renewed", "Metadata sessions of this broker's controllers "
             "that expired (pause, partition) and were replaced.", c.sessions_renewed),
        )  # fmt: skip
        yield from _per_cluster(CounterMetricFamily, counters, cluster, prefix)
        yield from self._autoscale(prefix, cluster)
        endpoint = self.service.scalable_endpoint
        gauges = (
            ("watch_sessions", "Open DAG-watch sessions.", endpoint.watch_count()),
            ("namespace_watches", "Open namespace watches.", endpoint.namespace_watch_count()),
            ("consumers", "Connected stream/checkpoint consumers.", endpoint.consumer_count()),
        )
        yield from _per_cluster(GaugeMetricFamily, gauges, cluster, prefix)

    def _autoscale(self, prefix: str, cluster: str) -> Iterator[Metric]:
        autoscaler = getattr(self.service, "autoscaler", None)
        if autoscaler is None:
            return
        c = autoscaler.counters
        decisions = CounterMetricFamily(
            f"{prefix}_autoscale_decisions",
            "Splits and merges the autoscaler made, by action and reason (the metric that "
            "crossed its threshold, target or lowWater).",
            labels=["cluster", "action", "reason"],
        )
        for (action, reason), value in sorted(c.decisions.items()):
            decisions.add_metric([cluster, action, reason], value)
        yield decisions
        counters = (
            ("autoscale_evaluations", "Policy evaluations of led scalable topics.",
             c.evaluations),
            ("autoscale_failures", "Autoscale evaluations or actions that failed (retried).",
             c.failures),
        )  # fmt: skip
        yield from _per_cluster(CounterMetricFamily, counters, cluster, prefix)


class TailCacheCollector(Collector):
    """The broker-wide budget of the ledgers' tail caches (Pulsar's ``pulsar_ml_cache_*``).

    Example:
        >>> registry = CollectorRegistry(auto_describe=False)
        >>> registry.register(TailCacheCollector(TailCacheBudget(limit_bytes=100), "c"))
        >>> text = render(registry).decode()
        >>> 'anabranch_storage_cache_limit_bytes{cluster="c"} 100.0' in text
        True
    """

    def __init__(self, budget: TailCacheBudget, cluster: str) -> None:
        self.budget = budget
        self.cluster = cluster

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        b = self.budget
        gauges = (
            ("storage_cache_bytes", "Entries held in memory for tailing readers, over all "
             "topics (pulsar_ml_cache_used_size).", b.held),
            ("storage_cache_limit_bytes", "The broker's storage_cache_bytes.", b.limit),
        )  # fmt: skip
        yield from _per_cluster(GaugeMetricFamily, gauges, self.cluster)
        evicted = (
            "Bytes evicted to keep the caches within storage_cache_bytes "
            "(pulsar_ml_cache_evictions, in bytes)."
        )
        counters = (("storage_cache_evicted_bytes", evicted, b.evicted_bytes),)
        yield from _per_cluster(CounterMetricFamily, counters, self.cluster)


class EtcdCommitCollector(Collector):
    """How many metadata commits an etcd-backed broker sent, in how many Txns (concurrent
    commits share them: ``metadata/etcd_coalesce.py``)."""

    def __init__(self, store: Any, cluster: str) -> None:
        self.store = store
        self.cluster = cluster

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        counters = (
            ("metadata_commits", "Metadata commits sent to etcd.", self.store.commits_sent),
            ("metadata_txns", "etcd Txn requests those commits took.", self.store.txns_sent),
        )
        yield from _per_cluster(CounterMetricFamily, counters, self.cluster)


def broker_registry(service: BrokerService) -> CollectorRegistry:
    """A registry (not the global one: several brokers may share a process in tests) with
    this broker's collector.

    Example:
        >>> # text = render(broker_registry(service))
    """
    counters = getattr(service, "counters", None)
    if not isinstance(counters, BrokerCounters):
        counters = BrokerCounters()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        BrokerCollector(
            service.loaded_topics,
            counters,
            cluster=service.config.cluster_name,
            monotonic=service.clock.monotonic,
        )
    )
    if getattr(service, "scalable", None) is not None:
        registry.register(ScalableCollector(service))
    if hasattr(service, "loaded_non_persistent_topics"):
        from anabranch.broker.nonpersistent_metrics import NonPersistentCollector

        registry.register(
            NonPersistentCollector(
                service.loaded_non_persistent_topics, cluster=service.config.cluster_name
            )
        )
    if getattr(service, "txn_coordinator", None) is not None:
        registry.register(TxnCollector(service))  # the anabranch_txn_* families
    store = getattr(service, "store", None)
    if store is not None and hasattr(store, "txns_sent"):
        registry.register(EtcdCommitCollector(store, service.config.cluster_name))
    budget = getattr(service.ledgers, "tail_budget", None)
    if isinstance(budget, TailCacheBudget):
        registry.register(TailCacheCollector(budget, service.config.cluster_name))
    cache = getattr(service, "policy_cache", None)
    if isinstance(cache, RecordCache):
        registry.register(PolicyCacheCollector(cache, service.config.cluster_name))
    compactions = getattr(service, "compactions", None)
    if compactions is not None:
        from anabranch.broker.compaction_metrics import CompactionCollector

        registry.register(
            CompactionCollector(lambda: compactions.counters, service.config.cluster_name)
        )
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    return bytes(generate_latest(registry))


class _Collected:
    """Metric families already collected, as ``generate_latest`` takes a registry."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


async def render_off_loop(registry: CollectorRegistry, lock: asyncio.Lock) -> bytes:
    """:func:`render` for the event loop: the collectors read the broker's state on the
    loop (it is not thread-safe), the text is formatted in a worker thread, one scrape at
    a time per ``lock``. Formatting is most of the cost (about 6 us a sample: a second for
    a few thousand topics), and on the loop it stalled every client meanwhile.

    Example:
        >>> from prometheus_client import Counter
        >>> registry = CollectorRegistry()
        >>> Counter("demo_total", "A demo.", registry=registry).inc()
        >>> async def scrape() -> bytes:
        ...     return await render_off_loop(registry, asyncio.Lock())
        >>> b"demo_total 1.0" in asyncio.run(scrape())
        True
    """
    async with lock:
        families = list(registry.collect())
        text = await asyncio.to_thread(generate_latest, _Collected(families))
        return bytes(text)

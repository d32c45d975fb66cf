"""Prometheus families of the non-persistent topics loaded on a broker.

Read at scrape time from the topics' plain counters (nothing is done per message):
messages and bytes in and out per topic, messages dropped per topic and per subscription
(upstream's ``pulsar_msg_drop_rate`` is the rate of the latter), producers, subscriptions
and consumers, and how many non-persistent topics are loaded.

Example:
    >>> registry = CollectorRegistry(auto_describe=False)
    >>> _ = registry.register(NonPersistentCollector(lambda: [], cluster="standalone"))
    >>> registry.get_sample_value(
    ...     "anabranch_nonpersistent_topics_count", {"cluster": "standalone"})
    0
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from anabranch.broker.nonpersistent import NonPersistentTopic

TOPIC_LABELS = ["cluster", "namespace", "topic"]
SUB_LABELS = [*TOPIC_LABELS, "subscription"]
PREFIX = "anabranch_nonpersistent"

__all__ = ["CollectorRegistry", "NonPersistentCollector"]


class NonPersistentCollector(Collector):
    """Turns the non-persistent topics' counters into metric families at scrape time."""

    def __init__(self, topics: Callable[[], Iterable[NonPersistentTopic]], *, cluster: str) -> None:
        self.topics = topics
        self.cluster = cluster

    def describe(self) -> list[Metric]:
        return []  # known at scrape time only

    def collect(self) -> Iterator[Metric]:
        def counter(name: str, text: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", text, labels=labels)

        def gauge(name: str, text: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", text, labels=labels)

        msg_in = counter("in_messages", "Messages published to a non-persistent topic.",
                         TOPIC_LABELS)  # fmt: skip
        bytes_in = counter("in_bytes", "Bytes published to a non-persistent topic.",
                           TOPIC_LABELS)  # fmt: skip
        msg_out = counter("out_messages", "Messages dispatched to consumers.", TOPIC_LABELS)
        bytes_out = counter("out_bytes", "Bytes dispatched to consumers.", TOPIC_LABELS)
        dropped = counter("dropped_messages", "Messages dropped: no consumer could take "
                          "them, or over the in-flight bound (pulsar_msg_drop_rate).",
                          TOPIC_LABELS)  # fmt: skip
        sub_dropped = counter("subscription_dropped_messages", "Messages a subscription "
                              "dropped (its consumers had no permits or were backed up).",
                              SUB_LABELS)  # fmt: skip
        producers = gauge("producers_count", "Connected producers.", TOPIC_LABELS)
        subscriptions = gauge("subscriptions_count", "Subscriptions (with consumers).",
                              TOPIC_LABELS)  # fmt: skip
        consumers = gauge("consumers_count", "Connected consumers.", TOPIC_LABELS)
        count = 0
        for topic in self.topics():
            count += 1
            labels = [self.cluster, _namespace_of(topic.name), topic.name]
            msg_in.add_metric(labels, topic.msg_in_counter)
            bytes_in.add_metric(labels, topic.bytes_in_counter)
            msg_out.add_metric(labels, topic.msg_out_counter)
            bytes_out.add_metric(labels, topic.bytes_out_counter)
            dropped.add_metric(labels, topic.msg_drop_counter)
            producers.add_metric(labels, len(topic.producers))
            subscriptions.add_metric(labels, len(topic.subscriptions))
            consumers.add_metric(
                labels, sum(len(s.consumers) for s in topic.subscriptions.values())
            )
            for name, sub in topic.subscriptions.items():
                sub_dropped.add_metric([*labels, name], sub.messages_dropped)
        total = gauge("topics_count", "Non-persistent topics loaded on this broker.", ["cluster"])
        total.add_metric([self.cluster], count)
        yield from (msg_in, bytes_in, msg_out, bytes_out, dropped, sub_dropped)
        yield from (producers, subscriptions, consumers, total)


def _namespace_of(topic: str) -> str:
    rest = topic.split("://", 1)[-1]
    return "/".join(rest.split("/")[:2])

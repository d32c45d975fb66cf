"""Which subscribe rate a topic takes (Pulsar's ``subscribeRate``), and putting it in
force.

The rate comes from the topic's policy, else its namespace's for this broker's cluster
(upstream's ``clusterSubscribeRate``), else the broker's
``subscribe_throttling_rate_per_consumer`` per ``subscribe_rate_period_per_consumer_in_second``.
A partition takes its partitioned topic's policy, a segment its scalable topic's.
``core/subscribe_rate.py`` does the accounting; a SUBSCRIBE to a persistent topic asks it
first (readers included, as upstream's).

Example:
    >>> from anabranch.broker.config import BrokerConfig
    >>> ns = NamespacePolicies(cluster_subscribe_rate={
    ...     "standalone": SubscribeRateRecord(subscribe_throttling_rate_per_consumer=5)})
    >>> subscribe_rate_of(BrokerConfig(), ns, None)
    SubscribeRate(per_consumer=5, period_s=30)
"""

from __future__ import annotations

from typing import Protocol

from anabranch import limits
from anabranch.broker.config import BrokerConfig
from anabranch.broker.policies import NamespacePolicies, SubscribeRateRecord
from anabranch.broker.topic_policies import TopicPolicies
from anabranch.core.subscribe_rate import SubscribeLimiter, SubscribeRate


def subscribe_rate_of(
    config: BrokerConfig, namespace: NamespacePolicies, topic: TopicPolicies | None
) -> SubscribeRate:
    """The rate in force (see the module docstring)."""
    record = None if topic is None else topic.subscribe_rate
    if record is None:
        record = namespace.cluster_subscribe_rate.get(config.cluster_name)
    if record is None:
        return SubscribeRate(
            config.subscribe_throttling_rate_per_consumer,
            config.subscribe_rate_period_per_consumer_in_second,
        )
    return as_rate(record)


def as_rate(record: SubscribeRateRecord) -> SubscribeRate:
    """The record's rate."""
    return SubscribeRate(
        record.subscribe_throttling_rate_per_consumer, record.rate_period_in_second
    )


class Limited(Protocol):
    """A topic that takes a subscribe rate."""

    subscribe_limiter: SubscribeLimiter | None


def put_in_force(topic: Limited, rate: SubscribeRate) -> None:
    """Give ``topic`` the limiter of ``rate`` (none when unlimited); the same rate keeps
    its limiter, so a refresh hands no consumer a new period's subscribes."""
    current = topic.subscribe_limiter
    if rate.unlimited:
        topic.subscribe_limiter = None
    elif current is None or current.rate != rate:
        topic.subscribe_limiter = SubscribeLimiter(
            rate, max_tracked=limits.SUBSCRIBE_RATE_CONSUMERS_MAX
        )

"""Which publish rate a topic takes (Pulsar's ``publishRate``), and putting it in force.

The rate comes from the topic's policy, else its namespace's for this broker's cluster
(upstream keys a namespace's rates by cluster), else the broker's
``max_publish_rate_per_topic_in_*``. A partition takes its partitioned topic's policy, a
segment its scalable topic's. ``core/publish_rate.py`` does the accounting, the producer
calls it per send and the session stops reading a connection that went over.

Example:
    >>> from anabranch.broker.config import BrokerConfig
    >>> ns = NamespacePolicies(publish_max_message_rate={
    ...     "standalone": PublishRateRecord(publish_throttling_rate_in_msg=500)})
    >>> publish_rate_of(BrokerConfig(), ns, None)
    PublishRate(messages=500, bytes=-1)
"""

from __future__ import annotations

from typing import Protocol

from anabranch.broker.config import BrokerConfig
from anabranch.broker.policies import NamespacePolicies, PublishRateRecord
from anabranch.broker.topic_policies import TopicPolicies
from anabranch.core.publish_rate import PublishRate, PublishThrottle


def publish_rate_of(
    config: BrokerConfig, namespace: NamespacePolicies, topic: TopicPolicies | None
) -> PublishRate:
    """The rate in force (see the module docstring)."""
    record = None if topic is None else topic.publish_rate
    if record is None:
        record = namespace.publish_max_message_rate.get(config.cluster_name)
    if record is None:
        return PublishRate(
            config.max_publish_rate_per_topic_in_messages,
            config.max_publish_rate_per_topic_in_bytes,
        )
    return as_rate(record)


def as_rate(record: PublishRateRecord) -> PublishRate:
    """The record's rate."""
    return PublishRate(
        record.publish_throttling_rate_in_msg, record.publish_throttling_rate_in_byte
    )


class Throttled(Protocol):
    """A topic that takes a publish rate."""

    publish_throttle: PublishThrottle | None


def put_in_force(topic: Throttled, rate: PublishRate, now: float) -> None:
    """Give ``topic`` the buckets of ``rate`` (none when unlimited); the same rate keeps
    its buckets, so a refresh does not hand out a new burst."""
    current = topic.publish_throttle
    if rate.unlimited:
        topic.publish_throttle = None
    elif current is None or current.rate != rate:
        topic.publish_throttle = PublishThrottle(rate, now)

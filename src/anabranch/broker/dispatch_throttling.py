"""Which dispatch rates a topic takes (Pulsar's ``dispatchRate`` and
``subscriptionDispatchRate``), and putting them in force.

Each rate comes from the topic's policy, else its namespace's for this broker's cluster
(upstream keys a namespace's rates by cluster), else the broker's
``dispatch_throttling_rate_per_topic_in_*`` / ``_per_subscription_in_*``. A partition
takes its partitioned topic's policy, a segment its scalable topic's. The topic's rate is
shared by all its subscriptions; the subscription rate is each subscription's own.
``core/dispatch_rate.py`` does the accounting; the dispatchers of persistent topics ask it
before each read (a non-persistent topic's messages are not held back, as upstream's).

Example:
    >>> from anabranch.broker.config import BrokerConfig
    >>> ns = NamespacePolicies(subscription_dispatch_rate={
    ...     "standalone": DispatchRateRecord(dispatch_throttling_rate_in_msg=50)})
    >>> dispatch_rates_of(BrokerConfig(), ns, None)
    DispatchRates(topic=DispatchRate(messages=0, bytes=0, period_s=1), subscription=DispatchRate(messages=50, bytes=-1, period_s=1))
"""  # noqa: E501 (a doctest's output is one line)

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from anabranch.broker.config import BrokerConfig
from anabranch.broker.policies import DispatchRateRecord, NamespacePolicies
from anabranch.broker.topic_policies import TopicPolicies
from anabranch.core.dispatch_rate import DispatchRate, DispatchThrottle


@dataclass(frozen=True, slots=True)
class DispatchRates:
    """A topic's rates in force: its own (all subscriptions) and each subscription's."""

    topic: DispatchRate
    subscription: DispatchRate


def dispatch_rates_of(
    config: BrokerConfig, namespace: NamespacePolicies, topic: TopicPolicies | None
) -> DispatchRates:
    """The rates in force (see the module docstring)."""
    cluster = config.cluster_name
    topic_record = None if topic is None else topic.dispatch_rate
    if topic_record is None:
        topic_record = namespace.topic_dispatch_rate.get(cluster)
    sub_record = None if topic is None else topic.subscription_dispatch_rate
    if sub_record is None:
        sub_record = namespace.subscription_dispatch_rate.get(cluster)
    return DispatchRates(
        as_rate(topic_record)
        if topic_record is not None
        else DispatchRate(
            config.dispatch_throttling_rate_per_topic_in_msg,
            config.dispatch_throttling_rate_per_topic_in_byte,
        ),
        as_rate(sub_record)
        if sub_record is not None
        else DispatchRate(
            config.dispatch_throttling_rate_per_subscription_in_msg,
            config.dispatch_throttling_rate_per_subscription_in_byte,
        ),
    )


def as_rate(record: DispatchRateRecord) -> DispatchRate:
    """The record's rate."""
    return DispatchRate(
        record.dispatch_throttling_rate_in_msg,
        record.dispatch_throttling_rate_in_byte,
        record.rate_period_in_second,
    )


class Throttled(Protocol):
    """A topic or subscription that takes a dispatch rate."""

    dispatch_throttle: DispatchThrottle | None


def put_in_force(holder: Throttled, rate: DispatchRate, now: float) -> None:
    """Give ``holder`` the buckets of ``rate`` (none when unlimited); the same rate keeps
    its buckets, so a refresh does not hand out a new period's quota."""
    current = holder.dispatch_throttle
    if rate.unlimited:
        holder.dispatch_throttle = None
    elif current is None or current.rate != rate:
        holder.dispatch_throttle = DispatchThrottle(rate, now)


class ThrottledTopic(Throttled, Protocol):
    """A persistent topic: its own rate, the one its subscriptions take, and those."""

    subscription_dispatch_rate: DispatchRate

    @property
    def subscriptions(self) -> Mapping[str, Throttled]: ...


def put_rates_in_force(topic: ThrottledTopic, rates: DispatchRates, now: float) -> None:
    """Give a topic and each of its subscriptions their rates (later subscriptions take
    ``subscription_dispatch_rate`` when created)."""
    put_in_force(topic, rates.topic, now)
    topic.subscription_dispatch_rate = rates.subscription
    for subscription in topic.subscriptions.values():
        put_in_force(subscription, rates.subscription, now)

"""Metadata-store paths of a scalable topic (DESIGN.md §3.4).

    /topics/{t}/{ns}/{topic}                                  the layout (ScalableTopicMetadata)
    /topics/{t}/{ns}/{topic}/controller                       ephemeral: the leader's broker URL
    /topics/{t}/{ns}/{topic}/pending-op                       a split/merge in progress
    /topics/{t}/{ns}/{topic}/sealed/{segmentId}               a sealed segment's dedup snapshot
    /topics/{t}/{ns}/{topic}/subscriptions/{sub}              a subscription
    /topics/{t}/{ns}/{topic}/subscriptions/{sub}/consumers/{name}   a durable consumer session

Example:
    >>> p = TopicPaths(TopicName.parse("topic://public/default/orders"))
    >>> p.layout, p.consumer("billing", "w1")
    ('/topics/public/default/orders', '/topics/public/default/orders/subscriptions/billing/consumers/w1')
"""  # noqa: E501

from __future__ import annotations

from dataclasses import dataclass

from anabranch.core.names import NamespaceName, TopicDomain, TopicName
from anabranch.errors import InvalidArgument

TOPICS_ROOT = "/topics"


def namespace_path(namespace: NamespaceName) -> str:
    """The parent of every scalable topic of ``namespace``.

    >>> namespace_path(NamespaceName("public", "default"))
    '/topics/public/default'
    """
    return f"{TOPICS_ROOT}/{namespace.tenant}/{namespace.namespace}"


@dataclass(frozen=True, slots=True)
class TopicPaths:
    """Every metadata path of one scalable topic."""

    topic: TopicName

    def __post_init__(self) -> None:
        if self.topic.domain is not TopicDomain.TOPIC:
            raise InvalidArgument(f"{self.topic} is not a scalable topic:// name")

    @property
    def layout(self) -> str:
        t = self.topic
        return f"{TOPICS_ROOT}/{t.tenant}/{t.namespace}/{t.local_name}"

    @property
    def controller(self) -> str:
        return f"{self.layout}/controller"

    @property
    def pending_op(self) -> str:
        return f"{self.layout}/pending-op"

    @property
    def subscriptions(self) -> str:
        return f"{self.layout}/subscriptions"

    def sealed(self, segment_id: int) -> str:
        return f"{self.layout}/sealed/{segment_id}"

    def subscription(self, name: str) -> str:
        return f"{self.subscriptions}/{name}"

    def consumers(self, subscription: str) -> str:
        return f"{self.subscription(subscription)}/consumers"

    def consumer(self, subscription: str, name: str) -> str:
        return f"{self.consumers(subscription)}/{name}"

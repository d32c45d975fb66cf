"""Metadata-store paths of a scalable topic (DESIGN.md §3.4).

    /topics/{t}/{ns}/{topic}                                  the layout (ScalableTopicMetadata)
    /topics/{t}/{ns}/{topic}/controller                       ephemeral: the leader's URLs (JSON)
    /topics/{t}/{ns}/{topic}/pending-op                       a split/merge in progress
    /topics/{t}/{ns}/{topic}/deleting                         the topic is being deleted
    /topics/{t}/{ns}/{topic}/sealed/{segmentId}               a sealed segment's dedup snapshot
    /topics/{t}/{ns}/{topic}/subscriptions/{sub}              a subscription
    /topics/{t}/{ns}/{topic}/subscriptions/{sub}/consumers/{name}   a durable consumer session

Example:
    >>> p = TopicPaths(TopicName.parse("topic://public/default/orders"))
    >>> p.layout, p.consumer("billing", "w1")
    ('/topics/public/default/orders', '/topics/public/default/orders/subscriptions/billing/consumers/w1')
"""  # noqa: E501

from __future__ import annotations

import json
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
    def deleting(self) -> str:
        """Written before a topic delete removes its segments: from then on its active
        segments may be deleted too (``check_segment_deletable``)."""
        return f"{self.layout}/deleting"

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


@dataclass(frozen=True, slots=True)
class LeaderAddress:
    """The value of a topic's ``.../controller`` key: the leader broker's addresses.

    Stored as JSON ``{"http": ..., "pulsar": ...}``: admin mutations are redirected (307)
    to ``http``; binary clients (the DAG's ``controller_broker_url``, a consumer's
    SCALABLE_TOPIC_SUBSCRIBE) go to ``pulsar``. A plain string (the older form) reads as an
    HTTP URL.

    Example:
        >>> a = LeaderAddress("http://b1:8080", "pulsar://b1:6650")
        >>> LeaderAddress.decode(a.encode()) == a, LeaderAddress.decode(b"http://x:1").pulsar
        (True, '')
    """

    http: str
    pulsar: str = ""

    def encode(self) -> bytes:
        return json.dumps({"http": self.http, "pulsar": self.pulsar}).encode()

    @classmethod
    def decode(cls, data: bytes) -> LeaderAddress:
        text = data.decode()
        if text.startswith("{"):
            try:
                doc = json.loads(text)
                return cls(str(doc.get("http") or ""), str(doc.get("pulsar") or ""))
            except (ValueError, AttributeError):
                pass
        return cls(text)

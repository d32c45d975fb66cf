"""How many producers, consumers and subscriptions one topic takes (Pulsar's
``maxProducersPerTopic``, ``maxConsumersPerTopic``, ``maxConsumersPerSubscription`` and
``maxSubscriptionsPerTopic``), and how many unacknowledged messages its Shared and
Key_Shared consumers and subscriptions hold (``maxUnackedMessagesPerConsumer``,
``maxUnackedMessagesPerSubscription``: the Shared dispatcher applies those through
``core/unacked_gate.py``).

Each cap comes from the topic's policy, else its namespace's, else the broker's setting;
0 means no cap (upstream's default for the first four). A partition takes its partitioned topic's
policy and a segment its scalable topic's, so the caps count per partition or segment, as
upstream counts per partition.

The checks are synchronous and run right where the producer, consumer or subscription is
added, after the last await of its path: two concurrent requests cannot both take the last
place. What a refusal says is upstream's: ProducerBusy "Topic reached max producers limit",
ConsumerBusy "Topic reached max consumers limit" / "Subscription reached max consumers
limit", NotAllowed "Exceed the maximum number of subscriptions of the topic". Internal
subscriptions (a ``__`` name, such as compaction's cursor) neither count nor are refused.

Example:
    >>> caps = TopicLimits(max_producers=1)
    >>> caps.check_producer("persistent://t/ns/a", producers=0)
    >>> caps.check_producer("persistent://t/ns/a", producers=1)
    Traceback (most recent call last):
    ...
    anabranch.errors.ProducerBusy: Topic 'persistent://t/ns/a' reached max producers limit (1)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from anabranch import limits
from anabranch.errors import ConsumerBusy, NotAllowed, ProducerBusy

CAP_FIELDS = (
    "max_producers_per_topic",
    "max_consumers_per_topic",
    "max_consumers_per_subscription",
    "max_subscriptions_per_topic",
    "max_unacked_messages_per_consumer",
    "max_unacked_messages_per_subscription",
)
"""The caps' names in the namespace policies and the broker's config, in field order."""


class CapLevel(Protocol):
    """Where caps are set (``NamespacePolicies``, ``BrokerConfig``); None: not here."""

    @property
    def max_producers_per_topic(self) -> int | None: ...
    @property
    def max_consumers_per_topic(self) -> int | None: ...
    @property
    def max_consumers_per_subscription(self) -> int | None: ...
    @property
    def max_subscriptions_per_topic(self) -> int | None: ...
    @property
    def max_unacked_messages_per_consumer(self) -> int | None: ...
    @property
    def max_unacked_messages_per_subscription(self) -> int | None: ...


INTERNAL_SUBSCRIPTION_PREFIX = "__"
"""Subscriptions the broker keeps for itself (``__compaction``): outside the caps."""


@dataclass(frozen=True, slots=True)
class TopicLimits:
    """The caps in force on one topic (0: none); see the module docstring."""

    max_producers: int = 0
    max_consumers: int = 0
    max_consumers_per_subscription: int = 0
    max_subscriptions: int = 0
    max_unacked_per_consumer: int = 0
    max_unacked_per_subscription: int = 0

    @classmethod
    def resolve(cls, *levels: CapLevel) -> TopicLimits:
        """The first set value of each cap, levels from the policies in force (a topic's
        over its namespace's) down to the broker's config: they name the caps alike.

        Example:
            >>> from types import SimpleNamespace as Level
            >>> unset = dict.fromkeys(CAP_FIELDS)
            >>> policy = Level(**{**unset, "max_producers_per_topic": 2})
            >>> config = Level(**{**dict.fromkeys(CAP_FIELDS, 0), "max_consumers_per_topic": 3})
            >>> limits = TopicLimits.resolve(policy, config)
            >>> limits.max_producers, limits.max_consumers, limits.max_subscriptions
            (2, 3, 0)
        """

        def first(field: str) -> int:
            # A cap no level sets is no cap.
            return next((v for v in (getattr(lv, field) for lv in levels) if v is not None), 0)

        return cls(*(first(field) for field in CAP_FIELDS))

    @property
    def consumer_unacked_cap(self) -> int:
        """A Shared or Key_Shared consumer's cap on unacknowledged messages: its policy's
        within ``limits.CONSUMER_UNACKED_MESSAGES_MAX``, which is also the cap of "no cap".

        Example:
            >>> TopicLimits(max_unacked_per_consumer=10).consumer_unacked_cap
            10
            >>> NO_LIMITS.consumer_unacked_cap == limits.CONSUMER_UNACKED_MESSAGES_MAX
            True
        """
        ceiling = limits.CONSUMER_UNACKED_MESSAGES_MAX
        cap = self.max_unacked_per_consumer
        return min(cap, ceiling) if cap > 0 else ceiling

    def check_producer(self, topic: str, *, producers: int) -> None:
        """Raise ProducerBusy when ``producers`` (connected or waiting) fill the cap."""
        if self.max_producers and producers >= self.max_producers:
            raise ProducerBusy(
                f"Topic '{topic}' reached max producers limit ({self.max_producers})"
            )

    def check_consumer(self, subscription: str, *, on_topic: int, on_subscription: int) -> None:
        """Raise ConsumerBusy when one more consumer would pass the topic's or the
        subscription's cap (``on_*``: consumers there now)."""
        if subscription.startswith(INTERNAL_SUBSCRIPTION_PREFIX):
            return
        if self.max_consumers and on_topic >= self.max_consumers:
            raise ConsumerBusy(f"Topic reached max consumers limit ({self.max_consumers})")
        cap = self.max_consumers_per_subscription
        if cap and on_subscription >= cap:
            raise ConsumerBusy(f"Subscription reached max consumers limit ({cap})")

    def check_new_subscription(self, topic: str, name: str, *, existing: Iterable[str]) -> None:
        """Raise NotAllowed when a new subscription ``name`` would pass the cap
        (``existing``: the names there now, and those being created)."""
        if not self.max_subscriptions or name.startswith(INTERNAL_SUBSCRIPTION_PREFIX):
            return
        count = sum(1 for n in existing if not n.startswith(INTERNAL_SUBSCRIPTION_PREFIX))
        if count >= self.max_subscriptions:
            raise NotAllowed(
                f"Exceed the maximum number of subscriptions of the topic: {topic} "
                f"({self.max_subscriptions})"
            )


NO_LIMITS = TopicLimits()
"""No cap (internal callers, and a broker, namespace and topic that set none)."""

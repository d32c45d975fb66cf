"""When an unused topic is deleted (Pulsar's inactive-topic policies), and an unused
subscription expires (its ``subscriptionExpirationTimeMinutes``), as pure decisions.

A topic is *in use* while it has a producer or a consumer, or an open transaction wrote
to it, and, by the mode: ``delete_when_no_subscriptions`` while it has any subscription;
``delete_when_subscriptions_caught_up`` while a subscription has messages left to
acknowledge. A topic not in use for ``max_inactive_s`` (measured from the last time it
was seen in use) is deleted, with its data and subscriptions, when the policy in force
says ``delete_while_inactive``.

A durable subscription expires once it had no consumer for the expiration time (0: never),
unless a transaction still holds acknowledgements on it.

Example:
    >>> policy = InactivePolicy(True, DeleteMode.NO_SUBSCRIPTIONS, max_inactive_s=60)
    >>> idle = TopicUsage(producers=0, consumers=0, subscriptions=0, backlog=0)
    >>> in_use(idle, policy.mode), due(policy, last_in_use_s=100.0, now_s=170.0)
    (False, True)
    >>> in_use(TopicUsage(0, 0, subscriptions=1, backlog=0), policy.mode)
    True
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DeleteMode(enum.StrEnum):
    """Pulsar's ``InactiveTopicDeleteMode`` (the values are its JSON names)."""

    NO_SUBSCRIPTIONS = "delete_when_no_subscriptions"
    SUBSCRIPTIONS_CAUGHT_UP = "delete_when_subscriptions_caught_up"


@dataclass(frozen=True, slots=True)
class InactivePolicy:
    """The policy in force on one topic."""

    delete_while_inactive: bool
    mode: DeleteMode
    max_inactive_s: float


@dataclass(frozen=True, slots=True)
class TopicUsage:
    """What a topic has now (internal subscriptions, such as compaction's, left out)."""

    producers: int
    consumers: int
    subscriptions: int
    backlog: int
    """Messages left to acknowledge, over every subscription."""
    open_transactions: int = 0


def in_use(usage: TopicUsage, mode: DeleteMode) -> bool:
    """Whether the topic counts as used now (see the module docstring)."""
    if usage.producers or usage.consumers or usage.open_transactions:
        return True
    if mode is DeleteMode.NO_SUBSCRIPTIONS:
        return usage.subscriptions > 0
    return usage.backlog > 0


def due(policy: InactivePolicy, *, last_in_use_s: float, now_s: float) -> bool:
    """Whether a topic unused since ``last_in_use_s`` is to be deleted at ``now_s``."""
    return policy.delete_while_inactive and now_s - last_in_use_s >= policy.max_inactive_s


@dataclass(frozen=True, slots=True)
class SubscriptionUsage:
    """What a durable subscription has now."""

    consumers: int
    open_transactions: int
    last_active_s: float
    """When a consumer last came or left (or the subscription was loaded)."""


def subscription_expired(usage: SubscriptionUsage, *, expiration_s: float, now_s: float) -> bool:
    """Whether the subscription is to be deleted (``expiration_s`` 0: never).

    Example:
        >>> idle = SubscriptionUsage(consumers=0, open_transactions=0, last_active_s=0.0)
        >>> subscription_expired(idle, expiration_s=600, now_s=599.0)
        False
        >>> subscription_expired(idle, expiration_s=600, now_s=600.0)
        True
    """
    if expiration_s <= 0 or usage.consumers or usage.open_transactions:
        return False
    return now_s - usage.last_active_s >= expiration_s

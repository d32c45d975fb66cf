"""Pulsar admin v2 routes of the per-topic caps (``broker/topic_limits.py`` enforces them)::

    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/maxProducersPerTopic
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/maxConsumersPerTopic
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/maxConsumersPerSubscription
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/maxSubscriptionsPerTopic
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/maxUnackedMessagesPerConsumer
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/maxUnackedMessagesPerSubscription
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/maxProducers
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/maxConsumers
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/maxConsumersPerSubscription
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/maxSubscriptionsPerTopic
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/maxUnackedMessagesOnConsumer
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/maxUnackedMessagesOnSubscription

The body is an integer from 0 (no cap) to 2^31 - 1; another answers 412, as upstream. A GET of
an unset cap answers ``null``; a topic's ``?applied=true`` answers the cap in force, its
namespace's or the broker's included. A change applies to the next producer, consumer or
subscription; the ones already there stay, but for a subscription's cap on unacknowledged
messages, which its subscription takes up within ``publish_rate_refresh_interval_s`` (a
consumer keeps the cap it subscribed with, as upstream's).

Example:
    >>> sorted({r.path.rsplit("/", 1)[1] for r in ROUTES})[:3]
    ['maxConsumers', 'maxConsumersPerSubscription', 'maxConsumersPerTopic']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from anabranch.admin.routes import (
    INT32_MAX,
    Route,
    applied_policies,
    flag,
    json_body,
    namespace_param,
    policy_topic,
    set_namespace_fields,
    set_topic_fields,
)
from anabranch.errors import InvalidPolicyValue

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

NS = "/admin/v2/namespaces/{tenant}/{namespace}"
TOPIC = "/admin/v2/persistent/{tenant}/{namespace}/{topic}"
INTEGER = {"type": "integer"}


@dataclass(frozen=True)
class Cap:
    """One cap: its REST names and its fields in the policy records and the config."""

    namespace_route: str
    topic_route: str
    field: str
    """The field of NamespacePolicies and of BrokerConfig."""
    topic_field: str
    """The field of TopicPolicies."""
    what: str


CAPS = (
    Cap("maxProducersPerTopic", "maxProducers", "max_producers_per_topic", "max_producers",
        "producers per topic"),
    Cap("maxConsumersPerTopic", "maxConsumers", "max_consumers_per_topic", "max_consumers",
        "consumers per topic"),
    Cap("maxConsumersPerSubscription", "maxConsumersPerSubscription",
        "max_consumers_per_subscription", "max_consumers_per_subscription",
        "consumers per subscription"),
    Cap("maxSubscriptionsPerTopic", "maxSubscriptionsPerTopic", "max_subscriptions_per_topic",
        "max_subscriptions", "subscriptions per topic"),
    Cap("maxUnackedMessagesPerConsumer", "maxUnackedMessagesOnConsumer",
        "max_unacked_messages_per_consumer", "max_unacked_on_consumer",
        "unacknowledged messages per consumer"),
    Cap("maxUnackedMessagesPerSubscription", "maxUnackedMessagesOnSubscription",
        "max_unacked_messages_per_subscription", "max_unacked_on_subscription",
        "unacknowledged messages per subscription"),
)  # fmt: skip


async def _value(request: web.Request, cap: Cap) -> int:
    value = await json_body(request, int, cap.namespace_route, None)
    if value is None:
        raise InvalidPolicyValue(f"the body must be the number of {cap.what} (0: no cap)")
    if not 0 <= value <= INT32_MAX:  # upstream's field is a Java int
        raise InvalidPolicyValue(f"{cap.namespace_route} must be 0 to {INT32_MAX}")
    return int(value)


def _namespace_routes(cap: Cap) -> list[Route]:
    async def get(admin: AdminService, request: web.Request) -> object:
        policies = await admin.policies.namespace_policies(namespace_param(request))
        return getattr(policies, cap.field)

    async def set_(admin: AdminService, request: web.Request) -> object:
        await set_namespace_fields(admin, request, **{cap.field: await _value(request, cap)})
        return None

    async def remove(admin: AdminService, request: web.Request) -> object:
        await set_namespace_fields(admin, request, **{cap.field: None})
        return None

    path = f"{NS}/{cap.namespace_route}"
    return [
        Route("GET", path, get, f"A namespace's cap on {cap.what} (null when unset).",
              "namespaces", response_schema=INTEGER),
        Route("POST", path, set_, f"Set a namespace's cap on {cap.what} (0: none).",
              "namespaces", request_schema=INTEGER, errors=(400, 404, 412)),
        Route("DELETE", path, remove, f"Remove a namespace's cap on {cap.what}.", "namespaces"),
    ]  # fmt: skip


def _topic_routes(cap: Cap) -> list[Route]:
    async def get(admin: AdminService, request: web.Request) -> object:
        topic = await policy_topic(admin, request)
        if flag(request, "applied"):
            value = getattr(await applied_policies(admin, topic), cap.field)
            return value if value is not None else getattr(admin.broker.config, cap.field)
        return getattr(await admin.broker.topic_policies.get(topic), cap.topic_field)

    async def set_(admin: AdminService, request: web.Request) -> object:
        await set_topic_fields(admin, request, **{cap.topic_field: await _value(request, cap)})
        return None

    async def remove(admin: AdminService, request: web.Request) -> object:
        await set_topic_fields(admin, request, **{cap.topic_field: None})
        return None

    path = f"{TOPIC}/{cap.topic_route}"
    return [
        Route("GET", path, get, f"A topic's cap on {cap.what} (?applied=true: in force).",
              "persistent", response_schema=INTEGER, query=("applied",), errors=(404,)),
        Route("POST", path, set_, f"Override the cap on {cap.what} for a topic (0: none).",
              "persistent", request_schema=INTEGER, errors=(400, 404, 412)),
        Route("DELETE", path, remove, f"Remove a topic's cap on {cap.what}.", "persistent",
              errors=(404,)),
    ]  # fmt: skip


ROUTES: list[Route] = [
    route for cap in CAPS for route in (*_namespace_routes(cap), *_topic_routes(cap))
]

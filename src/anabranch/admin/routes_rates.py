"""Pulsar admin v2 routes of the rate limits (``broker/publish_throttling.py``,
``broker/dispatch_throttling.py``)::

    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/publishRate
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/dispatchRate
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/subscriptionDispatchRate
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/subscribeRate
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/publishRate
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/dispatchRate
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/subscriptionDispatchRate
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/subscribeRate

The bodies are upstream's: ``{"publishThrottlingRateInMsg": N,
"publishThrottlingRateInByte": N}`` and ``{"dispatchThrottlingRateInMsg": N,
"dispatchThrottlingRateInByte": N, "ratePeriodInSecond": N, "relativeToPublishRate":
false}`` and ``{"subscribeThrottlingRatePerConsumer": N, "ratePeriodInSecond": N}`` (-1: no
limit; a rate relative to the publish rate is not supported: 412). A
namespace's rate is this broker's cluster's (upstream keys them by cluster). A GET of an
unset rate answers ``null``; a topic's ``?applied=true`` answers the rate in force, the
broker's settings included. A change applies at once to the topics this broker serves,
within ``publish_rate_refresh_interval_s`` on the others.

Example:
    >>> sorted({r.path.rsplit("/", 1)[1] for r in ROUTES})
    ['dispatchRate', 'publishRate', 'subscribeRate', 'subscriptionDispatchRate']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from anabranch.admin.routes import (
    INT32_MAX,
    Route,
    flag,
    json_body,
    namespace_param,
    policy_topic,
    set_topic_fields,
)
from anabranch.broker.config import BrokerConfig
from anabranch.broker.dispatch_throttling import dispatch_rates_of
from anabranch.broker.policies import (
    DispatchRateRecord,
    NamespacePolicies,
    PublishRateRecord,
    SubscribeRateRecord,
)
from anabranch.broker.publish_throttling import publish_rate_of
from anabranch.broker.subscribe_throttling import subscribe_rate_of
from anabranch.broker.topic_policies import TopicPolicies
from anabranch.core.dispatch_rate import DispatchRate
from anabranch.errors import InvalidPolicyValue

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

NS = "/admin/v2/namespaces/{tenant}/{namespace}"
TOPIC = "/admin/v2/persistent/{tenant}/{namespace}/{topic}"
INT64_MAX = 2**63 - 1
INTEGER = {"type": "integer"}
PUBLISH_RATE = {
    "type": "object",
    "properties": {
        "publishThrottlingRateInMsg": INTEGER,
        "publishThrottlingRateInByte": INTEGER,
    },
}
SUBSCRIBE_RATE = {
    "type": "object",
    "properties": {
        "subscribeThrottlingRatePerConsumer": INTEGER,
        "ratePeriodInSecond": INTEGER,
    },
}
DISPATCH_RATE = {
    "type": "object",
    "properties": {
        "dispatchThrottlingRateInMsg": INTEGER,
        "dispatchThrottlingRateInByte": INTEGER,
        "ratePeriodInSecond": INTEGER,
        "relativeToPublishRate": {"type": "boolean"},
    },
}

Applied = Callable[[BrokerConfig, NamespacePolicies, TopicPolicies | None], Any]


@dataclass(frozen=True)
class RateKind:
    """One rate: its REST name, record type, fields and how the one in force is found."""

    route: str
    record: type[PublishRateRecord] | type[DispatchRateRecord] | type[SubscribeRateRecord]
    namespace_field: str
    """The field of NamespacePolicies (records keyed by cluster)."""
    topic_field: str
    """The field of TopicPolicies."""
    applied: Applied
    what: str
    schema: dict[str, Any]


def _no_limit(value: int) -> int:
    return value if value > 0 else -1


def _applied_publish(config: BrokerConfig, ns: NamespacePolicies, own: TopicPolicies | None) -> Any:
    rate = publish_rate_of(config, ns, own)
    return PublishRateRecord(
        publish_throttling_rate_in_msg=_no_limit(rate.messages),
        publish_throttling_rate_in_byte=_no_limit(rate.bytes),
    )


def _applied_subscribe(
    config: BrokerConfig, ns: NamespacePolicies, own: TopicPolicies | None
) -> Any:
    rate = subscribe_rate_of(config, ns, own)
    return SubscribeRateRecord(
        subscribe_throttling_rate_per_consumer=_no_limit(rate.per_consumer),
        rate_period_in_second=rate.period_s,
    )


def _dispatch_record(rate: DispatchRate) -> DispatchRateRecord:
    return DispatchRateRecord(
        dispatch_throttling_rate_in_msg=_no_limit(rate.messages),
        dispatch_throttling_rate_in_byte=_no_limit(rate.bytes),
        rate_period_in_second=rate.period_s,
    )


KINDS = (
    RateKind("publishRate", PublishRateRecord, "publish_max_message_rate", "publish_rate",
             _applied_publish, "publish rate", PUBLISH_RATE),
    RateKind("dispatchRate", DispatchRateRecord, "topic_dispatch_rate", "dispatch_rate",
             lambda c, n, o: _dispatch_record(dispatch_rates_of(c, n, o).topic),
             "dispatch rate per topic", DISPATCH_RATE),
    RateKind("subscriptionDispatchRate", DispatchRateRecord, "subscription_dispatch_rate",
             "subscription_dispatch_rate",
             lambda c, n, o: _dispatch_record(dispatch_rates_of(c, n, o).subscription),
             "dispatch rate per subscription", DISPATCH_RATE),
    RateKind("subscribeRate", SubscribeRateRecord, "cluster_subscribe_rate", "subscribe_rate",
             _applied_subscribe, "subscribe rate per consumer", SUBSCRIBE_RATE),
)  # fmt: skip


def _check(value: PublishRateRecord | DispatchRateRecord | SubscribeRateRecord) -> None:
    """Upstream's ranges (Java ints, byte rates longs); -1 is no limit."""
    if isinstance(value, SubscribeRateRecord):
        if not -1 <= value.subscribe_throttling_rate_per_consumer <= INT32_MAX:
            raise InvalidPolicyValue(
                f"subscribeThrottlingRatePerConsumer must be -1 to {INT32_MAX}"
            )
        if not 1 <= value.rate_period_in_second <= INT32_MAX:
            raise InvalidPolicyValue(f"ratePeriodInSecond must be 1 to {INT32_MAX}")
        return
    if isinstance(value, PublishRateRecord):
        prefix = "publishThrottlingRate"
        limits = (value.publish_throttling_rate_in_msg, value.publish_throttling_rate_in_byte)
    else:
        prefix = "dispatchThrottlingRate"
        limits = (value.dispatch_throttling_rate_in_msg, value.dispatch_throttling_rate_in_byte)
        if not 1 <= value.rate_period_in_second <= INT32_MAX:
            raise InvalidPolicyValue(f"ratePeriodInSecond must be 1 to {INT32_MAX}")
        if value.relative_to_publish_rate:
            raise InvalidPolicyValue("relativeToPublishRate is not supported")
    if not -1 <= limits[0] <= INT32_MAX:
        raise InvalidPolicyValue(f"{prefix}InMsg must be -1 to {INT32_MAX}")
    if not -1 <= limits[1] <= INT64_MAX:
        raise InvalidPolicyValue(f"{prefix}InByte must be -1 to {INT64_MAX}")


async def _body(request: web.Request, kind: RateKind) -> Any:
    value: Any = await json_body(request, kind.record, kind.route, None)
    if value is None:
        raise InvalidPolicyValue(f"the body must be the {kind.what}")
    _check(value)
    return value


def _out(value: object) -> object:
    return None if value is None else msgspec.to_builtins(value)


async def _changed(admin: AdminService) -> None:
    # At once on this broker's topics; other brokers refresh on their own.
    await admin.broker.sweeps.sweep_rates()


def _namespace_routes(kind: RateKind) -> list[Route]:
    async def get(admin: AdminService, request: web.Request) -> object:
        policies = await admin.policies.namespace_policies(namespace_param(request))
        rates = getattr(policies, kind.namespace_field)
        return _out(rates.get(admin.broker.config.cluster_name))

    async def update(admin: AdminService, request: web.Request, value: object) -> None:
        cluster = admin.broker.config.cluster_name

        def change(p: NamespacePolicies) -> NamespacePolicies:
            rates = {k: v for k, v in getattr(p, kind.namespace_field).items() if k != cluster}
            if value is not None:
                rates[cluster] = value
            return msgspec.structs.replace(p, **{kind.namespace_field: rates})

        await admin.policies.update_namespace_policies(namespace_param(request), change)
        await _changed(admin)

    async def set_(admin: AdminService, request: web.Request) -> object:
        await update(admin, request, await _body(request, kind))
        return None

    async def remove(admin: AdminService, request: web.Request) -> object:
        await update(admin, request, None)
        return None

    path = f"{NS}/{kind.route}"
    return [
        Route("GET", path, get, f"A namespace's {kind.what} (null: unset).", "namespaces",
              response_schema=kind.schema),
        Route("POST", path, set_, f"Set a namespace's {kind.what}.", "namespaces",
              request_schema=kind.schema, errors=(400, 404, 412)),
        Route("DELETE", path, remove, f"Remove a namespace's {kind.what}.", "namespaces"),
    ]  # fmt: skip


def _topic_routes(kind: RateKind) -> list[Route]:
    async def get(admin: AdminService, request: web.Request) -> object:
        topic = await policy_topic(admin, request)
        if flag(request, "applied"):
            namespace, own = await admin.broker.policy_levels(topic)
            return _out(kind.applied(admin.broker.config, namespace, own))
        own = await admin.broker.topic_policies.get(topic)
        return _out(getattr(own, kind.topic_field))

    async def set_(admin: AdminService, request: web.Request) -> object:
        await set_topic_fields(admin, request, **{kind.topic_field: await _body(request, kind)})
        await _changed(admin)
        return None

    async def remove(admin: AdminService, request: web.Request) -> object:
        await set_topic_fields(admin, request, **{kind.topic_field: None})
        await _changed(admin)
        return None

    path = f"{TOPIC}/{kind.route}"
    return [
        Route("GET", path, get, f"A topic's {kind.what} (?applied=true: in force).",
              "persistent", response_schema=kind.schema, query=("applied",), errors=(404,)),
        Route("POST", path, set_, f"Set a topic's {kind.what}.", "persistent",
              request_schema=kind.schema, errors=(400, 404, 412)),
        Route("DELETE", path, remove, f"Remove a topic's {kind.what}.", "persistent",
              errors=(404,)),
    ]  # fmt: skip


ROUTES: list[Route] = [
    route for kind in KINDS for route in (*_namespace_routes(kind), *_topic_routes(kind))
]

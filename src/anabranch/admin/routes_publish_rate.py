"""Pulsar admin v2 routes of the publish rate (``broker/publish_throttling.py``)::

    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/publishRate
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/publishRate

The body is upstream's ``{"publishThrottlingRateInMsg": N, "publishThrottlingRateInByte":
N}`` (-1: no limit). A namespace's rate is this broker's cluster's (upstream keys them by
cluster). A GET of an unset rate answers ``null``; a topic's ``?applied=true`` answers the
rate in force, the broker's settings included. A change applies at once to the topics this
broker serves, within ``publish_rate_refresh_interval_s`` on the others.

Example:
    >>> sorted({(r.method, r.path.split("/")[3]) for r in ROUTES})[:2]
    [('DELETE', 'namespaces'), ('DELETE', 'persistent')]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
from anabranch.broker.policies import NamespacePolicies, PublishRateRecord
from anabranch.broker.publish_throttling import publish_rate_of
from anabranch.broker.topic_policies import TopicPolicyStore
from anabranch.errors import InvalidPolicyValue

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

NS = "/admin/v2/namespaces/{tenant}/{namespace}/publishRate"
TOPIC = "/admin/v2/persistent/{tenant}/{namespace}/{topic}/publishRate"
RATE = {
    "type": "object",
    "properties": {
        "publishThrottlingRateInMsg": {"type": "integer"},
        "publishThrottlingRateInByte": {"type": "integer"},
    },
}
INT64_MAX = 2**63 - 1


async def _body(request: web.Request) -> PublishRateRecord:
    value: PublishRateRecord | None = await json_body(
        request, PublishRateRecord, "publishRate", None
    )
    if value is None:
        raise InvalidPolicyValue("the body must be the publish rate")
    if not -1 <= value.publish_throttling_rate_in_msg <= INT32_MAX:
        raise InvalidPolicyValue(f"publishThrottlingRateInMsg must be -1 to {INT32_MAX}")
    if not -1 <= value.publish_throttling_rate_in_byte <= INT64_MAX:
        raise InvalidPolicyValue(f"publishThrottlingRateInByte must be -1 to {INT64_MAX}")
    return value


def _out(value: PublishRateRecord | None) -> object:
    return None if value is None else msgspec.to_builtins(value)


async def _changed(admin: AdminService) -> None:
    # At once on this broker's topics; other brokers refresh on their own.
    await admin.broker.sweeps.sweep_publish_rates()


async def get_namespace(admin: AdminService, request: web.Request) -> object:
    policies = await admin.policies.namespace_policies(namespace_param(request))
    return _out(policies.publish_max_message_rate.get(admin.broker.config.cluster_name))


async def _update_namespace(
    admin: AdminService, request: web.Request, value: PublishRateRecord | None
) -> None:
    cluster = admin.broker.config.cluster_name

    def change(p: NamespacePolicies) -> NamespacePolicies:
        rates = {k: v for k, v in p.publish_max_message_rate.items() if k != cluster}
        if value is not None:
            rates[cluster] = value
        return msgspec.structs.replace(p, publish_max_message_rate=rates)

    await admin.policies.update_namespace_policies(namespace_param(request), change)
    await _changed(admin)


async def set_namespace(admin: AdminService, request: web.Request) -> object:
    await _update_namespace(admin, request, await _body(request))
    return None


async def remove_namespace(admin: AdminService, request: web.Request) -> object:
    await _update_namespace(admin, request, None)
    return None


async def get_topic(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    if flag(request, "applied"):
        namespace, own = await admin.broker.policy_levels(topic)
        rate = publish_rate_of(admin.broker.config, namespace, own)
        return _out(
            PublishRateRecord(
                publish_throttling_rate_in_msg=rate.messages if rate.messages > 0 else -1,
                publish_throttling_rate_in_byte=rate.bytes if rate.bytes > 0 else -1,
            )
        )
    return _out((await TopicPolicyStore(admin.broker.store).get(topic)).publish_rate)


async def set_topic(admin: AdminService, request: web.Request) -> object:
    await set_topic_fields(admin, request, publish_rate=await _body(request))
    await _changed(admin)
    return None


async def remove_topic(admin: AdminService, request: web.Request) -> object:
    await set_topic_fields(admin, request, publish_rate=None)
    await _changed(admin)
    return None


ROUTES: list[Route] = [
    Route("GET", NS, get_namespace, "A namespace's publish rate (null: unset).", "namespaces",
          response_schema=RATE),
    Route("POST", NS, set_namespace, "Set a namespace's publish rate per topic.", "namespaces",
          request_schema=RATE, errors=(400, 404, 412)),
    Route("DELETE", NS, remove_namespace, "Remove a namespace's publish rate.", "namespaces"),
    Route("GET", TOPIC, get_topic, "A topic's publish rate (?applied=true: in force).",
          "persistent", response_schema=RATE, query=("applied",), errors=(404,)),
    Route("POST", TOPIC, set_topic, "Set a topic's publish rate.", "persistent",
          request_schema=RATE, errors=(400, 404, 412)),
    Route("DELETE", TOPIC, remove_topic, "Remove a topic's publish rate.", "persistent",
          errors=(404,)),
]  # fmt: skip

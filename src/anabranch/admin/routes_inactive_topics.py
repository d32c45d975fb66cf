"""Pulsar admin v2 routes of the inactive-topic policies and the subscription expiration
time (``core/inactive_topics.py`` decides, the broker's sweeps delete)::

    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/inactiveTopicPolicies
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/inactiveTopicPolicies
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/subscriptionExpirationTime   minutes

The body is upstream's ``{"inactiveTopicDeleteMode": "delete_when_no_subscriptions" |
"delete_when_subscriptions_caught_up", "maxInactiveDurationSeconds": N,
"deleteWhileInactive": bool}``. A GET of an unset policy answers ``null``; a topic's
``?applied=true`` answers the policy in force, the broker's settings included. The
expiration time is an integer of minutes (0: never; unset: the broker's).

Example:
    >>> sorted({r.path.rsplit("/", 1)[1] for r in ROUTES})
    ['inactiveTopicPolicies', 'subscriptionExpirationTime']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
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
from anabranch.broker.policies import InactiveTopicPoliciesRecord
from anabranch.broker.retention import inactive_policy_of
from anabranch.core.inactive_topics import DeleteMode
from anabranch.errors import InvalidPolicyValue

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

EXPIRY = "/admin/v2/namespaces/{tenant}/{namespace}/subscriptionExpirationTime"
NS = "/admin/v2/namespaces/{tenant}/{namespace}/inactiveTopicPolicies"
TOPIC = "/admin/v2/persistent/{tenant}/{namespace}/{topic}/inactiveTopicPolicies"
POLICY = {
    "type": "object",
    "properties": {
        "inactiveTopicDeleteMode": {"type": "string", "enum": [m.value for m in DeleteMode]},
        "maxInactiveDurationSeconds": {"type": "integer"},
        "deleteWhileInactive": {"type": "boolean"},
    },
}


async def _body(request: web.Request) -> InactiveTopicPoliciesRecord:
    value: InactiveTopicPoliciesRecord | None = await json_body(
        request, InactiveTopicPoliciesRecord, "inactiveTopicPolicies", None
    )
    if value is None:
        raise InvalidPolicyValue("the body must be the inactive topic policies")
    if value.inactive_topic_delete_mode not in {m.value for m in DeleteMode}:
        raise InvalidPolicyValue(
            f"inactiveTopicDeleteMode {value.inactive_topic_delete_mode!r} is not one of "
            + ", ".join(m.value for m in DeleteMode)
        )
    if not 0 <= value.max_inactive_duration_seconds <= INT32_MAX:  # a Java int upstream
        raise InvalidPolicyValue(f"maxInactiveDurationSeconds must be 0 to {INT32_MAX}")
    return value


def _out(value: InactiveTopicPoliciesRecord | None) -> object:
    return None if value is None else msgspec.to_builtins(value)


async def get_namespace(admin: AdminService, request: web.Request) -> object:
    policies = await admin.policies.namespace_policies(namespace_param(request))
    return _out(policies.inactive_topic_policies)


async def set_namespace(admin: AdminService, request: web.Request) -> object:
    await set_namespace_fields(admin, request, inactive_topic_policies=await _body(request))
    return None


async def remove_namespace(admin: AdminService, request: web.Request) -> object:
    await set_namespace_fields(admin, request, inactive_topic_policies=None)
    return None


async def get_topic(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    if flag(request, "applied"):
        policy = inactive_policy_of(admin.broker.config, await applied_policies(admin, topic))
        return _out(
            InactiveTopicPoliciesRecord(
                inactive_topic_delete_mode=policy.mode.value,
                max_inactive_duration_seconds=int(policy.max_inactive_s),
                delete_while_inactive=policy.delete_while_inactive,
            )
        )
    return _out((await admin.broker.topic_policies.get(topic)).inactive_topic_policies)


async def set_topic(admin: AdminService, request: web.Request) -> object:
    await set_topic_fields(admin, request, inactive_topic_policies=await _body(request))
    return None


async def remove_topic(admin: AdminService, request: web.Request) -> object:
    await set_topic_fields(admin, request, inactive_topic_policies=None)
    return None


async def get_expiry(admin: AdminService, request: web.Request) -> object:
    policies = await admin.policies.namespace_policies(namespace_param(request))
    return policies.subscription_expiration_time_minutes


async def set_expiry(admin: AdminService, request: web.Request) -> object:
    minutes = await json_body(request, int, "subscriptionExpirationTime", None)
    if minutes is None or not 0 <= minutes <= INT32_MAX:
        raise InvalidPolicyValue(f"the expiration time must be minutes, 0 to {INT32_MAX}")
    await set_namespace_fields(admin, request, subscription_expiration_time_minutes=minutes)
    return None


async def remove_expiry(admin: AdminService, request: web.Request) -> object:
    await set_namespace_fields(admin, request, subscription_expiration_time_minutes=None)
    return None


ROUTES: list[Route] = [
    Route("GET", NS, get_namespace, "A namespace's inactive topic policies (null: unset).",
          "namespaces", response_schema=POLICY),
    Route("POST", NS, set_namespace, "Set a namespace's inactive topic policies.", "namespaces",
          request_schema=POLICY, errors=(400, 404, 412)),
    Route("DELETE", NS, remove_namespace, "Remove a namespace's inactive topic policies.",
          "namespaces"),
    Route("GET", TOPIC, get_topic, "A topic's inactive topic policies (?applied=true: in force).",
          "persistent", response_schema=POLICY, query=("applied",), errors=(404,)),
    Route("POST", TOPIC, set_topic, "Override the inactive topic policies for a topic.",
          "persistent", request_schema=POLICY, errors=(400, 404, 412)),
    Route("DELETE", TOPIC, remove_topic, "Remove a topic's inactive topic policies.",
          "persistent", errors=(404,)),
    Route("GET", EXPIRY, get_expiry, "A namespace's subscription expiration time in minutes.",
          "namespaces", response_schema={"type": "integer"}),
    Route("POST", EXPIRY, set_expiry, "Set a namespace's subscription expiration time "
          "(minutes; 0: never).", "namespaces", request_schema={"type": "integer"},
          errors=(400, 404, 412)),
    Route("DELETE", EXPIRY, remove_expiry, "Remove a namespace's subscription expiration time.",
          "namespaces"),
]  # fmt: skip

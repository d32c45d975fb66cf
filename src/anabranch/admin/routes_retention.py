"""Pulsar admin v2 retention routes: retention, message TTL and backlog quotas per namespace.

Paths and bodies are upstream's (``pulsar-admin namespaces set-retention`` and friends):

    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/retention     {"retentionTimeInMinutes",
                                                                 "retentionSizeInMB"}
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/messageTTL    seconds (an integer body)
    POST/DELETE     /admin/v2/namespaces/{t}/{ns}/backlogQuota  {"limitSize", "limitTime",
                    ?backlogQuotaType=destination_storage|message_age   "policy"}
    GET             /admin/v2/namespaces/{t}/{ns}/backlogQuotaMap

The same five paths under ``/admin/v2/persistent/{t}/{ns}/{topic}`` set topic-level
overrides (a partitioned topic's apply to its partitions); the topic's ``messageTTL`` also
takes Pulsar's ``?messageTTL=N`` query form. A GET of a topic policy answers the override
(``null`` when unset), or with ``?applied=true`` the value in force.

A GET of a policy the namespace does not set answers the broker's default (retention) or
``null`` (TTL). -1 means unbounded; 0 means none (retention) or off (TTL).

Example:
    >>> sorted({r.path.rsplit("/", 1)[1] for r in ROUTES})
    ['backlogQuota', 'backlogQuotaMap', 'messageTTL', 'retention']
    >>> len(ROUTES)
    18
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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
)
from anabranch.broker.policies import BacklogQuotaRecord, NamespacePolicies, RetentionPolicies
from anabranch.broker.retention import retention_of
from anabranch.broker.topic_policies import TopicPolicies
from anabranch.core.retention import (
    BacklogPolicy,
    BacklogQuota,
    BacklogQuotaType,
    quota_fits_retention,
)
from anabranch.errors import InvalidArgument, QuotaExceedsRetention

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

NS = "/admin/v2/namespaces/{tenant}/{namespace}"
TOPIC = "/admin/v2/persistent/{tenant}/{namespace}/{topic}"
INTEGER = {"type": "integer"}
RETENTION = {
    "type": "object",
    "properties": {"retentionTimeInMinutes": INTEGER, "retentionSizeInMB": INTEGER},
}
QUOTA = {
    "type": "object",
    "properties": {
        "limitSize": INTEGER,
        "limitTime": INTEGER,
        "policy": {"type": "string", "enum": [p.value for p in BacklogPolicy]},
    },
}
QUOTA_MAP = {"type": "object", "additionalProperties": QUOTA}


def check_retention(value: RetentionPolicies) -> RetentionPolicies:
    """InvalidArgument unless both bounds are -1 or >= 0.

    Example:
        >>> check_retention(RetentionPolicies(retention_time_in_minutes=-2))
        Traceback (most recent call last):
        ...
        anabranch.errors.InvalidArgument: retention time and size must be -1 (unbounded) or >= 0
    """
    if value.retention_time_in_minutes < -1 or value.retention_size_in_mb < -1:
        raise InvalidArgument("retention time and size must be -1 (unbounded) or >= 0")
    if value.retention_time_in_minutes > INT32_MAX:  # a Java int upstream
        raise InvalidArgument(f"retentionTimeInMinutes must be at most {INT32_MAX}")
    return value


def check_quota(value: BacklogQuotaRecord) -> BacklogQuotaRecord:
    """InvalidArgument for an unknown policy or a limit below -1."""
    if value.policy not in {p.value for p in BacklogPolicy}:
        raise InvalidArgument(f"unknown backlog quota policy {value.policy!r}")
    if value.limit_size < -1 or value.limit_time < -1:
        raise InvalidArgument("backlog quota limits must be -1 (unlimited) or >= 0")
    if value.limit_time > INT32_MAX:  # a Java int upstream
        raise InvalidArgument(f"limitTime must be at most {INT32_MAX} seconds")
    return value


def check_fits(quotas: dict[str, BacklogQuotaRecord], retention: RetentionPolicies | None) -> None:
    """QuotaExceedsRetention (412) when a quota is not under the positive retention bounds
    (Pulsar: "Backlog Quota exceeds configured retention quota")."""
    if retention is None:
        return
    for kind, record in quotas.items():
        quota = BacklogQuota(record.limit_size, record.limit_time, BacklogPolicy(record.policy))
        if not quota_fits_retention(
            quota, retention.retention_time_in_minutes, retention.retention_size_in_mb
        ):
            raise QuotaExceedsRetention(
                f"the {kind} backlog quota exceeds the configured retention"
                f" ({retention.retention_time_in_minutes} min, {retention.retention_size_in_mb}"
                " MB): increase retention and retry"
            )


def quota_type(request: web.Request) -> str:
    """``?backlogQuotaType`` (default ``destination_storage``)."""
    text = request.query.get("backlogQuotaType", BacklogQuotaType.DESTINATION_STORAGE.value)
    if text not in {t.value for t in BacklogQuotaType}:
        raise InvalidArgument(f"unknown backlogQuotaType {text!r}")
    return text


async def _policies(admin: AdminService, request: web.Request) -> NamespacePolicies:
    return await admin.policies.namespace_policies(namespace_param(request))


async def get_retention(admin: AdminService, request: web.Request) -> object:
    policies = await _policies(admin, request)
    if policies.retention is not None:
        return msgspec.to_builtins(policies.retention)
    config = admin.broker.config
    return {
        "retentionTimeInMinutes": config.default_retention_time_minutes,
        "retentionSizeInMB": config.default_retention_size_mb,
    }


async def set_retention(admin: AdminService, request: web.Request) -> object:
    value = await json_body(request, RetentionPolicies, "retention", None)
    if value is None:
        raise InvalidArgument("the body must be {retentionTimeInMinutes, retentionSizeInMB}")
    check_retention(value)

    def change(p: NamespacePolicies) -> NamespacePolicies:
        check_fits(p.backlog_quota_map, value)
        return msgspec.structs.replace(p, retention=value)

    await admin.policies.update_namespace_policies(namespace_param(request), change)
    return None


async def remove_retention(admin: AdminService, request: web.Request) -> object:
    await admin.policies.update_namespace_policies(
        namespace_param(request), lambda p: msgspec.structs.replace(p, retention=None)
    )
    return None


async def get_message_ttl(admin: AdminService, request: web.Request) -> object:
    return (await _policies(admin, request)).message_ttl_in_seconds


async def set_message_ttl(admin: AdminService, request: web.Request) -> object:
    ttl = await json_body(request, int, "messageTTL", None)
    if ttl is None or not 0 <= ttl <= INT32_MAX:
        raise InvalidArgument(f"the body must be a TTL in seconds, 0 to {INT32_MAX}")
    await admin.policies.update_namespace_policies(
        namespace_param(request),
        lambda p: msgspec.structs.replace(p, message_ttl_in_seconds=ttl),
    )
    return None


async def remove_message_ttl(admin: AdminService, request: web.Request) -> object:
    await admin.policies.update_namespace_policies(
        namespace_param(request),
        lambda p: msgspec.structs.replace(p, message_ttl_in_seconds=None),
    )
    return None


async def get_backlog_quota_map(admin: AdminService, request: web.Request) -> object:
    quotas: dict[str, Any] = msgspec.to_builtins(
        (await _policies(admin, request)).backlog_quota_map
    )
    return quotas


async def set_backlog_quota(admin: AdminService, request: web.Request) -> object:
    kind = quota_type(request)
    value = await json_body(request, BacklogQuotaRecord, "backlogQuota", None)
    if value is None:
        raise InvalidArgument("the body must be {limitSize, limitTime, policy}")
    check_quota(value)

    def change(p: NamespacePolicies) -> NamespacePolicies:
        quotas = {**p.backlog_quota_map, kind: value}
        check_fits(quotas, p.retention)
        return msgspec.structs.replace(p, backlog_quota_map=quotas)

    await admin.policies.update_namespace_policies(namespace_param(request), change)
    return None


async def remove_backlog_quota(admin: AdminService, request: web.Request) -> object:
    kind = quota_type(request)

    def change(p: NamespacePolicies) -> NamespacePolicies:
        quotas = {k: v for k, v in p.backlog_quota_map.items() if k != kind}
        return msgspec.structs.replace(p, backlog_quota_map=quotas)

    await admin.policies.update_namespace_policies(namespace_param(request), change)
    return None


# --- topic level ------------------------------------------------------------------------------


async def _update_topic(
    admin: AdminService, request: web.Request, change: Callable[[TopicPolicies], TopicPolicies]
) -> None:
    topic = await policy_topic(admin, request)
    await admin.broker.topic_policies.update(topic, change)


async def get_topic_retention(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    if flag(request, "applied"):
        r = retention_of(admin.broker.config, await applied_policies(admin, topic))
        minutes = -1 if r.time_ms == -1 else r.time_ms // 60_000
        mb = -1 if r.size_bytes == -1 else r.size_bytes // (1024 * 1024)
        return {"retentionTimeInMinutes": minutes, "retentionSizeInMB": mb}
    value = (await admin.broker.topic_policies.get(topic)).retention
    return None if value is None else msgspec.to_builtins(value)


async def set_topic_retention(admin: AdminService, request: web.Request) -> object:
    value = await json_body(request, RetentionPolicies, "retention", None)
    if value is None:
        raise InvalidArgument("the body must be {retentionTimeInMinutes, retentionSizeInMB}")
    check_retention(value)

    def change(p: TopicPolicies) -> TopicPolicies:
        check_fits(p.backlog_quota_map, value)
        return msgspec.structs.replace(p, retention=value)

    await _update_topic(admin, request, change)
    return None


async def remove_topic_retention(admin: AdminService, request: web.Request) -> object:
    await _update_topic(admin, request, lambda p: msgspec.structs.replace(p, retention=None))
    return None


async def get_topic_message_ttl(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    if flag(request, "applied"):
        return (await applied_policies(admin, topic)).message_ttl_in_seconds
    return (await admin.broker.topic_policies.get(topic)).message_ttl_in_seconds


async def set_topic_message_ttl(admin: AdminService, request: web.Request) -> object:
    text = request.query.get("messageTTL")
    try:
        ttl = int(text) if text is not None else await json_body(request, int, "messageTTL", None)
    except ValueError:
        raise InvalidArgument(f"messageTTL {text!r} is not an integer") from None
    if ttl is None or not 0 <= ttl <= INT32_MAX:
        raise InvalidArgument(
            f"the TTL must be seconds, 0 to {INT32_MAX} (?messageTTL=N or the body)"
        )
    await _update_topic(
        admin, request, lambda p: msgspec.structs.replace(p, message_ttl_in_seconds=ttl)
    )
    return None


async def remove_topic_message_ttl(admin: AdminService, request: web.Request) -> object:
    await _update_topic(
        admin, request, lambda p: msgspec.structs.replace(p, message_ttl_in_seconds=None)
    )
    return None


async def get_topic_backlog_quota_map(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    if flag(request, "applied"):
        quotas = (await applied_policies(admin, topic)).backlog_quota_map
    else:
        quotas = (await admin.broker.topic_policies.get(topic)).backlog_quota_map
    answer: dict[str, Any] = msgspec.to_builtins(quotas)
    return answer


async def set_topic_backlog_quota(admin: AdminService, request: web.Request) -> object:
    kind = quota_type(request)
    value = await json_body(request, BacklogQuotaRecord, "backlogQuota", None)
    if value is None:
        raise InvalidArgument("the body must be {limitSize, limitTime, policy}")
    check_quota(value)

    def change(p: TopicPolicies) -> TopicPolicies:
        quotas = {**p.backlog_quota_map, kind: value}
        check_fits(quotas, p.retention)
        return msgspec.structs.replace(p, backlog_quota_map=quotas)

    await _update_topic(admin, request, change)
    return None


async def remove_topic_backlog_quota(admin: AdminService, request: web.Request) -> object:
    kind = quota_type(request)

    def change(p: TopicPolicies) -> TopicPolicies:
        quotas = {k: v for k, v in p.backlog_quota_map.items() if k != kind}
        return msgspec.structs.replace(p, backlog_quota_map=quotas)

    await _update_topic(admin, request, change)
    return None


ROUTES: list[Route] = [
    Route("GET", f"{NS}/retention", get_retention,
          "A namespace's retention (the broker's default when unset).", "namespaces",
          response_schema=RETENTION),
    Route("POST", f"{NS}/retention", set_retention, "Set a namespace's retention.",
          "namespaces", request_schema=RETENTION, errors=(400, 404)),
    Route("DELETE", f"{NS}/retention", remove_retention,
          "Remove a namespace's retention (back to the broker's default).", "namespaces"),
    Route("GET", f"{NS}/messageTTL", get_message_ttl,
          "A namespace's message TTL in seconds (null when unset).", "namespaces",
          response_schema=INTEGER),
    Route("POST", f"{NS}/messageTTL", set_message_ttl,
          "Set a namespace's message TTL in seconds (0: off).", "namespaces",
          request_schema=INTEGER, errors=(400, 404)),
    Route("DELETE", f"{NS}/messageTTL", remove_message_ttl,
          "Remove a namespace's message TTL.", "namespaces"),
    Route("GET", f"{NS}/backlogQuotaMap", get_backlog_quota_map,
          "A namespace's backlog quotas by type.", "namespaces", response_schema=QUOTA_MAP),
    Route("POST", f"{NS}/backlogQuota", set_backlog_quota,
          "Set a backlog quota (?backlogQuotaType=destination_storage|message_age).",
          "namespaces", request_schema=QUOTA, query=("backlogQuotaType",), errors=(400, 404)),
    Route("DELETE", f"{NS}/backlogQuota", remove_backlog_quota,
          "Remove a backlog quota (?backlogQuotaType).", "namespaces",
          query=("backlogQuotaType",)),
    Route("GET", f"{TOPIC}/retention", get_topic_retention,
          "A topic's retention override (null when unset; ?applied=true: in force).",
          "persistent", response_schema=RETENTION, query=("applied",), errors=(404,)),
    Route("POST", f"{TOPIC}/retention", set_topic_retention,
          "Override retention for a topic.", "persistent", request_schema=RETENTION,
          errors=(400, 404)),
    Route("DELETE", f"{TOPIC}/retention", remove_topic_retention,
          "Remove a topic's retention override.", "persistent", errors=(404,)),
    Route("GET", f"{TOPIC}/messageTTL", get_topic_message_ttl,
          "A topic's message TTL override (?applied=true: in force).", "persistent",
          response_schema=INTEGER, query=("applied",), errors=(404,)),
    Route("POST", f"{TOPIC}/messageTTL", set_topic_message_ttl,
          "Override the message TTL for a topic (?messageTTL=N or the body).", "persistent",
          request_schema=INTEGER, query=("messageTTL",), errors=(400, 404)),
    Route("DELETE", f"{TOPIC}/messageTTL", remove_topic_message_ttl,
          "Remove a topic's message TTL override.", "persistent", errors=(404,)),
    Route("GET", f"{TOPIC}/backlogQuotaMap", get_topic_backlog_quota_map,
          "A topic's backlog quota overrides (?applied=true: in force).", "persistent",
          response_schema=QUOTA_MAP, query=("applied",), errors=(404,)),
    Route("POST", f"{TOPIC}/backlogQuota", set_topic_backlog_quota,
          "Override a backlog quota for a topic (?backlogQuotaType).", "persistent",
          request_schema=QUOTA, query=("backlogQuotaType",), errors=(400, 404)),
    Route("DELETE", f"{TOPIC}/backlogQuota", remove_topic_backlog_quota,
          "Remove a topic's backlog quota override (?backlogQuotaType).", "persistent",
          query=("backlogQuotaType",), errors=(404,)),
]  # fmt: skip

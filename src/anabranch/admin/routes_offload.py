"""Pulsar admin v2 tiered-storage routes: namespace offload policies, the topic trigger.

Paths and bodies are upstream's (``pulsar-admin namespaces set-offload-threshold`` and
friends, ``pulsar-admin topics offload`` / ``offload-status``)::

    GET/PUT/POST/DELETE /admin/v2/namespaces/{t}/{ns}/offloadThreshold           bytes (-1 off)
    GET/PUT/POST/DELETE /admin/v2/namespaces/{t}/{ns}/offloadThresholdInSeconds  seconds
    GET/PUT/POST/DELETE /admin/v2/namespaces/{t}/{ns}/offloadDeletionLagMs       ms
    GET/POST/DELETE     /admin/v2/namespaces/{t}/{ns}/offloadPolicies            OffloadPolicies
    GET/POST/DELETE     /admin/v2/persistent/{t}/{ns}/{topic}/offloadPolicies    (a topic's)
    PUT /admin/v2/persistent/{t}/{ns}/{topic}/offload    {"ledgerId", "entryId"}: offload
                                                         the sealed ledgers before it
    GET /admin/v2/persistent/{t}/{ns}/{topic}/offload    {"status", "lastError",
                                                          "firstUnoffloadedMessage"}

A broker without an offload driver answers the topic routes 409 ("offload is not
configured"); the namespace policies can be set either way (they act where a driver is).

Example:
    >>> sorted({r.path.rsplit("/", 1)[1] for r in ROUTES})[:3]
    ['offload', 'offloadDeletionLagMs', 'offloadPolicies']
    >>> len(ROUTES)
    20
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from anabranch.admin.models import MessageIdBody
from anabranch.admin.routes import Route, json_body, namespace_param, policy_topic, topic_param
from anabranch.broker.policies import NamespacePolicies, OffloadPoliciesRecord
from anabranch.errors import InvalidArgument

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

NS = "/admin/v2/namespaces/{tenant}/{namespace}"
TOPIC = "/admin/v2/persistent/{tenant}/{namespace}/{topic}"
INTEGER = {"type": "integer"}
OFFLOAD_POLICIES = {
    "type": "object",
    "properties": {
        "managedLedgerOffloadDriver": {"type": "string"},
        "managedLedgerOffloadThresholdInBytes": INTEGER,
        "managedLedgerOffloadThresholdInSeconds": INTEGER,
        "managedLedgerOffloadDeletionLagInMillis": INTEGER,
    },
}
MESSAGE_ID = {"type": "object", "properties": {"ledgerId": INTEGER, "entryId": INTEGER}}
STATUS = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["NOT_RUN", "RUNNING", "SUCCESS", "ERROR"]},
        "lastError": {"type": "string"},
        "firstUnoffloadedMessage": MESSAGE_ID,
    },
}

_FIELDS = {
    "offloadThreshold": "offload_threshold",
    "offloadThresholdInSeconds": "offload_threshold_in_seconds",
    "offloadDeletionLagMs": "offload_deletion_lag_ms",
}
_UNSET = {"offload_threshold": -1, "offload_threshold_in_seconds": -1}


def _field(request: web.Request) -> str:
    return _FIELDS[request.path.rstrip("/").rsplit("/", 1)[1]]


async def get_value(admin: AdminService, request: web.Request) -> object:
    policies = await admin.policies.namespace_policies(namespace_param(request))
    value: object = getattr(policies, _field(request))
    return value


async def set_value(admin: AdminService, request: web.Request) -> object:
    field = _field(request)
    name = request.path.rstrip("/").rsplit("/", 1)[1]
    value = await json_body(request, int, name, None)
    if value is None or value < -1:
        raise InvalidArgument(f"the body must be an integer >= -1 ({name})")
    await admin.policies.update_namespace_policies(
        namespace_param(request),
        lambda p: msgspec.structs.replace(p, **{field: value}),
    )
    return None


async def remove_value(admin: AdminService, request: web.Request) -> object:
    field = _field(request)

    def change(p: NamespacePolicies) -> NamespacePolicies:
        return msgspec.structs.replace(p, **{field: _UNSET.get(field)})

    await admin.policies.update_namespace_policies(namespace_param(request), change)
    return None


async def get_offload_policies(admin: AdminService, request: web.Request) -> object:
    record = (await admin.policies.namespace_policies(namespace_param(request))).offload_policies
    return None if record is None else msgspec.to_builtins(record)


async def set_offload_policies(admin: AdminService, request: web.Request) -> object:
    record = _check_record(await json_body(request, OffloadPoliciesRecord, "offloadPolicies", None))
    await admin.policies.update_namespace_policies(
        namespace_param(request),
        lambda p: msgspec.structs.replace(p, offload_policies=record),
    )
    return None


async def remove_offload_policies(admin: AdminService, request: web.Request) -> object:
    await admin.policies.update_namespace_policies(
        namespace_param(request), lambda p: msgspec.structs.replace(p, offload_policies=None)
    )
    return None


def _check_record(record: OffloadPoliciesRecord | None) -> OffloadPoliciesRecord:
    if record is None:
        raise InvalidArgument("the body must be an OffloadPolicies object")
    for value in (
        record.managed_ledger_offload_threshold_in_bytes,
        record.managed_ledger_offload_threshold_in_seconds,
        record.managed_ledger_offload_deletion_lag_in_millis,
    ):
        if value is not None and value < -1:
            raise InvalidArgument("offload thresholds and lags must be >= -1")
    return record


async def get_topic_offload_policies(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    record = (await admin.broker.topic_policies.get(topic)).offload_policies
    return None if record is None else msgspec.to_builtins(record)


async def set_topic_offload_policies(admin: AdminService, request: web.Request) -> object:
    record = _check_record(await json_body(request, OffloadPoliciesRecord, "offloadPolicies", None))
    topic = await policy_topic(admin, request)
    await admin.broker.topic_policies.update(
        topic, lambda p: msgspec.structs.replace(p, offload_policies=record)
    )
    return None


async def remove_topic_offload_policies(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    await admin.broker.topic_policies.update(
        topic, lambda p: msgspec.structs.replace(p, offload_policies=None)
    )
    return None


async def trigger_offload(admin: AdminService, request: web.Request) -> object:
    body = await json_body(request, MessageIdBody, "message id", None)
    if body is None:
        raise InvalidArgument("the body must be a message id {ledgerId, entryId}")
    topic = await admin._existing_topic(topic_param(request))
    await admin.broker.offloader.trigger(topic, body.position())
    return None


async def offload_status(admin: AdminService, request: web.Request) -> object:
    topic = await admin._existing_topic(topic_param(request))
    if not admin.broker.offloader.configured:
        from anabranch.errors import OffloadNotConfigured

        raise OffloadNotConfigured()
    return admin.broker.offloader.status(topic)


def _value_routes(name: str, what: str) -> list[Route]:
    path = f"{NS}/{name}"
    setter = [
        Route(method, path, set_value, f"Set a namespace's {what}.", "namespaces",
              request_schema=INTEGER, errors=(400, 404))
        for method in ("PUT", "POST")
    ]  # fmt: skip
    return [
        Route("GET", path, get_value, f"A namespace's {what}.", "namespaces",
              response_schema=INTEGER),
        *setter,
        Route("DELETE", path, remove_value, f"Remove a namespace's {what}.", "namespaces"),
    ]  # fmt: skip


ROUTES: list[Route] = [
    *_value_routes("offloadThreshold", "offload threshold in bytes (-1: disabled)"),
    *_value_routes("offloadThresholdInSeconds", "offload threshold in seconds (-1: disabled)"),
    *_value_routes("offloadDeletionLagMs", "offload deletion lag in ms (null: the broker's)"),
    Route("GET", f"{NS}/offloadPolicies", get_offload_policies,
          "A namespace's offload policies (null when unset).", "namespaces",
          response_schema=OFFLOAD_POLICIES),
    Route("POST", f"{NS}/offloadPolicies", set_offload_policies,
          "Set a namespace's offload policies.", "namespaces",
          request_schema=OFFLOAD_POLICIES, errors=(400, 404)),
    Route("DELETE", f"{NS}/offloadPolicies", remove_offload_policies,
          "Remove a namespace's offload policies.", "namespaces"),
    Route("GET", f"{TOPIC}/offloadPolicies", get_topic_offload_policies,
          "A topic's offload policies override (null when unset).", "persistent",
          response_schema=OFFLOAD_POLICIES, errors=(404,)),
    Route("POST", f"{TOPIC}/offloadPolicies", set_topic_offload_policies,
          "Override the offload policies for a topic.", "persistent",
          request_schema=OFFLOAD_POLICIES, errors=(400, 404)),
    Route("DELETE", f"{TOPIC}/offloadPolicies", remove_topic_offload_policies,
          "Remove a topic's offload policies override.", "persistent", errors=(404,)),
    Route("PUT", f"{TOPIC}/offload", trigger_offload,
          "Offload the topic's sealed ledgers before a message id to the object store.",
          "persistent", request_schema=MESSAGE_ID, errors=(400, 404, 409)),
    Route("GET", f"{TOPIC}/offload", offload_status,
          "The status of the topic's last offload.", "persistent",
          response_schema=STATUS, errors=(404, 409)),
]  # fmt: skip

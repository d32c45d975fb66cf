"""Autoscale policy routes for scalable topics, and the segment-load route owners answer.

    GET/POST/DELETE /admin/v2/namespaces/{t}/{ns}/scalableAutoscale
    GET/POST/DELETE /admin/v2/scalable/{t}/{ns}/{topic}/autoscale
    GET             /admin/v2/cluster/segments/{t}/{ns}/{topic}/{descriptor}/load

A policy body is a partial camelCase :class:`~anabranch.core.autoscale.AutoscalePolicy`
(``{"enabled": true, "splitMsgRateIn": 2000, "maxSegments": 8}``); what it leaves out is
inherited (topic over namespace over the broker's ``scalable_autoscale_*``). A body whose
result is invalid (say ``minSegments`` above the inherited ``maxSegments``) is refused
with 400 and nothing is stored. A GET answers the level's overrides (``null`` when unset),
or with ``?applied=true`` the whole policy in force there.

Example:
    >>> sorted({r.method for r in ROUTES})
    ['DELETE', 'GET', 'POST']
    >>> len(ROUTES)
    7
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from anabranch.admin.routes import Route, flag, json_body, namespace_param
from anabranch.admin.routes_cluster import OWNED_SEGMENT, _local_segment_ops
from anabranch.admin.routes_scalable import TOPIC, scalable_topic
from anabranch.broker.autoscale import BrokerAutoscalePolicies
from anabranch.broker.policies import NamespacePolicies
from anabranch.core.autoscale import check_overrides
from anabranch.errors import InvalidArgument
from anabranch.scalable.autoscaler import read_topic_overrides, write_topic_overrides
from anabranch.scalable.service import scalable_topic_name

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

NS = "/admin/v2/namespaces/{tenant}/{namespace}"
POLICY = {"type": "object", "description": "camelCase AutoscalePolicy fields, all optional"}
LOAD = {"type": "object", "additionalProperties": {"type": "integer"}}


async def _body(request: web.Request) -> dict[str, Any]:
    doc = await json_body(request, dict[str, Any], "autoscale policy", None)
    if doc is None:
        raise InvalidArgument("the body must be a JSON object of autoscale settings")
    check_overrides(doc)
    return {k: v for k, v in doc.items() if v is not None}


def _policies(admin: AdminService) -> BrokerAutoscalePolicies:
    return BrokerAutoscalePolicies(admin.broker)


# --- namespace level --------------------------------------------------------------------------


async def get_namespace_autoscale(admin: AdminService, request: web.Request) -> object:
    namespace = namespace_param(request)
    if flag(request, "applied"):
        return (await _policies(admin).namespace_policy(namespace)).to_dict()
    return (await admin.policies.namespace_policies(namespace)).scalable_autoscale


async def set_namespace_autoscale(admin: AdminService, request: web.Request) -> object:
    overrides = await _body(request)
    _policies(admin).defaults().overridden(overrides)  # 400 before anything is stored

    def change(p: NamespacePolicies) -> NamespacePolicies:
        return msgspec.structs.replace(p, scalable_autoscale=overrides)

    await admin.policies.update_namespace_policies(namespace_param(request), change)
    return None


async def remove_namespace_autoscale(admin: AdminService, request: web.Request) -> object:
    await admin.policies.update_namespace_policies(
        namespace_param(request), lambda p: msgspec.structs.replace(p, scalable_autoscale=None)
    )
    return None


# --- topic level ------------------------------------------------------------------------------


async def get_topic_autoscale(admin: AdminService, request: web.Request) -> object:
    topic = scalable_topic_name(scalable_topic(request))
    await admin.scalable_layout(str(topic))  # 404 for a missing topic
    if flag(request, "applied"):
        return (await _policies(admin).policy_of(topic)).to_dict()
    return await read_topic_overrides(admin.broker.store, topic)


async def set_topic_autoscale(admin: AdminService, request: web.Request) -> object:
    topic = scalable_topic_name(scalable_topic(request))
    overrides = await _body(request)
    namespace = await _policies(admin).namespace_policy(f"{topic.tenant}/{topic.namespace}")
    namespace.overridden(overrides)
    await write_topic_overrides(admin.broker.store, topic, overrides)
    return None


async def remove_topic_autoscale(admin: AdminService, request: web.Request) -> object:
    topic = scalable_topic_name(scalable_topic(request))
    await write_topic_overrides(admin.broker.store, topic, None)
    return None


# --- segment load (controller to owner) -------------------------------------------------------


async def owner_segment_load(admin: AdminService, request: web.Request) -> object:
    ops, segment = await _local_segment_ops(admin, request)
    return (await ops.segment_load(segment)).to_dict()


ROUTES: list[Route] = [
    Route("GET", f"{NS}/scalableAutoscale", get_namespace_autoscale,
          "A namespace's scalable-topic autoscale overrides (null when unset; "
          "?applied=true: the policy in force).", "namespaces", response_schema=POLICY,
          query=("applied",), errors=(404,)),
    Route("POST", f"{NS}/scalableAutoscale", set_namespace_autoscale,
          "Set a namespace's scalable-topic autoscale overrides.", "namespaces",
          request_schema=POLICY, errors=(400, 404)),
    Route("DELETE", f"{NS}/scalableAutoscale", remove_namespace_autoscale,
          "Remove a namespace's autoscale overrides (back to the broker's).", "namespaces",
          errors=(404,)),
    Route("GET", f"{TOPIC}/autoscale", get_topic_autoscale,
          "A scalable topic's autoscale overrides (null when unset; ?applied=true: the "
          "policy in force).", "scalable", response_schema=POLICY, query=("applied",),
          errors=(404,)),
    Route("POST", f"{TOPIC}/autoscale", set_topic_autoscale,
          "Set a scalable topic's autoscale overrides.", "scalable", request_schema=POLICY,
          errors=(400, 404)),
    Route("DELETE", f"{TOPIC}/autoscale", remove_topic_autoscale,
          "Remove a scalable topic's autoscale overrides.", "scalable", errors=(404,)),
    Route("GET", f"{OWNED_SEGMENT}/load", owner_segment_load,
          "The segment's load counters on its owner (controller use).", "cluster",
          response_schema=LOAD, errors=(307, 400, 404, 503)),
]  # fmt: skip

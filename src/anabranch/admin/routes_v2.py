"""Pulsar admin v2 routes: clusters, tenants, namespaces, persistent topics, lookup, health.

Paths, verbs and status codes follow upstream's REST API (DESIGN.md §3.3): PUT creates
(204, 409 if present), POST updates or acts, GET reads (200 JSON), DELETE removes (204,
404 if absent, 409 while in use unless ``?force=true``). Errors are ``{"reason": ...}``.

Example:
    >>> sorted({r.tag for r in ROUTES})
    ['brokers', 'clusters', 'lookup', 'namespaces', 'persistent', 'tenants']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from anabranch.admin.models import MessageIdBody, decode_message_id
from anabranch.admin.routes import (
    Route,
    body_bytes,
    flag,
    int_param,
    json_body,
    namespace_param,
    param,
    partition_count,
    topic_param,
)
from anabranch.admin.routes_listeners import listener_lookup
from anabranch.broker.policies import ClusterData, NamespacePolicies, TenantInfo
from anabranch.errors import InvalidArgument
from anabranch.storage.api import LATEST

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

V2 = "/admin/v2"
NS = f"{V2}/namespaces/{{tenant}}/{{namespace}}"
TOPIC = f"{V2}/persistent/{{tenant}}/{{namespace}}/{{topic}}"
SUB = f"{TOPIC}/subscription/{{subscription}}"

STRINGS = {"type": "array", "items": {"type": "string"}}
OBJECT = {"type": "object"}
BOOLEAN = {"type": "boolean"}
INTEGER = {"type": "integer"}
MESSAGE_ID = {
    "type": "object",
    "properties": {
        "ledgerId": INTEGER,
        "entryId": INTEGER,
        "partitionIndex": INTEGER,
        "batchIndex": INTEGER,
        "isExcluded": BOOLEAN,
    },
    "required": ["ledgerId", "entryId"],
}
CLUSTER = {"type": "object", "properties": {"serviceUrl": {"type": "string"},
                                            "brokerServiceUrl": {"type": "string"}}}  # fmt: skip
TENANT = {"type": "object", "properties": {"adminRoles": STRINGS, "allowedClusters": STRINGS}}
PARTITIONS = {"type": "object", "properties": {"partitions": INTEGER}}
LOOKUP = {
    "type": "object",
    "properties": {k: {"type": "string"} for k in ("brokerUrl", "httpUrl", "nativeUrl")},
}


def _struct(value: msgspec.Struct) -> Any:
    return msgspec.to_builtins(value)


# --- clusters ---------------------------------------------------------------------------------


async def list_clusters(admin: AdminService, request: web.Request) -> object:
    return await admin.policies.list_clusters()


async def get_cluster(admin: AdminService, request: web.Request) -> object:
    return _struct(await admin.policies.get_cluster(param(request, "cluster")))


async def create_cluster(admin: AdminService, request: web.Request) -> object:
    data = await json_body(request, ClusterData, "cluster", ClusterData())
    await admin.policies.create_cluster(param(request, "cluster"), data)
    return None


async def update_cluster(admin: AdminService, request: web.Request) -> object:
    data = await json_body(request, ClusterData, "cluster", ClusterData())
    await admin.policies.update_cluster(param(request, "cluster"), data)
    return None


async def delete_cluster(admin: AdminService, request: web.Request) -> object:
    await admin.policies.delete_cluster(param(request, "cluster"))
    return None


# --- tenants ----------------------------------------------------------------------------------


async def list_tenants(admin: AdminService, request: web.Request) -> object:
    return await admin.policies.list_tenants()


async def get_tenant(admin: AdminService, request: web.Request) -> object:
    return _struct(await admin.policies.get_tenant(param(request, "tenant")))


async def create_tenant(admin: AdminService, request: web.Request) -> object:
    info = await json_body(request, TenantInfo, "tenant", TenantInfo())
    await admin.policies.create_tenant(param(request, "tenant"), info)
    return None


async def update_tenant(admin: AdminService, request: web.Request) -> object:
    info = await json_body(request, TenantInfo, "tenant", TenantInfo())
    await admin.policies.update_tenant(param(request, "tenant"), info)
    return None


async def delete_tenant(admin: AdminService, request: web.Request) -> object:
    await admin.policies.delete_tenant(param(request, "tenant"))
    return None


# --- namespaces -------------------------------------------------------------------------------


async def list_namespaces(admin: AdminService, request: web.Request) -> object:
    return await admin.policies.list_namespaces(param(request, "tenant"))


async def create_namespace(admin: AdminService, request: web.Request) -> object:
    policies = await json_body(request, NamespacePolicies, "policies", NamespacePolicies())
    await admin.policies.create_namespace(namespace_param(request), policies)
    return None


async def get_namespace(admin: AdminService, request: web.Request) -> object:
    return _struct(await admin.policies.namespace_policies(namespace_param(request)))


async def delete_namespace(admin: AdminService, request: web.Request) -> object:
    await admin.policies.delete_namespace(namespace_param(request))
    return None


async def namespace_topics(admin: AdminService, request: web.Request) -> object:
    from anabranch.admin.routes_nonpersistent import non_persistent_topics

    ns = namespace_param(request)
    await admin.policies.namespace_policies(ns)  # 404 for an unknown namespace
    mode = request.query.get("mode", "PERSISTENT").upper()  # upstream's ?mode=
    if mode not in ("PERSISTENT", "NON_PERSISTENT", "ALL"):
        raise InvalidArgument(f"mode {mode!r} is not PERSISTENT, NON_PERSISTENT or ALL")
    names = [] if mode == "NON_PERSISTENT" else await admin.list_topics(ns)
    if mode != "PERSISTENT":
        names += await non_persistent_topics(admin, ns)
    return names


async def get_deduplication(admin: AdminService, request: web.Request) -> object:
    return (await admin.policies.namespace_policies(namespace_param(request))).deduplication_enabled


async def set_deduplication(admin: AdminService, request: web.Request) -> object:
    enabled = await json_body(request, bool, "deduplication", None)
    if enabled is None:
        raise InvalidArgument("the body must be true or false")
    await admin.policies.update_namespace_policies(
        namespace_param(request),
        lambda p: msgspec.structs.replace(p, deduplication_enabled=enabled),
    )
    return None


async def remove_deduplication(admin: AdminService, request: web.Request) -> object:
    await admin.policies.update_namespace_policies(
        namespace_param(request),
        lambda p: msgspec.structs.replace(p, deduplication_enabled=False),
    )
    return None


# --- persistent topics ------------------------------------------------------------------------


async def list_topics(admin: AdminService, request: web.Request) -> object:
    ns = namespace_param(request)
    await admin.policies.namespace_policies(ns)
    return await admin.list_topics(ns)


async def list_partitioned(admin: AdminService, request: web.Request) -> object:
    return await admin.list_partitioned_topics(namespace_param(request))


async def create_topic(admin: AdminService, request: web.Request) -> object:
    await admin.create_topic(topic_param(request))
    return None


async def delete_topic(admin: AdminService, request: web.Request) -> object:
    await admin.delete_topic(topic_param(request), force=flag(request, "force"))
    return None


async def create_partitions(admin: AdminService, request: web.Request) -> object:
    await admin.create_partitioned_topic(topic_param(request), await partition_count(request))
    return None


async def update_partitions(admin: AdminService, request: web.Request) -> object:
    await admin.update_partitioned_topic(topic_param(request), await partition_count(request))
    return None


async def get_partitions(admin: AdminService, request: web.Request) -> object:
    return await admin.get_partitions(topic_param(request))


async def delete_partitions(admin: AdminService, request: web.Request) -> object:
    await admin.delete_partitioned_topic(topic_param(request), force=flag(request, "force"))
    return None


async def topic_stats(admin: AdminService, request: web.Request) -> object:
    return await admin.stats(topic_param(request))


async def partitioned_stats(admin: AdminService, request: web.Request) -> object:
    stats = await admin.partitioned_stats(topic_param(request))
    if not flag(request, "perPartition"):
        stats.pop("partitions")
    return stats


async def internal_stats(admin: AdminService, request: web.Request) -> object:
    return await admin.internal_stats(topic_param(request))


async def terminate(admin: AdminService, request: web.Request) -> object:
    return _struct(await admin.terminate(topic_param(request)))


async def list_subscriptions(admin: AdminService, request: web.Request) -> object:
    return await admin.list_subscriptions(topic_param(request))


async def create_subscription(admin: AdminService, request: web.Request) -> object:
    data = await body_bytes(request)
    start = decode_message_id(data).position() if data.strip() else LATEST
    await admin.create_subscription(topic_param(request), param(request, "subscription"), start)
    return None


async def delete_subscription(admin: AdminService, request: web.Request) -> object:
    await admin.delete_subscription(
        topic_param(request), param(request, "subscription"), force=flag(request, "force")
    )
    return None


async def skip_all(admin: AdminService, request: web.Request) -> object:
    await admin.skip_all(topic_param(request), param(request, "subscription"))
    return None


async def skip(admin: AdminService, request: web.Request) -> object:
    count = int_param(request, "count")
    await admin.skip(topic_param(request), param(request, "subscription"), count)
    return None


async def reset_cursor_time(admin: AdminService, request: web.Request) -> object:
    timestamp = int_param(request, "timestamp")
    await admin.reset_cursor_to_time(
        topic_param(request), param(request, "subscription"), timestamp
    )
    return None


async def reset_cursor(admin: AdminService, request: web.Request) -> object:
    message_id: MessageIdBody = decode_message_id(await body_bytes(request))
    await admin.reset_cursor(topic_param(request), param(request, "subscription"), message_id)
    return None


# --- lookup and health ------------------------------------------------------------------------

_LOOKUP_PARTS = ("domain", "tenant", "namespace", "topic")


async def lookup(admin: AdminService, request: web.Request) -> object:
    from anabranch.admin.routes_cluster import cluster_lookup  # cluster mode: the owner

    topic = "{}://{}/{}/{}".format(*(param(request, k) for k in _LOOKUP_PARTS))
    if "segment" in request.match_info:  # segment://tenant/namespace/topic/<range>-<id>
        topic += "/" + param(request, "segment")
    owner = await cluster_lookup(admin, topic, request)
    if isinstance(owner, web.Response):
        return owner
    data = owner if owner is not None else admin.lookup(topic)
    name = request.query.get("listenerName") or request.headers.get("X-Pulsar-ListenerName")
    if name:  # the named listener's URLs, or 404 (never the default ones)
        data = await listener_lookup(admin, data, name)
    return _struct(data)


async def health(admin: AdminService, request: web.Request) -> object:
    await admin.policies.list_clusters()  # the metadata store answers
    return web.Response(text="ok", content_type="text/plain")


ROUTES: list[Route] = [
    Route("GET", f"{V2}/clusters", list_clusters, "List clusters.", "clusters",
          response_schema=STRINGS),
    Route("GET", f"{V2}/clusters/{{cluster}}", get_cluster, "Get a cluster.", "clusters",
          response_schema=CLUSTER),
    Route("PUT", f"{V2}/clusters/{{cluster}}", create_cluster, "Create a cluster.", "clusters",
          request_schema=CLUSTER, errors=(400, 409)),
    Route("POST", f"{V2}/clusters/{{cluster}}", update_cluster, "Update a cluster.", "clusters",
          request_schema=CLUSTER, errors=(400, 404, 409)),
    Route("DELETE", f"{V2}/clusters/{{cluster}}", delete_cluster, "Delete a cluster.",
          "clusters", errors=(404, 409)),
    Route("GET", f"{V2}/tenants", list_tenants, "List tenants.", "tenants",
          response_schema=STRINGS),
    Route("GET", f"{V2}/tenants/{{tenant}}", get_tenant, "Get a tenant.", "tenants",
          response_schema=TENANT),
    Route("PUT", f"{V2}/tenants/{{tenant}}", create_tenant, "Create a tenant.", "tenants",
          request_schema=TENANT, errors=(400, 409)),
    Route("POST", f"{V2}/tenants/{{tenant}}", update_tenant, "Update a tenant.", "tenants",
          request_schema=TENANT, errors=(400, 404, 409)),
    Route("DELETE", f"{V2}/tenants/{{tenant}}", delete_tenant,
          "Delete a tenant (409 while it has namespaces).", "tenants", errors=(404, 409)),
    Route("GET", f"{V2}/namespaces/{{tenant}}", list_namespaces, "List a tenant's namespaces.",
          "namespaces", response_schema=STRINGS),
    Route("GET", f"{NS}/topics", namespace_topics,
          "List a namespace's topics (?mode=PERSISTENT, NON_PERSISTENT or ALL).", "namespaces",
          response_schema=STRINGS),
    Route("GET", f"{NS}/deduplication", get_deduplication, "Is deduplication enabled?",
          "namespaces", response_schema=BOOLEAN),
    Route("POST", f"{NS}/deduplication", set_deduplication, "Enable or disable deduplication.",
          "namespaces", request_schema=BOOLEAN),
    Route("DELETE", f"{NS}/deduplication", remove_deduplication,
          "Remove the deduplication override.", "namespaces"),
    Route("PUT", NS, create_namespace, "Create a namespace.", "namespaces",
          request_schema=OBJECT, errors=(400, 404, 409)),
    Route("GET", NS, get_namespace, "Get a namespace's policies.", "namespaces",
          response_schema=OBJECT),
    Route("DELETE", NS, delete_namespace, "Delete a namespace (409 while it has topics).",
          "namespaces", errors=(404, 409)),
    Route("GET", f"{V2}/persistent/{{tenant}}/{{namespace}}", list_topics,
          "List persistent topics (partitions included).", "persistent",
          response_schema=STRINGS),
    Route("GET", f"{V2}/persistent/{{tenant}}/{{namespace}}/partitioned", list_partitioned,
          "List partitioned topics.", "persistent", response_schema=STRINGS),
    Route("PUT", TOPIC, create_topic, "Create a non-partitioned topic.", "persistent",
          errors=(400, 404, 409)),
    Route("DELETE", TOPIC, delete_topic, "Delete a topic.", "persistent", query=("force",),
          errors=(404, 409)),
    Route("PUT", f"{TOPIC}/partitions", create_partitions, "Create a partitioned topic.",
          "persistent", request_schema=INTEGER, errors=(400, 404, 409)),
    Route("POST", f"{TOPIC}/partitions", update_partitions,
          "Increase the number of partitions.", "persistent", request_schema=INTEGER),
    Route("GET", f"{TOPIC}/partitions", get_partitions,
          "Partitioned-topic metadata (0 partitions: not partitioned).", "persistent",
          response_schema=PARTITIONS),
    Route("DELETE", f"{TOPIC}/partitions", delete_partitions,
          "Delete a partitioned topic and its partitions.", "persistent", query=("force",),
          errors=(404, 409)),
    Route("GET", f"{TOPIC}/stats", topic_stats, "Topic stats.", "persistent",
          response_schema=OBJECT),
    Route("GET", f"{TOPIC}/partitioned-stats", partitioned_stats,
          "Stats summed over a partitioned topic's partitions.", "persistent",
          response_schema=OBJECT, query=("perPartition",)),
    Route("GET", f"{TOPIC}/internalStats", internal_stats, "Managed-ledger internal stats.",
          "persistent", response_schema=OBJECT),
    Route("POST", f"{TOPIC}/terminate", terminate,
          "Terminate (seal) a topic; answers the last message id.", "persistent",
          response_schema=MESSAGE_ID),
    Route("GET", f"{TOPIC}/subscriptions", list_subscriptions, "List subscriptions.",
          "persistent", response_schema=STRINGS),
    Route("PUT", SUB, create_subscription,
          "Create a subscription at a message id (default latest).", "persistent",
          request_schema=MESSAGE_ID, errors=(400, 404, 409)),
    Route("DELETE", SUB, delete_subscription, "Delete a subscription.", "persistent",
          query=("force",), errors=(404, 409)),
    Route("POST", f"{SUB}/skip_all", skip_all, "Skip the whole backlog.", "persistent"),
    Route("POST", f"{SUB}/skip/{{count}}", skip, "Skip N messages.", "persistent"),
    Route("POST", f"{SUB}/resetcursor/{{timestamp}}", reset_cursor_time,
          "Reset the subscription to a publish time (ms).", "persistent"),
    Route("POST", f"{SUB}/resetcursor", reset_cursor,
          "Reset the subscription to a message id.", "persistent", request_schema=MESSAGE_ID),
    Route("GET", "/lookup/v2/topic/{domain}/{tenant}/{namespace}/{topic}", lookup,
          "Which broker serves a topic.", "lookup", response_schema=LOOKUP, errors=(400,)),
    Route("GET", "/lookup/v2/topic/{domain}/{tenant}/{namespace}/{topic}/{segment}", lookup,
          "Which broker serves a segment (segment://t/ns/topic/<range>-<id>).", "lookup",
          response_schema=LOOKUP, errors=(400,)),
    Route("GET", f"{V2}/brokers/health", health, "Health check: answers ok.", "brokers",
          response_schema={"type": "string"}, errors=(503,), content_type="text/plain"),
]  # fmt: skip

"""Cluster admin routes: unload (move load between brokers), live brokers, owner lookup.

* ``PUT /admin/v2/persistent/{t}/{ns}/{topic}/unload[?destinationBroker=host:port]``: the
  owner closes the topic and hands it to the destination (default: the least-loaded other
  broker), whose CAS takes it over when the clients come back. Sent to a non-owner it
  answers 307 to the owner.
* ``PUT /admin/v2/namespaces/{t}/{ns}/unload`` (and ``.../{bundle}/unload``, one bundle
  covering the whole hash range): every topic and segment of the namespace, each unloaded
  by its owner (this broker forwards to the others).
* ``PUT /admin/v2/segments/{t}/{ns}/{topic}/{descriptor}/unload``: the same for a segment.
* ``/admin/v2/cluster/segments/{t}/{ns}/{topic}/{descriptor}``: the segment operations
  a controller leader sends to a segment's owner (``broker/cluster/segments.py``): PUT
  (create, JSON list of subscriptions), ``POST .../terminate`` (answers the dedup
  snapshot), ``POST .../seedDedup`` (JSON list of parent snapshots), ``GET
  .../subscriptions``, ``GET .../backlog/{subscription}``, ``DELETE
  .../subscriptions/{subscription}``, DELETE (409 while the layout lists the segment as
  active and its topic is not being deleted). The receiver claims an unowned segment.
  ``GET .../owner`` reads the ownership record without assigning anything.
* ``GET /admin/v2/brokers/{cluster}``: the live brokers' ``host:port`` ids, as upstream.
* ``GET /admin/v2/brokers/{cluster}/load``: their registry records (addresses, load).

On a standalone broker the same routes work with this broker as the only one.

Example:
    >>> sorted({r.tag for r in ROUTES})
    ['brokers', 'cluster', 'namespaces', 'persistent', 'segments']
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from anabranch.admin.models import LookupData
from anabranch.admin.routes import Route, json_body, namespace_param, param, topic_param
from anabranch.admin.routes_scalable import segment_param
from anabranch.broker.cluster.ownership import ClusterOwnership
from anabranch.broker.cluster.records import OwnerState
from anabranch.core.names import NamespaceName, TopicName, parse_name
from anabranch.errors import NotFound, NotOwner, StorageError
from anabranch.scalable.segment_ops import decode_dedup_snapshot, encode_dedup_snapshot
from anabranch.security.broker_client import BrokerClientCredentials

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

V2 = "/admin/v2"
FORWARD_TIMEOUT_S = 30.0
"""Bound on one forwarded per-topic unload during a namespace unload."""


def cluster_of(admin: AdminService) -> ClusterOwnership | None:
    """The broker's cluster ownership, or None on a standalone broker."""
    ownership = admin.broker.ownership
    return ownership if isinstance(ownership, ClusterOwnership) else None


async def cluster_lookup(
    admin: AdminService, topic: str, request: web.Request
) -> LookupData | web.Response | None:
    """``/lookup/v2/topic/...`` in cluster mode: the owner's addresses, or for an unowned
    topic a 307 to the broker chosen for it with ``?authoritative=true`` (that broker
    claims it, as a binary LOOKUP Redirect does); None on a standalone broker."""
    ownership = cluster_of(admin)
    if ownership is None:
        return None
    authoritative = request.query.get("authoritative", "").lower() == "true"
    answer = await ownership.lookup(str(parse_name(topic)), authoritative=authoritative)
    if answer.redirect:
        response = web.Response(status=307)
        response.headers["Location"] = (
            f"{answer.http_url.rstrip('/')}{request.path}?authoritative=true"
        )
        if "listenerName" in request.query:  # as upstream: the redirect keeps it
            response.headers["Location"] += f"&listenerName={request.query['listenerName']}"
        return response
    tls = answer.pulsar_url_tls or admin.broker.tls_url_for(answer.pulsar_url) or ""
    return LookupData(
        broker_url=answer.pulsar_url,
        native_url=answer.pulsar_url,
        http_url=answer.http_url,
        broker_url_tls=tls,
    )


async def unload_topic(admin: AdminService, request: web.Request) -> object:
    topic = str(TopicName.parse(topic_param(request)))
    destination = request.query.get("destinationBroker") or None
    ownership = cluster_of(admin)
    if ownership is None:
        await admin.broker.unload_topic(topic)
        return None
    await ownership.unload(topic, destination)
    return None


async def unload_namespace(admin: AdminService, request: web.Request) -> object:
    namespace = str(NamespaceName.parse(namespace_param(request)))
    await admin.policies.namespace_policies(namespace)  # NotFound (404) when absent
    ownership = cluster_of(admin)
    if ownership is None:
        for loaded in admin.broker.loaded_topics():
            if loaded.name.split("://", 1)[1].startswith(namespace + "/"):
                await admin.broker.unload_topic(loaded.name)
        return None
    records: dict[str, Any] = {}
    for domain in ("persistent", "segment"):
        records.update(await ownership.ownerships(f"{domain}://{namespace}/"))
    forwards = []
    for topic, owner in records.items():
        if owner.state is not OwnerState.OWNED:
            continue
        if owner.broker_id == ownership.broker_id:
            try:
                await ownership.unload(topic)
            except (NotOwner, StorageError):
                pass  # it moved meanwhile: nothing left to unload here
        else:
            forwards.append(_forward_unload(owner.http_url, topic, admin.broker.broker_client))
    await asyncio.gather(*forwards)
    return None


async def _forward_unload(http_url: str, topic: str, credentials: BrokerClientCredentials) -> None:
    name = TopicName.parse(topic) if not topic.startswith("segment://") else None
    if name is None:
        return  # segments are unloaded by their owner's namespace unload
    url = f"{http_url.rstrip('/')}{V2}/persistent/{name.short_name}/unload"
    timeout = aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)
    tls = credentials.ssl_for(url)
    headers = credentials.http_headers()
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.put(url, headers=headers, ssl=tls if tls is not None else True) as response,
    ):
        if response.status >= 400 and response.status not in (307, 404):
            raise NotFound(f"unload of {topic} at {http_url} failed: HTTP {response.status}")


async def unload_segment(admin: AdminService, request: web.Request) -> object:
    segment = str(segment_param(request))
    destination = request.query.get("destinationBroker") or None
    ownership = cluster_of(admin)
    if ownership is None:
        await admin.broker.unload_topic(segment)
        return None
    await ownership.unload(segment, destination)
    return None


async def _local_segment_ops(admin: AdminService, request: web.Request) -> tuple[Any, Any]:
    """This broker's own segment ops and the segment, once this broker owns it (a
    controller sent the operation here; another owner answers 307)."""
    segment = segment_param(request)
    ops: Any = await admin.segment_ops()
    ownership = cluster_of(admin)
    if ownership is not None:
        await ownership.claim(str(segment))
    return getattr(ops, "local", ops), segment


async def segment_owner(admin: AdminService, request: web.Request) -> object:
    segment = str(segment_param(request))
    ownership = cluster_of(admin)
    if ownership is None:
        url = admin.broker.advertised_url
        return {"brokerId": url.split("://", 1)[-1], "pulsarUrl": url, "state": "owned"}
    owner = await ownership.owner(segment)
    if owner is None:
        raise NotFound(f"{segment} has no owner")
    return msgspec.to_builtins(owner)


async def owner_create_segment(admin: AdminService, request: web.Request) -> object:
    ops, segment = await _local_segment_ops(admin, request)
    subscriptions: Any = await json_body(request, list[str], "subscriptions", [])
    await ops.create_segment(segment, list(subscriptions))
    return None


async def owner_terminate_segment(admin: AdminService, request: web.Request) -> object:
    ops, segment = await _local_segment_ops(admin, request)
    return decode_dedup_snapshot(await ops.terminate_segment(segment))


async def owner_seed_dedup(admin: AdminService, request: web.Request) -> object:
    ops, segment = await _local_segment_ops(admin, request)
    snapshots: Any = await json_body(request, list[dict[str, int]], "parent snapshots", [])
    await ops.seed_dedup(segment, [encode_dedup_snapshot(s) for s in snapshots])
    return None


async def owner_segment_subscriptions(admin: AdminService, request: web.Request) -> object:
    ops, segment = await _local_segment_ops(admin, request)
    return await ops.segment_subscriptions(segment)


async def owner_segment_backlog(admin: AdminService, request: web.Request) -> object:
    ops, segment = await _local_segment_ops(admin, request)
    return await ops.segment_backlog(segment, param(request, "subscription"))


async def owner_remove_subscription(admin: AdminService, request: web.Request) -> object:
    ops, segment = await _local_segment_ops(admin, request)
    await ops.remove_subscription(segment, param(request, "subscription"))
    return None


async def owner_delete_segment(admin: AdminService, request: web.Request) -> object:
    # 409 while the layout says ACTIVE: checked before this broker claims the segment.
    await admin.check_segment_deletable(segment_param(request))
    ops, segment = await _local_segment_ops(admin, request)
    await ops.delete_segment(segment)
    return None


async def list_brokers(admin: AdminService, request: web.Request) -> object:
    cluster = param(request, "cluster")
    ownership = cluster_of(admin)
    if ownership is None:
        if cluster != admin.broker.config.cluster_name:
            raise NotFound(f"cluster {cluster}")
        return [admin.broker.advertised_url.split("://", 1)[-1]]
    if cluster != ownership.cluster:
        raise NotFound(f"cluster {cluster}")
    return [broker.broker_id for broker in await ownership.live_brokers()]


async def broker_load(admin: AdminService, request: web.Request) -> object:
    cluster = param(request, "cluster")
    ownership = cluster_of(admin)
    if ownership is None or cluster != ownership.cluster:
        raise NotFound(f"cluster {cluster} (not a cluster broker)")
    return [msgspec.to_builtins(broker) for broker in await ownership.live_brokers()]


_STRINGS = {"type": "array", "items": {"type": "string"}}
_SNAPSHOT = {"type": "object", "additionalProperties": {"type": "integer"}}
_SNAPSHOTS = {"type": "array", "items": _SNAPSHOT}
_OWNER_ERRORS = (307, 400, 404, 503)
SEGMENT = f"{V2}/segments/{{tenant}}/{{namespace}}/{{topic}}/{{descriptor}}"
OWNED_SEGMENT = f"{V2}/cluster/segments/{{tenant}}/{{namespace}}/{{topic}}/{{descriptor}}"
"""Segment operations a controller leader sends to the segment's owner (the receiver
claims the segment if nobody owns it; another owner answers 307)."""
_OBJECTS = {"type": "array", "items": {"type": "object"}}

ROUTES: list[Route] = [
    Route("PUT", f"{V2}/persistent/{{tenant}}/{{namespace}}/{{topic}}/unload", unload_topic,
          "Unload a topic: its owner closes it and hands it to another broker "
          "(?destinationBroker=host:port).", "persistent", errors=(307, 400, 404)),
    Route("PUT", f"{V2}/namespaces/{{tenant}}/{{namespace}}/unload", unload_namespace,
          "Unload every topic of a namespace.", "namespaces"),
    Route("PUT", f"{V2}/namespaces/{{tenant}}/{{namespace}}/{{bundle}}/unload", unload_namespace,
          "Unload a namespace bundle (one bundle covers the namespace).", "namespaces"),
    Route("PUT", f"{SEGMENT}/unload", unload_segment,
          "Unload a segment: its owner closes it and hands it to another broker.", "segments",
          errors=(307, 400, 404)),
    Route("GET", f"{OWNED_SEGMENT}/owner", segment_owner,
          "The segment's ownership record (no assignment).", "cluster",
          response_schema={"type": "object"}, errors=(400, 404)),
    Route("PUT", OWNED_SEGMENT, owner_create_segment,
          "Create a segment topic on the broker that owns it (controller use).", "cluster",
          request_schema=_STRINGS, errors=_OWNER_ERRORS),
    Route("POST", f"{OWNED_SEGMENT}/terminate", owner_terminate_segment,
          "Seal a segment on its owner; answers its dedup snapshot (controller use).",
          "cluster", response_schema=_SNAPSHOT, errors=_OWNER_ERRORS),
    Route("POST", f"{OWNED_SEGMENT}/seedDedup", owner_seed_dedup,
          "Seed a new segment's dedup state from its parents' snapshots (controller use).",
          "cluster", request_schema=_SNAPSHOTS, errors=_OWNER_ERRORS),
    Route("GET", f"{OWNED_SEGMENT}/subscriptions", owner_segment_subscriptions,
          "The segment's subscriptions (cursors).", "cluster", response_schema=_STRINGS,
          errors=_OWNER_ERRORS),
    Route("GET", f"{OWNED_SEGMENT}/backlog/{{subscription}}", owner_segment_backlog,
          "Unacknowledged entries of a subscription on the segment.", "cluster",
          response_schema={"type": "integer"}, errors=_OWNER_ERRORS),
    Route("DELETE", f"{OWNED_SEGMENT}/subscriptions/{{subscription}}",
          owner_remove_subscription, "Delete a subscription's cursor on the segment.",
          "cluster", errors=_OWNER_ERRORS),
    Route("DELETE", OWNED_SEGMENT, owner_delete_segment,
          "Delete a segment topic on its owner (controller use).", "cluster",
          errors=_OWNER_ERRORS),
    Route("GET", f"{V2}/brokers/{{cluster}}", list_brokers, "Live brokers of a cluster.",
          "brokers", response_schema=_STRINGS, errors=(404,)),
    Route("GET", f"{V2}/brokers/{{cluster}}/load", broker_load,
          "Live brokers with their addresses and load.", "brokers",
          response_schema=_OBJECTS, errors=(404,)),
]  # fmt: skip

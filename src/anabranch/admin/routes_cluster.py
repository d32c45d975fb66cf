"""Cluster admin routes: unload (move load between brokers), live brokers, owner lookup.

* ``PUT /admin/v2/persistent/{t}/{ns}/{topic}/unload[?destinationBroker=host:port]``: the
  owner closes the topic and hands it to the destination (default: the least-loaded other
  broker), whose CAS takes it over when the clients come back. Sent to a non-owner it
  answers 307 to the owner.
* ``PUT /admin/v2/namespaces/{t}/{ns}/unload`` (and ``.../{bundle}/unload``, one bundle
  covering the whole hash range): every topic and segment of the namespace, each unloaded
  by its owner (this broker forwards to the others).
* ``GET /admin/v2/brokers/{cluster}``: the live brokers' ``host:port`` ids, as upstream.
* ``GET /admin/v2/brokers/{cluster}/load``: their registry records (addresses, load).

On a standalone broker the same routes work with this broker as the only one.

Example:
    >>> sorted({r.tag for r in ROUTES})
    ['brokers', 'namespaces', 'persistent']
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from anabranch.admin.models import LookupData
from anabranch.admin.routes import Route, namespace_param, param, topic_param
from anabranch.broker.cluster.ownership import ClusterOwnership
from anabranch.broker.cluster.records import OwnerState
from anabranch.core.names import NamespaceName, TopicName
from anabranch.errors import NotFound, NotOwner, StorageError

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
    answer = await ownership.lookup(str(TopicName.parse(topic)), authoritative=authoritative)
    if answer.redirect:
        response = web.Response(status=307)
        response.headers["Location"] = (
            f"{answer.http_url.rstrip('/')}{request.path}?authoritative=true"
        )
        return response
    return LookupData(
        broker_url=answer.pulsar_url, native_url=answer.pulsar_url, http_url=answer.http_url
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
            forwards.append(_forward_unload(owner.http_url, topic))
    await asyncio.gather(*forwards)
    return None


async def _forward_unload(http_url: str, topic: str) -> None:
    name = TopicName.parse(topic) if not topic.startswith("segment://") else None
    if name is None:
        return  # segments are unloaded by their owner's namespace unload
    url = f"{http_url.rstrip('/')}{V2}/persistent/{name.short_name}/unload"
    timeout = aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.put(url) as response:
        if response.status >= 400 and response.status not in (307, 404):
            raise NotFound(f"unload of {topic} at {http_url} failed: HTTP {response.status}")


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
_OBJECTS = {"type": "array", "items": {"type": "object"}}

ROUTES: list[Route] = [
    Route("PUT", f"{V2}/persistent/{{tenant}}/{{namespace}}/{{topic}}/unload", unload_topic,
          "Unload a topic: its owner closes it and hands it to another broker "
          "(?destinationBroker=host:port).", "persistent", errors=(307, 400, 404)),
    Route("PUT", f"{V2}/namespaces/{{tenant}}/{{namespace}}/unload", unload_namespace,
          "Unload every topic of a namespace.", "namespaces"),
    Route("PUT", f"{V2}/namespaces/{{tenant}}/{{namespace}}/{{bundle}}/unload", unload_namespace,
          "Unload a namespace bundle (one bundle covers the namespace).", "namespaces"),
    Route("GET", f"{V2}/brokers/{{cluster}}", list_brokers, "Live brokers of a cluster.",
          "brokers", response_schema=_STRINGS, errors=(404,)),
    Route("GET", f"{V2}/brokers/{{cluster}}/load", broker_load,
          "Live brokers with their addresses and load.", "brokers",
          response_schema=_OBJECTS, errors=(404,)),
]  # fmt: skip

"""Admin routes of ``non-persistent://`` topics (upstream's ``/admin/v2/non-persistent``).

A non-persistent topic exists while it is loaded (nothing of it is stored), so these
routes act on the loaded topic: on a standalone broker the one here, in cluster mode its
owner (another broker's topic answers 307 to it, as for persistent topics). Topic lists
name what is loaded here and, in cluster mode, every topic another broker owns.

* ``GET /admin/v2/non-persistent/{t}/{ns}``: the namespace's non-persistent topics.
* ``GET .../{topic}/stats``: ``NonPersistentTopicStats`` (publishers, subscriptions with
  ``msgDropRate`` and consumers, ``msgRateIn``/``msgRateOut``; ``msgDropCounter`` too).
* ``GET .../{topic}/subscriptions``, ``GET .../{topic}/partitions`` (always 0: they are
  not partitioned here), ``PUT .../{topic}/unload``.
* ``DELETE .../{topic}[?force]``: 409 while producers or consumers are connected unless
  ``force`` (which disconnects them).

Example:
    >>> sorted({r.tag for r in ROUTES})
    ['non-persistent']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from anabranch.admin.routes import Route, flag, namespace_param, topic_param
from anabranch.broker.cluster.ownership import ClusterOwnership
from anabranch.broker.nonpersistent import NonPersistentTopic
from anabranch.broker.nonpersistent_names import non_persistent_topic_names
from anabranch.core.names import NamespaceName, TopicDomain, TopicName
from anabranch.errors import NotEmpty

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

DOMAIN = TopicDomain.NON_PERSISTENT.value
V2 = "/admin/v2"
NPT = f"{V2}/{DOMAIN}/{{tenant}}/{{namespace}}"
TOPIC = f"{NPT}/{{topic}}"

STRINGS = {"type": "array", "items": {"type": "string"}}
OBJECT = {"type": "object"}
PARTITIONS = {"type": "object", "properties": {"partitions": {"type": "integer"}}}


async def non_persistent_topics(admin: AdminService, namespace: str) -> list[str]:
    """The namespace's non-persistent topics: loaded here, plus (cluster mode) owned by
    another broker. NotFound for an unknown namespace.

    Example:
        >>> async def demo(admin: AdminService) -> None:
        ...     assert await non_persistent_topics(admin, "public/default") == []
    """
    ns = NamespaceName.parse(namespace)
    await admin.policies.namespace_policies(str(ns))
    return await non_persistent_topic_names(admin.broker, ns)


async def _topic(admin: AdminService, request: web.Request) -> NonPersistentTopic:
    return await admin.broker.get_non_persistent_topic(topic_param(request, DOMAIN), create=False)


async def list_topics(admin: AdminService, request: web.Request) -> object:
    return await non_persistent_topics(admin, namespace_param(request))


async def topic_stats(admin: AdminService, request: web.Request) -> object:
    return (await _topic(admin, request)).stats()


async def list_subscriptions(admin: AdminService, request: web.Request) -> object:
    return sorted((await _topic(admin, request)).subscriptions)


async def get_partitions(admin: AdminService, request: web.Request) -> object:
    await admin.policies.namespace_policies(namespace_param(request))
    return {"partitions": 0}


async def delete_topic(admin: AdminService, request: web.Request) -> object:
    topic = await _topic(admin, request)
    if topic.in_use and not flag(request, "force"):
        consumers = sum(len(s.consumers) for s in topic.subscriptions.values())
        raise NotEmpty(
            topic.name,
            f"{len(topic.producers)} producers and {consumers} consumers are connected",
        )
    await admin.broker.delete_non_persistent_topic(topic.name)
    return None


async def unload_topic(admin: AdminService, request: web.Request) -> object:
    name = str(TopicName.parse(topic_param(request, DOMAIN)))
    ownership = admin.broker.ownership
    if isinstance(ownership, ClusterOwnership):
        await ownership.unload(name, request.query.get("destinationBroker") or None)
    else:
        await admin.broker.unload_topic(name)
    return None


ROUTES: list[Route] = [
    Route("GET", NPT, list_topics, "List non-persistent topics.", DOMAIN,
          response_schema=STRINGS),
    Route("DELETE", TOPIC, delete_topic, "Delete (close and forget) a non-persistent topic.",
          DOMAIN, query=("force",), errors=(404, 409)),
    Route("GET", f"{TOPIC}/stats", topic_stats, "Non-persistent topic stats (with drops).",
          DOMAIN, response_schema=OBJECT),
    Route("GET", f"{TOPIC}/subscriptions", list_subscriptions, "List subscriptions.", DOMAIN,
          response_schema=STRINGS),
    Route("GET", f"{TOPIC}/partitions", get_partitions,
          "Partitioned-topic metadata (always 0 partitions).", DOMAIN,
          response_schema=PARTITIONS),
    Route("PUT", f"{TOPIC}/unload", unload_topic,
          "Unload the topic (what it held is lost; clients reconnect).", DOMAIN,
          errors=(307, 404)),
]  # fmt: skip

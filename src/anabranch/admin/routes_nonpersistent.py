"""Admin routes of ``non-persistent://`` topics (upstream's ``/admin/v2/non-persistent``).

A non-persistent topic exists while it is loaded (nothing of it is stored), so these
routes act on the loaded topic: on a standalone broker the one here, in cluster mode its
owner (another broker's topic answers 307 to it, as for persistent topics). Topic lists
name what is loaded here and, in cluster mode, every topic another broker owns.

* ``GET /admin/v2/non-persistent/{t}/{ns}``: the namespace's non-persistent topics.
* ``GET .../{topic}/stats``: ``NonPersistentTopicStats`` (publishers, subscriptions with
  ``msgDropRate`` and consumers, ``msgRateIn``/``msgRateOut``; ``msgDropCounter`` too).
* ``GET .../{topic}/subscriptions``, ``PUT .../{topic}/unload``.
* ``DELETE .../{topic}[?force]``: 409 while producers or consumers are connected unless
  ``force`` (which disconnects them).
* Partitioned topics: ``PUT/POST/GET/DELETE .../{topic}/partitions`` (create with N, raise
  N, read N, delete), ``GET .../{topic}/partitioned-stats[?perPartition]``, ``GET
  /admin/v2/non-persistent/{t}/{ns}/partitioned``. Only the partition count is stored
  (the metadata store, as upstream); each partition is a non-persistent topic, loaded when
  a client first uses it.

Example:
    >>> sorted({r.tag for r in ROUTES})
    ['non-persistent']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from anabranch.admin.routes import (
    Route,
    flag,
    namespace_param,
    partition_count,
    topic_param,
)
from anabranch.broker.cluster.ownership import ClusterOwnership
from anabranch.broker.nonpersistent import NonPersistentTopic
from anabranch.broker.nonpersistent_names import non_persistent_topic_names
from anabranch.core.names import NamespaceName, TopicDomain, TopicName
from anabranch.errors import InvalidArgument, NotEmpty, NotFound

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

DOMAIN = TopicDomain.NON_PERSISTENT.value
V2 = "/admin/v2"
NPT = f"{V2}/{DOMAIN}/{{tenant}}/{{namespace}}"
TOPIC = f"{NPT}/{{topic}}"

STRINGS = {"type": "array", "items": {"type": "string"}}
OBJECT = {"type": "object"}
INTEGER = {"type": "integer"}
PARTITIONS = {"type": "object", "properties": {"partitions": INTEGER}}


async def non_persistent_topics(admin: AdminService, namespace: str) -> list[str]:
    """The namespace's non-persistent topics: loaded here, plus (cluster mode) owned by
    another broker. NotFound for an unknown namespace.

    Example:
        >>> import asyncio, tempfile
        >>> from pathlib import Path
        >>> from anabranch.admin.service import AdminService
        >>> from anabranch.testing.broker import InProcessBroker
        >>> async def demo(admin: AdminService) -> None:
        ...     assert await non_persistent_topics(admin, "public/default") == []
        ...     await admin.broker.get_non_persistent_topic(
        ...         "non-persistent://public/default/t", create=True)
        ...     print(await non_persistent_topics(admin, "public/default"))
        >>> async def main() -> None:
        ...     with tempfile.TemporaryDirectory() as tmp:
        ...         async with InProcessBroker(Path(tmp)) as broker:
        ...             await demo(AdminService(broker.service))
        >>> asyncio.run(main())
        ['non-persistent://public/default/t']
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
    return {"partitions": await admin.policies.get_partitions(topic_param(request, DOMAIN))}


async def create_partitions(admin: AdminService, request: web.Request) -> object:
    name = TopicName.parse(topic_param(request, DOMAIN))
    if name.partition is not None:
        raise InvalidArgument(f"{name} is a partition name")
    if admin.broker.loaded_non_persistent_topic(str(name)) is not None:
        raise NotEmpty(str(name), "a non-partitioned topic of that name is loaded")
    await admin.policies.create_partitioned_topic(name, await partition_count(request))
    return None


async def update_partitions(admin: AdminService, request: web.Request) -> object:
    name = topic_param(request, DOMAIN)
    await admin.policies.update_partitioned_topic(name, await partition_count(request))
    return None


async def _partitioned(admin: AdminService, request: web.Request) -> tuple[TopicName, int]:
    """The partitioned topic the request names, with its partition count (NotFound when
    it is not partitioned)."""
    name = TopicName.parse(topic_param(request, DOMAIN))
    partitions = await admin.policies.get_partitions(name)
    if partitions == 0:
        raise NotFound(f"partitioned topic {name}")
    return name, partitions


async def delete_partitions(admin: AdminService, request: web.Request) -> object:
    name, partitions = await _partitioned(admin, request)
    loaded = [
        topic
        for index in range(partitions)
        if (topic := admin.broker.loaded_non_persistent_topic(str(name.with_partition(index))))
        is not None
    ]
    busy = [topic.name for topic in loaded if topic.in_use]
    if busy and not flag(request, "force"):
        raise NotEmpty(str(name), f"{len(busy)} partitions have producers or consumers")
    for topic in loaded:
        await admin.broker.delete_non_persistent_topic(topic.name)
    await admin.policies.delete_partitioned_topic(name)
    return None


async def partitioned_stats(admin: AdminService, request: web.Request) -> object:
    """Sums over the partitions loaded here (in cluster mode: those this broker owns)."""
    name, partitions = await _partitioned(admin, request)
    summed = ("msgRateIn", "msgRateOut", "msgThroughputIn", "msgThroughputOut", "msgDropRate",
              "msgInCounter", "bytesInCounter", "msgOutCounter", "bytesOutCounter",
              "msgDropCounter")  # fmt: skip
    total: dict[str, Any] = {"metadata": {"partitions": partitions}, "partitions": {}}
    total.update(dict.fromkeys(summed, 0))
    for index in range(partitions):
        topic = admin.broker.loaded_non_persistent_topic(str(name.with_partition(index)))
        if topic is None:
            continue
        stats = topic.stats()
        total["partitions"][topic.name] = stats
        for key in summed:
            total[key] += stats.get(key, 0)
    if not flag(request, "perPartition"):
        total.pop("partitions")
    return total


async def list_partitioned(admin: AdminService, request: web.Request) -> object:
    ns = namespace_param(request)
    await admin.policies.namespace_policies(ns)
    return await admin.policies.list_partitioned_topics(ns, TopicDomain.NON_PERSISTENT)


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
          "Partitioned-topic metadata (0 partitions: not partitioned).", DOMAIN,
          response_schema=PARTITIONS),
    Route("PUT", f"{TOPIC}/partitions", create_partitions,
          "Create a partitioned non-persistent topic.", DOMAIN, request_schema=INTEGER,
          errors=(400, 404, 409)),
    Route("POST", f"{TOPIC}/partitions", update_partitions,
          "Increase the number of partitions.", DOMAIN, request_schema=INTEGER),
    Route("DELETE", f"{TOPIC}/partitions", delete_partitions,
          "Delete a partitioned non-persistent topic (its loaded partitions close).", DOMAIN,
          query=("force",), errors=(404, 409)),
    Route("GET", f"{TOPIC}/partitioned-stats", partitioned_stats,
          "Stats summed over the partitions loaded here.", DOMAIN, response_schema=OBJECT,
          query=("perPartition",)),
    Route("GET", f"{NPT}/partitioned", list_partitioned,
          "List partitioned non-persistent topics.", DOMAIN, response_schema=STRINGS),
    Route("PUT", f"{TOPIC}/unload", unload_topic,
          "Unload the topic (what it held is lost; clients reconnect).", DOMAIN,
          errors=(307, 404)),
]  # fmt: skip

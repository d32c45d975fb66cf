"""Who may call each admin HTTP route: one table, route → required permission.

:data:`ROUTE_ACCESS` maps every ``(method, path template)`` the app serves to a
:class:`~anabranch.core.authz.Need` (``core/authz.py`` has the model). The resource a
scoped need is checked on comes from the path: ``{topic}`` (with its domain: the
``/persistent/`` routes name ``persistent://`` topics, the ``/non-persistent/`` routes
``non-persistent://`` ones, the scalable, segment and cluster routes ``topic://`` ones,
the lookup routes their ``{domain}``), else ``{namespace}``,
else ``{tenant}``. In short::

    routes                                                   need
    /metrics, /openapi.json, brokers/health                  NONE
    GET clusters; transaction batches of a sink              AUTHENTICATED
    lookups; topic stats, partitions (GET), subscriptions    LOOKUP (produce or consume)
    subscription create/delete, skip, reset cursor           CONSUME
    topic lists of a namespace                               NAMESPACE
    tenant (GET), namespaces, topics, permissions, unload,   TENANT_ADMIN of {tenant}
      split/merge, transaction buffer/pending-ack stats
    clusters (but GET list), tenants (but GET one),          SUPERUSER
      brokers, segments, coordinator stats, transaction keys
    /admin/v2/cluster/* (controller-to-broker calls)         CLUSTER

:func:`authorization_middleware` enforces it with the role the authentication middleware
stored in ``request["anabranch.role"]`` (absent or None: authentication is off and
everything is allowed, as before). A route missing from the table is refused to everyone
but superusers; ``tests/admin/test_authorization_matrix.py`` fails on such a route.

Example:
    >>> ROUTE_ACCESS["DELETE", "/admin/v2/cluster/segments/{tenant}/{namespace}/{topic}/"
    ...              "{descriptor}"]
    <Need.CLUSTER: 'cluster'>
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Middleware

from anabranch.broker.authorization import NONE_RESOURCE, Resource
from anabranch.core.authz import Need

if TYPE_CHECKING:
    from anabranch.broker.authorization import Authorizer

ROLE_KEY = "anabranch.role"
"""Where the authentication middleware leaves the request's role (None: auth off)."""

V2 = "/admin/v2"
NS = f"{V2}/namespaces/{{tenant}}/{{namespace}}"
PT = f"{V2}/persistent/{{tenant}}/{{namespace}}"
TOPIC = f"{PT}/{{topic}}"
SUB = f"{TOPIC}/subscription/{{subscription}}"
SC = f"{V2}/scalable/{{tenant}}/{{namespace}}"
SEG = f"{V2}/segments/{{tenant}}/{{namespace}}/{{topic}}/{{descriptor}}"
OWNED = f"{V2}/cluster/segments/{{tenant}}/{{namespace}}/{{topic}}/{{descriptor}}"
LOOKUP = "/lookup/v2/topic/{domain}/{tenant}/{namespace}/{topic}"
SCHEMAS = f"{V2}/schemas/{{tenant}}/{{namespace}}/{{topic}}"
NPT = f"{V2}/non-persistent/{{tenant}}/{{namespace}}"

N = Need


def _txn(base: str) -> dict[tuple[str, str], Need]:
    """The transaction read routes under ``base`` (v2 and v3 serve the same)."""
    return {
        ("GET", f"{base}/coordinatorStats"): N.SUPERUSER,
        ("GET", f"{base}/transactionMetadata/{{mostSigBits}}/{{leastSigBits}}"): N.SUPERUSER,
        ("GET", f"{base}/slowTransactions/{{timeout}}"): N.SUPERUSER,
        ("GET", f"{base}/transactionBufferStats/{{tenant}}/{{namespace}}/{{topic}}"): (
            N.TENANT_ADMIN
        ),
        (
            "GET",
            f"{base}/transactionBufferStats/segment/{{tenant}}/{{namespace}}/{{topic}}"
            "/{descriptor}",
        ): N.TENANT_ADMIN,
        ("GET", f"{base}/pendingAckStats/{{tenant}}/{{namespace}}/{{topic}}/{{subName}}"): (
            N.TENANT_ADMIN
        ),
        (
            "GET",
            f"{base}/pendingAckStats/segment/{{tenant}}/{{namespace}}/{{topic}}/{{descriptor}}"
            "/{subName}",
        ): N.TENANT_ADMIN,
        ("GET", f"{base}/transaction-keys"): N.SUPERUSER,
        ("GET", f"{base}/transaction-keys/{{transactionKey}}"): N.SUPERUSER,
        ("DELETE", f"{base}/transaction-keys/{{transactionKey}}"): N.SUPERUSER,
    }


ROUTE_ACCESS: dict[tuple[str, str], Need] = {
    # clusters and tenants
    ("GET", f"{V2}/clusters"): N.AUTHENTICATED,
    ("GET", f"{V2}/clusters/{{cluster}}"): N.SUPERUSER,
    ("PUT", f"{V2}/clusters/{{cluster}}"): N.SUPERUSER,
    ("POST", f"{V2}/clusters/{{cluster}}"): N.SUPERUSER,
    ("DELETE", f"{V2}/clusters/{{cluster}}"): N.SUPERUSER,
    ("GET", f"{V2}/tenants"): N.SUPERUSER,
    ("GET", f"{V2}/tenants/{{tenant}}"): N.TENANT_ADMIN,
    ("PUT", f"{V2}/tenants/{{tenant}}"): N.SUPERUSER,
    ("POST", f"{V2}/tenants/{{tenant}}"): N.SUPERUSER,
    ("DELETE", f"{V2}/tenants/{{tenant}}"): N.SUPERUSER,
    # namespaces
    ("GET", f"{V2}/namespaces/{{tenant}}"): N.TENANT_ADMIN,
    ("GET", f"{NS}/topics"): N.NAMESPACE,
    ("GET", f"{NS}/deduplication"): N.TENANT_ADMIN,
    ("POST", f"{NS}/deduplication"): N.TENANT_ADMIN,
    ("DELETE", f"{NS}/deduplication"): N.TENANT_ADMIN,
    ("GET", f"{NS}/scalableTopicEnabled"): N.TENANT_ADMIN,
    ("POST", f"{NS}/scalableTopicEnabled"): N.TENANT_ADMIN,
    ("DELETE", f"{NS}/scalableTopicEnabled"): N.TENANT_ADMIN,
    # Retention, message TTL and backlog quotas (admin/routes_retention.py): namespace
    # policies and topic overrides, the tenant's admins' as in Pulsar.
    **{
        (method, f"{base}/{policy}"): N.TENANT_ADMIN
        for base in (NS, TOPIC)
        for method, policy in (
            ("GET", "retention"),
            ("POST", "retention"),
            ("DELETE", "retention"),
            ("GET", "messageTTL"),
            ("POST", "messageTTL"),
            ("DELETE", "messageTTL"),
            ("GET", "backlogQuotaMap"),
            ("POST", "backlogQuota"),
            ("DELETE", "backlogQuota"),
        )
    },
    # Tiered storage (admin/routes_offload.py): namespace offload policies and the topic
    # trigger/status, the tenant's admins' as in Pulsar.
    **{
        (method, f"{NS}/{policy}"): N.TENANT_ADMIN
        for policy in ("offloadThreshold", "offloadThresholdInSeconds", "offloadDeletionLagMs")
        for method in ("GET", "PUT", "POST", "DELETE")
    },
    **{
        (method, f"{base}/offloadPolicies"): N.TENANT_ADMIN
        for base in (NS, TOPIC)
        for method in ("GET", "POST", "DELETE")
    },
    ("PUT", f"{TOPIC}/offload"): N.TENANT_ADMIN,
    ("GET", f"{TOPIC}/offload"): N.TENANT_ADMIN,
    # Stored messages (admin/routes_messages.py): what a consumer may read or acknowledge.
    ("GET", f"{SUB}/position/{{messagePosition}}"): N.CONSUME,
    ("GET", f"{TOPIC}/examinemessage"): N.CONSUME,
    ("GET", f"{TOPIC}/ledger/{{ledgerId}}/entry/{{entryId}}"): N.CONSUME,
    ("POST", f"{SUB}/expireMessages/{{expireTimeInSeconds}}"): N.CONSUME,
    ("POST", f"{TOPIC}/all_subscription/expireMessages/{{expireTimeInSeconds}}"): N.CONSUME,
    # Schemas (admin/routes_schemas.py): reading needs what a lookup needs, registering
    # what a producer needs; deleting and strategies are the tenant's admins'.
    ("GET", f"{SCHEMAS}/schema"): N.LOOKUP,
    ("GET", f"{SCHEMAS}/schema/{{version}}"): N.LOOKUP,
    ("GET", f"{SCHEMAS}/schemas"): N.LOOKUP,
    ("POST", f"{SCHEMAS}/compatibility"): N.LOOKUP,
    ("POST", f"{SCHEMAS}/version"): N.LOOKUP,
    ("POST", f"{SCHEMAS}/schema"): N.PRODUCE,
    ("DELETE", f"{SCHEMAS}/schema"): N.TENANT_ADMIN,
    **{
        (method, f"{base}/schemaCompatibilityStrategy"): N.TENANT_ADMIN
        for base in (NS, TOPIC)
        for method in ("GET", "PUT", "DELETE")
    },
    ("PUT", NS): N.TENANT_ADMIN,
    ("GET", NS): N.TENANT_ADMIN,
    ("DELETE", NS): N.TENANT_ADMIN,
    ("GET", f"{NS}/permissions"): N.TENANT_ADMIN,
    ("POST", f"{NS}/permissions/{{role}}"): N.TENANT_ADMIN,
    ("DELETE", f"{NS}/permissions/{{role}}"): N.TENANT_ADMIN,
    ("PUT", f"{NS}/unload"): N.TENANT_ADMIN,
    ("PUT", f"{NS}/{{bundle}}/unload"): N.TENANT_ADMIN,
    # persistent topics
    ("GET", PT): N.NAMESPACE,
    ("GET", f"{PT}/partitioned"): N.NAMESPACE,
    ("PUT", TOPIC): N.TENANT_ADMIN,
    ("DELETE", TOPIC): N.TENANT_ADMIN,
    ("PUT", f"{TOPIC}/partitions"): N.TENANT_ADMIN,
    ("POST", f"{TOPIC}/partitions"): N.TENANT_ADMIN,
    ("GET", f"{TOPIC}/partitions"): N.LOOKUP,
    ("DELETE", f"{TOPIC}/partitions"): N.TENANT_ADMIN,
    ("GET", f"{TOPIC}/stats"): N.LOOKUP,
    ("GET", f"{TOPIC}/partitioned-stats"): N.LOOKUP,
    ("GET", f"{TOPIC}/internalStats"): N.TENANT_ADMIN,
    ("POST", f"{TOPIC}/terminate"): N.TENANT_ADMIN,
    ("PUT", f"{TOPIC}/unload"): N.TENANT_ADMIN,
    ("GET", f"{TOPIC}/permissions"): N.TENANT_ADMIN,
    ("POST", f"{TOPIC}/permissions/{{role}}"): N.TENANT_ADMIN,
    ("DELETE", f"{TOPIC}/permissions/{{role}}"): N.TENANT_ADMIN,
    ("GET", f"{TOPIC}/subscriptions"): N.LOOKUP,
    ("PUT", SUB): N.CONSUME,
    ("DELETE", SUB): N.CONSUME,
    ("POST", f"{SUB}/skip_all"): N.CONSUME,
    ("POST", f"{SUB}/skip/{{count}}"): N.CONSUME,
    ("POST", f"{SUB}/resetcursor/{{timestamp}}"): N.CONSUME,
    ("POST", f"{SUB}/resetcursor"): N.CONSUME,
    # non-persistent topics (admin/routes_nonpersistent.py): the persistent routes' needs
    ("GET", NPT): N.NAMESPACE,
    ("DELETE", f"{NPT}/{{topic}}"): N.TENANT_ADMIN,
    ("GET", f"{NPT}/{{topic}}/stats"): N.LOOKUP,
    ("GET", f"{NPT}/{{topic}}/subscriptions"): N.LOOKUP,
    ("GET", f"{NPT}/{{topic}}/partitions"): N.LOOKUP,
    ("PUT", f"{NPT}/{{topic}}/partitions"): N.TENANT_ADMIN,
    ("POST", f"{NPT}/{{topic}}/partitions"): N.TENANT_ADMIN,
    ("DELETE", f"{NPT}/{{topic}}/partitions"): N.TENANT_ADMIN,
    ("GET", f"{NPT}/{{topic}}/partitioned-stats"): N.LOOKUP,
    ("GET", f"{NPT}/partitioned"): N.NAMESPACE,
    ("PUT", f"{NPT}/{{topic}}/unload"): N.TENANT_ADMIN,
    # lookup and health
    ("GET", LOOKUP): N.LOOKUP,
    ("GET", f"{LOOKUP}/{{segment}}"): N.LOOKUP,
    ("GET", f"{V2}/brokers/health"): N.NONE,
    ("GET", f"{V2}/brokers/{{cluster}}"): N.SUPERUSER,
    ("GET", f"{V2}/brokers/{{cluster}}/load"): N.SUPERUSER,
    # scalable topics
    ("GET", SC): N.NAMESPACE,
    ("PUT", f"{SC}/{{topic}}"): N.TENANT_ADMIN,
    ("GET", f"{SC}/{{topic}}"): N.LOOKUP,
    ("DELETE", f"{SC}/{{topic}}"): N.TENANT_ADMIN,
    ("GET", f"{SC}/{{topic}}/stats"): N.LOOKUP,
    ("GET", f"{SC}/{{topic}}/subscriptions"): N.LOOKUP,
    ("PUT", f"{SC}/{{topic}}/subscriptions/{{subscription}}"): N.CONSUME,
    ("DELETE", f"{SC}/{{topic}}/subscriptions/{{subscription}}"): N.CONSUME,
    ("POST", f"{SC}/{{topic}}/split/{{segmentId}}"): N.TENANT_ADMIN,
    ("POST", f"{SC}/{{topic}}/merge/{{id1}}/{{id2}}"): N.TENANT_ADMIN,
    ("GET", f"{SC}/{{topic}}/permissions"): N.TENANT_ADMIN,
    ("POST", f"{SC}/{{topic}}/permissions/{{role}}"): N.TENANT_ADMIN,
    ("DELETE", f"{SC}/{{topic}}/permissions/{{role}}"): N.TENANT_ADMIN,
    ("GET", f"{SC}/{{topic}}/autoscale"): N.TENANT_ADMIN,
    ("POST", f"{SC}/{{topic}}/autoscale"): N.TENANT_ADMIN,
    ("DELETE", f"{SC}/{{topic}}/autoscale"): N.TENANT_ADMIN,
    ("GET", f"{NS}/scalableAutoscale"): N.TENANT_ADMIN,
    ("POST", f"{NS}/scalableAutoscale"): N.TENANT_ADMIN,
    ("DELETE", f"{NS}/scalableAutoscale"): N.TENANT_ADMIN,
    # segment topics: the data under a scalable topic's layout
    ("PUT", SEG): N.SUPERUSER,
    ("POST", f"{SEG}/terminate"): N.SUPERUSER,
    ("DELETE", SEG): N.SUPERUSER,
    ("PUT", f"{SEG}/unload"): N.TENANT_ADMIN,
    # controller-to-broker and broker-to-broker calls
    ("GET", f"{OWNED}/owner"): N.CLUSTER,
    ("PUT", OWNED): N.CLUSTER,
    ("POST", f"{OWNED}/terminate"): N.CLUSTER,
    ("POST", f"{OWNED}/seedDedup"): N.CLUSTER,
    ("GET", f"{OWNED}/subscriptions"): N.CLUSTER,
    ("GET", f"{OWNED}/backlog/{{subscription}}"): N.CLUSTER,
    ("DELETE", f"{OWNED}/subscriptions/{{subscription}}"): N.CLUSTER,
    ("DELETE", OWNED): N.CLUSTER,
    ("GET", f"{OWNED}/load"): N.CLUSTER,
    # transactions
    **_txn(f"{V2}/transactions"),
    **_txn("/admin/v3/transactions"),
    ("PUT", f"{V2}/transactions/batches/{{sinkKey}}/{{batchId}}"): N.AUTHENTICATED,
    ("POST", f"{V2}/transactions/batches/{{sinkKey}}/{{batchId}}/commit"): N.AUTHENTICATED,
    ("POST", f"{V2}/transactions/batches/{{sinkKey}}/{{batchId}}/abort"): N.AUTHENTICATED,
    ("GET", f"{V2}/transactions/batches/{{sinkKey}}/{{batchId}}"): N.AUTHENTICATED,
    # Topic compaction (admin/routes_compaction.py): the tenant's admins', as in Pulsar.
    ("PUT", f"{TOPIC}/compaction"): N.TENANT_ADMIN,
    ("GET", f"{TOPIC}/compaction"): N.TENANT_ADMIN,
    ("PUT", f"{SEG}/compaction"): N.TENANT_ADMIN,
    ("GET", f"{SEG}/compaction"): N.TENANT_ADMIN,
    ("PUT", f"{SC}/{{topic}}/compaction"): N.TENANT_ADMIN,
    **{
        (method, f"{base}/compactionThreshold"): N.TENANT_ADMIN
        for base in (NS, TOPIC)
        for method in ("GET", "POST", "DELETE")
    },
    # Inactive topic policies, subscription expiration (admin/routes_inactive_topics.py),
    # publish, dispatch and subscribe rates (admin/routes_rates.py): the tenant's admins'.
    **{
        (method, path): N.TENANT_ADMIN
        for path in (
            f"{NS}/inactiveTopicPolicies",
            f"{TOPIC}/inactiveTopicPolicies",
            f"{NS}/subscriptionExpirationTime",
            f"{NS}/publishRate",
            f"{TOPIC}/publishRate",
            f"{NS}/dispatchRate",
            f"{TOPIC}/dispatchRate",
            f"{NS}/subscriptionDispatchRate",
            f"{TOPIC}/subscriptionDispatchRate",
            f"{NS}/subscribeRate",
            f"{TOPIC}/subscribeRate",
        )
        for method in ("GET", "POST", "DELETE")
    },
    # Per-topic caps (admin/routes_topic_limits.py): the tenant's admins', as in Pulsar.
    **{
        (method, f"{base}/{policy}"): N.TENANT_ADMIN
        for base, names in (
            (NS, ("maxProducersPerTopic", "maxConsumersPerTopic")),
            (TOPIC, ("maxProducers", "maxConsumers")),
            (NS, ("maxConsumersPerSubscription", "maxSubscriptionsPerTopic")),
            (TOPIC, ("maxConsumersPerSubscription", "maxSubscriptionsPerTopic")),
            (NS, ("maxUnackedMessagesPerConsumer", "maxUnackedMessagesPerSubscription")),
            (TOPIC, ("maxUnackedMessagesOnConsumer", "maxUnackedMessagesOnSubscription")),
        )
        for policy in names
        for method in ("GET", "POST", "DELETE")
    },
    # the app's own
    ("GET", "/metrics"): N.NONE,
    ("GET", "/openapi.json"): N.NONE,
}
"""Every admin route → what it needs (see the module docstring)."""

UNLISTED = Need.SUPERUSER
"""What a route missing from the table needs (fail closed)."""

_SCALABLE_PREFIXES = (f"{V2}/scalable/", f"{V2}/segments/", f"{V2}/cluster/segments/")


def route_resource(path_template: str, match: dict[str, str]) -> Resource:
    """The resource a route's path names (see the module docstring).

    Example:
        >>> route_resource(TOPIC, {"tenant": "a", "namespace": "b", "topic": "c"})
        Resource(tenant='a', namespace='a/b', topic='persistent://a/b/c')
        >>> route_resource(f"{SC}/{{topic}}", {"tenant": "a", "namespace": "b", "topic": "c"})
        Resource(tenant='a', namespace='a/b', topic='topic://a/b/c')
        >>> route_resource(f"{NPT}/{{topic}}/stats", {"tenant": "a", "namespace": "b",
        ...                                          "topic": "c"}).topic
        'non-persistent://a/b/c'
        >>> route_resource(f"{V2}/tenants/{{tenant}}", {"tenant": "a"})
        Resource(tenant='a', namespace=None, topic=None)
    """
    tenant, namespace = match.get("tenant"), match.get("namespace")
    if tenant is None:
        return NONE_RESOURCE
    if namespace is None:
        return Resource(tenant)
    topic = match.get("topic")
    if topic is None:
        return Resource.of_namespace(f"{tenant}/{namespace}")
    if "domain" in match:
        domain = match["domain"]
    elif path_template.startswith(_SCALABLE_PREFIXES) or "/segment/" in path_template:
        domain = "topic"
    elif path_template.startswith(f"{V2}/non-persistent/"):
        domain = "non-persistent"
    else:
        domain = "persistent"
    return Resource.of_topic(f"{domain}://{tenant}/{namespace}/{topic}")


def access_of(method: str, path_template: str) -> Need:
    """What a route needs (``UNLISTED`` for a route missing from the table)."""
    return ROUTE_ACCESS.get((method, path_template), UNLISTED)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def authorization_middleware(authorizer: Callable[[web.Request], Authorizer]) -> Middleware:
    """The aiohttp middleware enforcing :data:`ROUTE_ACCESS` (``authorizer(request)`` gives
    the broker's :class:`~anabranch.broker.authorization.Authorizer`)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        role = request.get(ROLE_KEY)
        route = request.match_info.route
        if role is None or request.match_info.http_exception is not None:
            return await handler(request)  # auth off, or aiohttp answers 404/405 itself
        template = route.resource.canonical if route.resource is not None else request.path
        need = access_of(request.method, template)
        match = dict(request.match_info)
        if template.startswith(f"{V2}/schemas/") and request.query.get("domain") == "topic":
            match["domain"] = "topic"  # the schema routes' ?domain= names the topic's scheme
        resource = route_resource(template, match)
        # The refusal names the request as sent (its path names the resource).
        what = f"{request.method} {request.path}"
        await authorizer(request).check(str(role), need, resource, what, named="")
        return await handler(request)

    return middleware

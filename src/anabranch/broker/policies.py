"""Clusters, tenants, namespaces, namespace policies, partitioned topics and the topic registry.

Everything here is a JSON record in the metadata store, written only by compare-and-set.
Records use Pulsar's admin JSON shapes so the admin API returns them unchanged.

Metadata paths (Pulsar keeps the same facts under ``/admin/...`` too)::

    /admin/clusters/{cluster}                        ClusterData {serviceUrl, brokerServiceUrl}
    /admin/tenants/{tenant}                          TenantInfo {adminRoles, allowedClusters}
    /admin/namespaces/{tenant}/{ns}                  NamespacePolicies {deduplicationEnabled, ..}
    /admin/partitioned-topics/{t}/{ns}/{domain}/{x}  PartitionedTopicMetadata {partitions}
    /admin/topics/{t}/{ns}/{domain}/{x}              TopicRecord {createdAtMs} (the registry)

Concurrency rules, each one a CAS so two admins (or brokers) never lose an update:

* creates put with ``expected_version=0`` (AlreadyExists when the key is there);
* updates take ``expected_version`` (BadVersion on mismatch); ``None`` means "the version I
  just read", retried a bounded number of times (``limits.POLICIES_CAS_RETRIES_MAX``);
* a namespace is created in one commit with a *put of its tenant at the version read*, so a
  tenant delete that read the tenant before listing its namespaces fails with BadVersion if
  a namespace appeared meanwhile (and then sees it and refuses with NotEmpty);
* a namespace delete first marks the policies ``deleted`` (Pulsar's flag), then lists its
  topics; topic registration commits with a Check of the namespace version it read while
  the namespace was not deleted, so no topic can slip in between the listing and the delete.

Names are validated with :mod:`anabranch.core.names` before anything is written; an invalid
name raises InvalidArgument and writes nothing.

Example:
    >>> import asyncio
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo(store: MetadataStore) -> None:
    ...     policies = Policies(store)
    ...     await policies.ensure_standalone_defaults()
    ...     await policies.create_partitioned_topic("persistent://public/default/orders", 4)
    ...     assert await policies.get_partitions("persistent://public/default/orders") == 4
    ...     ns = await policies.namespace_policies("public/default")
    ...     assert ns.deduplication_enabled is False      # off unless the namespace enables it
    ...     print(await policies.list_namespaces("public"))
    ...     await store.close()
    >>> asyncio.run(demo(MemoryMetadataStore()))
    ['public/default']
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from anabranch import limits
from anabranch.core.authz import validate_role
from anabranch.core.names import NamespaceName, TopicDomain, TopicName, validate_component
from anabranch.errors import (
    AlreadyExists,
    BadVersion,
    InvalidArgument,
    NotAllowed,
    NotEmpty,
    NotFound,
)
from anabranch.metadata.api import MUST_NOT_EXIST, Check, MetadataStore, Put, Record
from anabranch.metadata.cached_records import CachedRecords
from anabranch.metadata.record_cache import RecordCache
from anabranch.scalable.paths import namespace_path as scalable_namespace_path

ROOT = "/admin"
CLUSTERS = f"{ROOT}/clusters"
TENANTS = f"{ROOT}/tenants"
NAMESPACES = f"{ROOT}/namespaces"
PARTITIONED_TOPICS = f"{ROOT}/partitioned-topics"
TOPICS = f"{ROOT}/topics"

T = TypeVar("T")
R = TypeVar("R", bound=msgspec.Struct)


# --- records (Pulsar's admin JSON shapes) -------------------------------------------------


_PARTITIONABLE = (TopicDomain.PERSISTENT, TopicDomain.NON_PERSISTENT)
"""The domains whose topics may be partitioned (as in Pulsar)."""


class ClusterData(msgspec.Struct, rename="camel", kw_only=True):
    """A cluster's service URLs, as ``GET /admin/v2/clusters/{c}`` returns them."""

    service_url: str = ""
    broker_service_url: str = ""
    service_url_tls: str = ""
    broker_service_url_tls: str = ""


class TenantInfo(msgspec.Struct, rename="camel", kw_only=True):
    """Who administers a tenant and which clusters it may use."""

    admin_roles: list[str] = msgspec.field(default_factory=list)
    allowed_clusters: list[str] = msgspec.field(default_factory=list)


class RetentionPolicies(msgspec.Struct, kw_only=True):
    """How long/much acknowledged data is kept; -1 = unbounded, 0 = none (Pulsar's rule)."""

    retention_time_in_minutes: int = msgspec.field(default=0, name="retentionTimeInMinutes")
    retention_size_in_mb: int = msgspec.field(default=0, name="retentionSizeInMB")


class InactiveTopicPoliciesRecord(msgspec.Struct, kw_only=True, rename="camel"):
    """Pulsar's ``InactiveTopicPolicies`` JSON (``core/inactive_topics.py`` decides)."""

    inactive_topic_delete_mode: str = "delete_when_no_subscriptions"
    max_inactive_duration_seconds: int = 60
    delete_while_inactive: bool = False


class PublishRateRecord(msgspec.Struct, kw_only=True, rename="camel"):
    """Pulsar's ``PublishRate`` JSON (-1: no limit)."""

    publish_throttling_rate_in_msg: int = -1
    publish_throttling_rate_in_byte: int = -1


class DispatchRateRecord(msgspec.Struct, kw_only=True, rename="camel"):
    """Pulsar's ``DispatchRate`` JSON (-1: no limit; per ``ratePeriodInSecond``)."""

    dispatch_throttling_rate_in_msg: int = -1
    dispatch_throttling_rate_in_byte: int = -1
    relative_to_publish_rate: bool = False
    rate_period_in_second: int = 1


class SubscribeRateRecord(msgspec.Struct, kw_only=True, rename="camel"):
    """Pulsar's ``SubscribeRate`` JSON (-1: no limit; per ``ratePeriodInSecond``)."""

    subscribe_throttling_rate_per_consumer: int = -1
    rate_period_in_second: int = 30


class BacklogQuotaRecord(msgspec.Struct, kw_only=True):
    """One backlog quota as Pulsar's admin JSON has it (``limitSize`` bytes, ``limitTime``
    seconds, -1 unlimited; ``policy`` one of ``producer_request_hold``,
    ``producer_exception``, ``consumer_backlog_eviction``)."""

    limit_size: int = msgspec.field(default=-1, name="limitSize")
    limit_time: int = msgspec.field(default=-1, name="limitTime")
    policy: str = "producer_request_hold"


class OffloadPoliciesRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Pulsar's ``OffloadPolicies`` (the subset that applies here: thresholds and the
    deletion lag; the driver and bucket are the broker's). None: not set."""

    managed_ledger_offload_driver: str | None = msgspec.field(
        default=None, name="managedLedgerOffloadDriver"
    )
    managed_ledger_offload_threshold_in_bytes: int | None = msgspec.field(
        default=None, name="managedLedgerOffloadThresholdInBytes"
    )
    managed_ledger_offload_threshold_in_seconds: int | None = msgspec.field(
        default=None, name="managedLedgerOffloadThresholdInSeconds"
    )
    managed_ledger_offload_deletion_lag_in_millis: int | None = msgspec.field(
        default=None, name="managedLedgerOffloadDeletionLagInMillis"
    )


class AutoTopicCreationOverride(msgspec.Struct, rename="camel", kw_only=True):
    """Per-namespace override of the broker's ``allow_auto_topic_creation``."""

    allow_auto_topic_creation: bool = True
    topic_type: str = "non-partitioned"
    default_num_partitions: int | None = None


class AuthPolicies(msgspec.Struct, kw_only=True):
    """Who may produce/consume in a namespace and on its topics (Pulsar's ``AuthPolicies``;
    the JSON keys are upstream's). ``destination_auth`` is keyed by the full topic name
    (a partitioned topic's base name, a scalable topic's ``topic://`` name)."""

    namespace_auth: dict[str, list[str]] = msgspec.field(default_factory=dict)
    destination_auth: dict[str, dict[str, list[str]]] = msgspec.field(default_factory=dict)
    subscription_auth_roles: dict[str, list[str]] = msgspec.field(default_factory=dict)


class NamespacePolicies(msgspec.Struct, kw_only=True):
    """Per-namespace policies. ``None`` fields mean "the broker's configured default";
    deduplication is off unless enabled here (the broker has no global switch yet).

    Field names in JSON follow Pulsar's ``Policies`` class (a mix of snake and camel case).

    Example:
        >>> p = NamespacePolicies(deduplication_enabled=True)
        >>> (p.deduplication_enabled, p.allow_auto_topic_creation)
        (True, True)
    """

    replication_clusters: list[str] = msgspec.field(default_factory=list)
    deduplication_enabled: bool = msgspec.field(default=False, name="deduplicationEnabled")
    auto_topic_creation_override: AutoTopicCreationOverride | None = msgspec.field(
        default=None, name="autoTopicCreationOverride"
    )
    retention: RetentionPolicies | None = msgspec.field(default=None, name="retention_policies")
    message_ttl_in_seconds: int | None = None
    backlog_quota_map: dict[str, BacklogQuotaRecord] = msgspec.field(default_factory=dict)
    """Keyed by ``destination_storage`` / ``message_age`` (Pulsar's backlogQuotaType)."""
    max_producers_per_topic: int | None = None
    max_consumers_per_topic: int | None = None
    max_consumers_per_subscription: int | None = None
    max_subscriptions_per_topic: int | None = None
    max_unacked_messages_per_consumer: int | None = None
    max_unacked_messages_per_subscription: int | None = None
    inactive_topic_policies: InactiveTopicPoliciesRecord | None = None
    subscription_expiration_time_minutes: int | None = None
    publish_max_message_rate: dict[str, PublishRateRecord] = msgspec.field(
        default_factory=dict, name="publishMaxMessageRate"
    )
    """Keyed by cluster name, as upstream (a namespace may span clusters)."""
    topic_dispatch_rate: dict[str, DispatchRateRecord] = msgspec.field(
        default_factory=dict, name="topicDispatchRate"
    )
    """Each topic's dispatch rate, keyed by cluster name as upstream."""
    subscription_dispatch_rate: dict[str, DispatchRateRecord] = msgspec.field(
        default_factory=dict, name="subscriptionDispatchRate"
    )
    """Each subscription's dispatch rate, keyed by cluster name as upstream."""
    cluster_subscribe_rate: dict[str, SubscribeRateRecord] = msgspec.field(
        default_factory=dict, name="clusterSubscribeRate"
    )
    """Each consumer's subscribe rate, keyed by cluster name as upstream."""
    properties: dict[str, str] = msgspec.field(default_factory=dict)
    auth_policies: AuthPolicies = msgspec.field(default_factory=AuthPolicies)
    scalable_autoscale: dict[str, Any] | None = msgspec.field(
        default=None, name="scalableAutoscale"
    )
    """Overrides of the broker's ``scalable_autoscale_*`` defaults (camelCase keys of
    :class:`~anabranch.core.autoscale.AutoscalePolicy`); None: the broker's."""
    offload_threshold: int = -1
    """Bytes of hot data past which sealed ledgers are offloaded (-1: disabled)."""
    offload_threshold_in_seconds: int = -1
    offload_deletion_lag_ms: int | None = None
    offload_policies: OffloadPoliciesRecord | None = None
    schema_compatibility_strategy: str = "UNDEFINED"
    """Pulsar's ``SchemaCompatibilityStrategy`` name; UNDEFINED: the broker's default."""
    scalable_topic_enabled: bool | None = msgspec.field(default=None, name="scalableTopicEnabled")
    """Scalable topics in this namespace (None: the broker's ``scalable_topic_enabled``)."""
    compaction_threshold: int | None = None
    """Backlog bytes past which a topic is compacted automatically (None: the broker's
    default; 0: never)."""
    deleted: bool = False
    """Set while a namespace delete is in progress (Pulsar's flag); topics cannot register."""

    @property
    def allow_auto_topic_creation(self) -> bool:
        """False only when the namespace overrides auto-creation off; the broker ANDs it with
        its own ``allow_auto_topic_creation`` setting."""
        override = self.auto_topic_creation_override
        return True if override is None else override.allow_auto_topic_creation


class PartitionedTopicMetadata(msgspec.Struct, kw_only=True):
    """``{"partitions": N}`` as Pulsar's ``GET .../partitions`` returns it."""

    partitions: int
    properties: dict[str, str] = msgspec.field(default_factory=dict)


class TopicRecord(msgspec.Struct, rename="camel", kw_only=True):
    """One registered (created) topic or partition."""

    created_at_ms: int = 0


# --- paths -----------------------------------------------------------------------------------


def cluster_path(cluster: str) -> str:
    """``/admin/clusters/{cluster}``."""
    return f"{CLUSTERS}/{validate_component('cluster', cluster)}"


def tenant_path(tenant: str) -> str:
    """``/admin/tenants/{tenant}``."""
    return f"{TENANTS}/{validate_component('tenant', tenant)}"


def namespace_path(ns: NamespaceName) -> str:
    """``/admin/namespaces/{tenant}/{ns}``."""
    return f"{NAMESPACES}/{ns.tenant}/{ns.namespace}"


def partitioned_topic_path(topic: TopicName) -> str:
    """``/admin/partitioned-topics/{t}/{ns}/{domain}/{x}``."""
    ns = f"{topic.tenant}/{topic.namespace}"
    return f"{PARTITIONED_TOPICS}/{ns}/{topic.domain.value}/{topic.full_local_name}"


def topic_path(topic: TopicName) -> str:
    """``/admin/topics/{t}/{ns}/{domain}/{x[-partition-N]}``."""
    ns = f"{topic.tenant}/{topic.namespace}"
    return f"{TOPICS}/{ns}/{topic.domain.value}/{topic.full_local_name}"


def describe_path(path: str) -> str:
    """What the record at ``path`` stands for, in the admin API's own words: an error
    names the resource, not where the broker keeps it (anything else is returned as is).

    Example:
        >>> describe_path("/admin/topics/public/default/persistent/orders")
        'topic persistent://public/default/orders'
        >>> describe_path("/admin/namespaces/public/default")
        'namespace public/default'
    """
    for root, kind in (
        (CLUSTERS, "cluster"),
        (TENANTS, "tenant"),
        (NAMESPACES, "namespace"),
        (PARTITIONED_TOPICS, "partitioned topic"),
        (TOPICS, "topic"),
    ):
        if not path.startswith(root + "/"):
            continue
        rest = path[len(root) + 1 :]
        if root in (PARTITIONED_TOPICS, TOPICS):
            parts = rest.split("/", 3)
            if len(parts) == 4:
                tenant, namespace, domain, local = parts
                return f"{kind} {domain}://{tenant}/{namespace}/{local}"
        return f"{kind} {rest}"
    return path


def _ns(namespace: str | NamespaceName) -> NamespaceName:
    return namespace if isinstance(namespace, NamespaceName) else NamespaceName.parse(namespace)


def _topic(topic: str | TopicName) -> TopicName:
    return topic if isinstance(topic, TopicName) else TopicName.parse(topic)


def _decode(record: Record, kind: type[R]) -> R:
    try:
        return msgspec.json.decode(record.value, type=kind)
    except msgspec.DecodeError as err:
        # A record we cannot read is a bug or outside tampering, never a user error.
        raise InvalidArgument(f"{record.path}: unreadable {kind.__name__}: {err}") from err


def _encode(value: msgspec.Struct) -> bytes:
    return msgspec.json.encode(value)


class Policies:
    """Admin metadata over a :class:`MetadataStore`; every write is a compare-and-set.

    Example:
        >>> import asyncio
        >>> from anabranch.metadata.memory import MemoryMetadataStore
        >>> async def demo(store: MetadataStore) -> None:
        ...     p = Policies(store)
        ...     await p.create_cluster("c1", ClusterData(service_url="http://h:8080"))
        ...     await p.create_tenant("acme", TenantInfo(allowed_clusters=["c1"]))
        ...     await p.create_namespace("acme/orders")
        ...     print(await p.list_namespaces("acme"))
        ...     await store.close()
        >>> asyncio.run(demo(MemoryMetadataStore()))
        ['acme/orders']
    """

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self._records = CachedRecords(store)

    @property
    def cache(self) -> RecordCache | None:
        """The broker's cache of the records under ``/admin/`` (set by the broker): what
        producers, consumers and lookups read goes through it. Every write here forgets
        what it wrote, so this process reads its own writes."""
        return self._records.cache

    @cache.setter
    def cache(self, cache: RecordCache | None) -> None:
        self._records.cache = cache

    # --- helpers ------------------------------------------------------------------------------

    async def _read_cached(self, path: str, kind: type[R]) -> R:
        record = await self._records.get(path)
        if record is None:
            raise NotFound(path)
        return _decode(record, kind)

    async def _read(self, path: str, kind: type[R]) -> tuple[R, int]:
        record = await self.store.get(path)
        if record is None:
            raise NotFound(path)
        return _decode(record, kind), record.stat.version

    async def _update(
        self,
        path: str,
        kind: type[R],
        change: Callable[[R], R],
        expected_version: int | None,
    ) -> R:
        """Read-modify-CAS; with ``expected_version=None`` retry on concurrent writers."""
        for _ in range(limits.POLICIES_CAS_RETRIES_MAX):
            current, version = await self._read(path, kind)
            if expected_version is not None and expected_version != version:
                raise BadVersion(path, expected_version, version)
            new = change(current)
            try:
                await self._records.put(path, _encode(new), expected_version=version)
            except BadVersion:
                if expected_version is not None:
                    raise
                continue
            return new
        raise BadVersion(path, expected_version, -1)

    async def _retry(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run a multi-key CAS ``attempt`` again when another writer got in between."""
        for _ in range(limits.POLICIES_CAS_RETRIES_MAX - 1):
            try:
                return await attempt()
            except BadVersion:
                continue
        return await attempt()

    # --- clusters -----------------------------------------------------------------------------

    async def create_cluster(self, name: str, data: ClusterData | None = None) -> None:
        """Create a cluster; AlreadyExists if it exists."""
        path = cluster_path(name)
        try:
            await self._records.put(path, _encode(data or ClusterData()), MUST_NOT_EXIST)
        except BadVersion:
            raise AlreadyExists(path) from None

    async def get_cluster(self, name: str) -> ClusterData:
        """The cluster's data; NotFound if absent."""
        return (await self._read(cluster_path(name), ClusterData))[0]

    async def update_cluster(
        self, name: str, data: ClusterData, expected_version: int | None = None
    ) -> None:
        """Replace a cluster's data (CAS)."""
        await self._update(cluster_path(name), ClusterData, lambda _: data, expected_version)

    async def list_clusters(self) -> list[str]:
        """Cluster names, sorted."""
        return await self.store.list_children(CLUSTERS)

    async def delete_cluster(self, name: str) -> None:
        """Delete a cluster; NotEmpty while a tenant still lists it in ``allowedClusters``."""
        path = cluster_path(name)
        record = await self.store.get(path)
        if record is None:
            raise NotFound(path)
        for tenant in await self.list_tenants():
            try:
                info = await self.get_tenant(tenant)
            except NotFound:
                continue
            if name in info.allowed_clusters:
                raise NotEmpty(path, f"tenant {tenant} still uses cluster {name}")
        await self._records.delete(path, expected_version=record.stat.version)

    # --- tenants ------------------------------------------------------------------------------

    async def _check_clusters(self, info: TenantInfo) -> None:
        for cluster in info.allowed_clusters:
            if await self.store.get(cluster_path(cluster)) is None:
                raise InvalidArgument(f"cluster {cluster!r} does not exist")

    async def create_tenant(self, name: str, info: TenantInfo | None = None) -> None:
        """Create a tenant; its ``allowed_clusters`` must exist (InvalidArgument otherwise)."""
        path = tenant_path(name)
        info = info or TenantInfo()
        await self._check_clusters(info)
        try:
            await self._records.put(path, _encode(info), MUST_NOT_EXIST)
        except BadVersion:
            raise AlreadyExists(path) from None

    async def get_tenant(self, name: str) -> TenantInfo:
        """The tenant's info; NotFound if absent."""
        return (await self._read(tenant_path(name), TenantInfo))[0]

    async def update_tenant(
        self, name: str, info: TenantInfo, expected_version: int | None = None
    ) -> None:
        """Replace a tenant's info (CAS); clusters must exist."""
        path = tenant_path(name)
        await self._check_clusters(info)
        await self._update(path, TenantInfo, lambda _: info, expected_version)

    async def list_tenants(self) -> list[str]:
        """Tenant names, sorted."""
        return await self.store.list_children(TENANTS)

    async def delete_tenant(self, name: str) -> None:
        """Delete a tenant; NotEmpty while it has namespaces."""
        path = tenant_path(name)

        async def attempt() -> None:
            record = await self.store.get(path)
            if record is None:
                raise NotFound(path)
            namespaces = await self.store.list_children(f"{NAMESPACES}/{name}")
            if namespaces:
                raise NotEmpty(path, f"tenant {name} still has namespaces {namespaces}")
            # A namespace created since the read bumped the tenant's version: BadVersion.
            await self._records.delete(path, expected_version=record.stat.version)

        await self._retry(attempt)

    # --- namespaces ---------------------------------------------------------------------------

    async def create_namespace(
        self, namespace: str | NamespaceName, policies: NamespacePolicies | None = None
    ) -> None:
        """Create a namespace under an existing tenant (NotFound if the tenant is absent)."""
        ns = _ns(namespace)
        path = namespace_path(ns)
        value = _encode(policies or NamespacePolicies())
        tpath = tenant_path(ns.tenant)

        async def attempt() -> None:
            tenant = await self.store.get(tpath)
            if tenant is None:
                raise NotFound(tpath)
            if await self.store.get(path) is not None:
                raise AlreadyExists(path)
            # Re-putting the tenant at its version fences a concurrent tenant delete.
            await self._records.commit(
                [
                    Put(tpath, tenant.value, expected_version=tenant.stat.version),
                    Put(path, value, expected_version=MUST_NOT_EXIST),
                ]
            )

        await self._retry(attempt)

    async def list_namespaces(self, tenant: str) -> list[str]:
        """``tenant/ns`` names of the tenant's namespaces; NotFound if the tenant is absent."""
        tpath = tenant_path(tenant)
        if await self.store.get(tpath) is None:
            raise NotFound(tpath)
        return [f"{tenant}/{ns}" for ns in await self.store.list_children(f"{NAMESPACES}/{tenant}")]

    async def namespace_policies(
        self, namespace: str | NamespaceName, *, fresh: bool = False
    ) -> NamespacePolicies:
        """The namespace's policies; NotFound if it does not exist (or is being deleted).
        ``fresh``: read the store, not the cache (what a decision that sticks is based on,
        such as a topic's deduplication when it loads, must not lag a change made through
        another broker that the client already saw acknowledged)."""
        ns = _ns(namespace)
        path = namespace_path(ns)
        if fresh:
            policies, _ = await self._read(path, NamespacePolicies)
        else:
            policies = await self._read_cached(path, NamespacePolicies)
        if policies.deleted:
            raise NotFound(namespace_path(ns))
        return policies

    async def namespace_policies_version(
        self, namespace: str | NamespaceName
    ) -> tuple[NamespacePolicies, int]:
        """The policies with their record version, for a later ``set_namespace_policies``."""
        return await self._read(namespace_path(_ns(namespace)), NamespacePolicies)

    async def set_namespace_policies(
        self,
        namespace: str | NamespaceName,
        policies: NamespacePolicies,
        expected_version: int | None = None,
    ) -> None:
        """Replace the namespace's policies (CAS)."""
        await self.update_namespace_policies(namespace, lambda _: policies, expected_version)

    async def update_namespace_policies(
        self,
        namespace: str | NamespaceName,
        change: Callable[[NamespacePolicies], NamespacePolicies],
        expected_version: int | None = None,
    ) -> NamespacePolicies:
        """Apply ``change`` to the current policies and CAS the result; returns it.

        Example:
            >>> import asyncio
            >>> from anabranch.metadata.memory import MemoryMetadataStore
            >>> async def enable_dedup(p: Policies) -> None:
            ...     await p.ensure_standalone_defaults()
            ...     new = await p.update_namespace_policies(
            ...         "public/default", lambda old: msgspec.structs.replace(
            ...             old, deduplication_enabled=True))
            ...     print(new.deduplication_enabled)
            ...     await p.store.close()
            >>> asyncio.run(enable_dedup(Policies(MemoryMetadataStore())))
            True
        """
        path = namespace_path(_ns(namespace))

        def guarded(old: NamespacePolicies) -> NamespacePolicies:
            if old.deleted:
                raise NotFound(path)
            return change(old)

        return await self._update(path, NamespacePolicies, guarded, expected_version)

    async def delete_namespace(self, namespace: str | NamespaceName) -> None:
        """Delete an empty namespace; NotEmpty while it has topics or partitioned topics."""
        ns = _ns(namespace)
        path = namespace_path(ns)
        # Mark first: from here on register_topic refuses, so the listing below is final.
        await self._update(
            path, NamespacePolicies, lambda p: msgspec.structs.replace(p, deleted=True), None
        )
        topics = await self.list_topics(ns, include_deleting=True)
        partitioned = await self.list_partitioned_topics(ns)
        scalable = await self.store.list_children(scalable_namespace_path(ns))
        topics += [f"topic://{ns}/{name}" for name in scalable]
        if topics or partitioned:
            await self._update(
                path, NamespacePolicies, lambda p: msgspec.structs.replace(p, deleted=False), None
            )
            raise NotEmpty(path, f"namespace {ns} still has topics {(topics + partitioned)[:10]}")
        record = await self.store.get(path)
        if record is not None:
            await self._records.delete(path, expected_version=record.stat.version)

    async def namespace_guard(self, namespace: str | NamespaceName) -> Check:
        """A check that the namespace exists and is not being deleted, for a commit that
        creates something in it (NotFound now if it is absent or being deleted). Deleting
        a namespace marks it first, so a commit carrying this check made before the mark
        is in the listing that decides whether the namespace is empty, and one made after
        it fails."""
        ns = _ns(namespace)
        return Check(namespace_path(ns), expected_version=await self._live_namespace_version(ns))

    async def _live_namespace_version(self, ns: NamespaceName) -> int:
        """The namespace record's version; NotFound if absent or being deleted."""
        policies, version = await self._read(namespace_path(ns), NamespacePolicies)
        if policies.deleted:
            raise NotFound(namespace_path(ns))
        return version

    # --- permissions (grants of AuthPolicies) ----------------------------------------------

    async def grant_namespace_permission(
        self, namespace: str | NamespaceName, role: str, actions: list[str]
    ) -> None:
        """Set ``role``'s actions on the namespace (replacing what it had), as Pulsar does."""
        validate_role(role)

        def change(old: NamespacePolicies) -> NamespacePolicies:
            auth = old.auth_policies
            granted = {**auth.namespace_auth, role: list(actions)}
            return msgspec.structs.replace(
                old, auth_policies=msgspec.structs.replace(auth, namespace_auth=granted)
            )

        await self.update_namespace_policies(namespace, change)

    async def revoke_namespace_permission(self, namespace: str | NamespaceName, role: str) -> None:
        """Remove ``role``'s namespace grant (nothing to remove is not an error)."""

        def change(old: NamespacePolicies) -> NamespacePolicies:
            auth = old.auth_policies
            granted = {r: a for r, a in auth.namespace_auth.items() if r != role}
            return msgspec.structs.replace(
                old, auth_policies=msgspec.structs.replace(auth, namespace_auth=granted)
            )

        await self.update_namespace_policies(namespace, change)

    async def grant_topic_permission(
        self, topic: str | TopicName, role: str, actions: list[str]
    ) -> None:
        """Set ``role``'s actions on one topic (stored in its namespace's policies)."""
        validate_role(role)
        name = _topic(topic).base
        key = str(name)

        def change(old: NamespacePolicies) -> NamespacePolicies:
            auth = old.auth_policies
            topic_auth = {**auth.destination_auth.get(key, {}), role: list(actions)}
            destinations = {**auth.destination_auth, key: topic_auth}
            return msgspec.structs.replace(
                old, auth_policies=msgspec.structs.replace(auth, destination_auth=destinations)
            )

        await self.update_namespace_policies(name.namespace_name, change)

    async def revoke_topic_permission(self, topic: str | TopicName, role: str) -> None:
        """Remove ``role``'s grant on one topic (nothing to remove is not an error)."""
        name = _topic(topic).base
        key = str(name)

        def change(old: NamespacePolicies) -> NamespacePolicies:
            auth = old.auth_policies
            destinations = dict(auth.destination_auth)
            topic_auth = {r: a for r, a in destinations.pop(key, {}).items() if r != role}
            if topic_auth:
                destinations[key] = topic_auth
            return msgspec.structs.replace(
                old, auth_policies=msgspec.structs.replace(auth, destination_auth=destinations)
            )

        await self.update_namespace_policies(name.namespace_name, change)

    async def forget_topic_permissions(self, topic: str | TopicName) -> None:
        """Drop every grant on a deleted topic, so a topic created later under the same
        name starts with none (no write when there is nothing to drop)."""
        name = _topic(topic).base
        key = str(name)
        try:
            auth = (await self.namespace_policies(name.namespace_name)).auth_policies
        except NotFound:
            return
        if key not in auth.destination_auth:
            return

        def change(old: NamespacePolicies) -> NamespacePolicies:
            a = old.auth_policies
            left = {t: roles for t, roles in a.destination_auth.items() if t != key}
            return msgspec.structs.replace(
                old, auth_policies=msgspec.structs.replace(a, destination_auth=left)
            )

        await self.update_namespace_policies(name.namespace_name, change)

    async def namespace_permissions(self, namespace: str | NamespaceName) -> dict[str, list[str]]:
        """Role → actions granted on the namespace."""
        return dict((await self.namespace_policies(namespace)).auth_policies.namespace_auth)

    async def topic_permissions(self, topic: str | TopicName) -> dict[str, list[str]]:
        """Role → actions on one topic: its namespace's grants merged with its own (what
        Pulsar's ``GET .../permissions`` answers)."""
        name = _topic(topic).base
        auth = (await self.namespace_policies(name.namespace_name)).auth_policies
        merged = {role: sorted(set(a)) for role, a in auth.namespace_auth.items()}
        for role, actions in auth.destination_auth.get(str(name), {}).items():
            merged[role] = sorted(set(merged.get(role, [])) | set(actions))
        return merged

    # --- partitioned topics -------------------------------------------------------------------

    async def create_partitioned_topic(
        self, topic: str | TopicName, partitions: int, properties: dict[str, str] | None = None
    ) -> None:
        """Record ``topic`` as partitioned into ``partitions`` (1..limit).

        AlreadyExists if it is partitioned already or exists as a non-partitioned topic.
        """
        name = self._persistent_base(topic)
        self._check_partitions(partitions)
        path = partitioned_topic_path(name)
        meta = PartitionedTopicMetadata(partitions=partitions, properties=properties or {})
        value = _encode(meta)

        async def attempt() -> None:
            version = await self._live_namespace_version(name.namespace_name)
            if await self.store.get(topic_path(name)) is not None:
                raise AlreadyExists(topic_path(name))
            try:
                await self._records.commit(
                    [
                        Check(namespace_path(name.namespace_name), expected_version=version),
                        Check(topic_path(name), expected_version=MUST_NOT_EXIST),
                        Put(path, value, expected_version=MUST_NOT_EXIST),
                    ]
                )
            except BadVersion as err:
                if err.path == path:
                    raise AlreadyExists(path) from None
                raise

        await self._retry(attempt)

    async def get_partitioned_topic(self, topic: str | TopicName) -> PartitionedTopicMetadata:
        """The partitioned metadata; NotFound if ``topic`` is not partitioned."""
        path = partitioned_topic_path(self._persistent_base(topic))
        return await self._read_cached(path, PartitionedTopicMetadata)

    async def get_partitions(self, topic: str | TopicName) -> int:
        """Number of partitions of ``topic``; 0 when it is not partitioned (or is a partition).

        Example:
            >>> import asyncio
            >>> from anabranch.metadata.memory import MemoryMetadataStore
            >>> async def demo(p: Policies) -> None:
            ...     await p.ensure_standalone_defaults()
            ...     await p.create_partitioned_topic("persistent://public/default/orders", 2)
            ...     print(await p.get_partitions("persistent://public/default/orders"))
            ...     print(await p.get_partitions("persistent://public/default/plain"))
            ...     await p.store.close()
            >>> asyncio.run(demo(Policies(MemoryMetadataStore())))
            2
            0
        """
        name = _topic(topic)
        if name.partition is not None or name.domain not in _PARTITIONABLE:
            return 0
        record = await self._records.get(partitioned_topic_path(name))
        if record is None:
            return 0
        return _decode(record, PartitionedTopicMetadata).partitions

    async def update_partitioned_topic(
        self, topic: str | TopicName, partitions: int, expected_version: int | None = None
    ) -> None:
        """Raise the partition count; a decrease (or same count) is InvalidArgument."""
        name = self._persistent_base(topic)
        self._check_partitions(partitions)

        def grow(old: PartitionedTopicMetadata) -> PartitionedTopicMetadata:
            if partitions <= old.partitions:
                raise InvalidArgument(
                    f"{name} has {old.partitions} partitions; the count can only increase"
                    f" (asked for {partitions})"
                )
            return msgspec.structs.replace(old, partitions=partitions)

        await self._update(
            partitioned_topic_path(name), PartitionedTopicMetadata, grow, expected_version
        )

    async def delete_partitioned_topic(self, topic: str | TopicName) -> int:
        """Remove the partitioned metadata; returns the partition count it had.

        Unregistering (and deleting) the partitions themselves is the caller's job.
        """
        name = self._persistent_base(topic)
        path = partitioned_topic_path(name)
        record = await self.store.get(path)
        if record is None:
            raise NotFound(path)
        await self._records.delete(path, expected_version=record.stat.version)
        return _decode(record, PartitionedTopicMetadata).partitions

    async def list_partitioned_topics(
        self, namespace: str | NamespaceName, domain_kind: TopicDomain = TopicDomain.PERSISTENT
    ) -> list[str]:
        """Full names of the namespace's partitioned topics of one domain, sorted."""
        ns = _ns(namespace)
        domain = domain_kind.value
        names = await self.store.list_children(f"{PARTITIONED_TOPICS}/{ns}/{domain}")
        return [f"{domain}://{ns}/{local}" for local in names]

    # --- topic registry -----------------------------------------------------------------------

    async def register_topic(self, topic: str | TopicName) -> bool:
        """Record that ``topic`` (or a partition) exists; True if newly registered.

        NotFound when the namespace is absent or being deleted; AlreadyExists when a
        non-partitioned name collides with a partitioned topic.
        """
        name = _topic(topic)
        path = topic_path(name)
        value = _encode(TopicRecord(created_at_ms=time.time_ns() // 1_000_000))

        async def attempt() -> bool:
            if await self.store.get(path) is not None:
                return False
            version = await self._live_namespace_version(name.namespace_name)
            ops: list[Check | Put] = [
                Check(namespace_path(name.namespace_name), expected_version=version)
            ]
            if name.partition is None and name.domain is TopicDomain.PERSISTENT:
                ppath = partitioned_topic_path(name)
                if await self.store.get(ppath) is not None:
                    raise AlreadyExists(ppath)
                ops.append(Check(ppath, expected_version=MUST_NOT_EXIST))
            ops.append(Put(path, value, expected_version=MUST_NOT_EXIST))
            await self._records.commit(ops)
            return True

        return await self._retry(attempt)

    async def topic_exists(self, topic: str | TopicName, *, fresh: bool = False) -> bool:
        """Whether ``topic`` is registered (``fresh``: read the store, not the cache)."""
        path = topic_path(_topic(topic))
        return await (self.store.get(path) if fresh else self._records.get(path)) is not None

    async def unregister_topic(self, topic: str | TopicName) -> bool:
        """Forget ``topic``; False if it was not registered."""
        return await self._records.delete(topic_path(_topic(topic)))

    async def list_topics(
        self,
        namespace: str | NamespaceName,
        domain: TopicDomain = TopicDomain.PERSISTENT,
        *,
        include_deleting: bool = False,
    ) -> list[str]:
        """Full names of the registered topics (and partitions) of a namespace, sorted.

        NotFound if the namespace does not exist.
        """
        ns = _ns(namespace)
        if not include_deleting:
            await self._live_namespace_version(ns)
        names = await self.store.list_children(f"{TOPICS}/{ns}/{domain.value}")
        return [f"{domain.value}://{ns}/{local}" for local in names]

    # --- standalone ---------------------------------------------------------------------------

    async def ensure_standalone_defaults(
        self,
        cluster: str = "standalone",
        *,
        service_url: str = "http://127.0.0.1:8080",
        broker_service_url: str = "pulsar://127.0.0.1:6650",
        service_url_tls: str = "",
        broker_service_url_tls: str = "",
    ) -> None:
        """Create cluster ``cluster``, tenant ``public`` and namespace ``public/default``
        when absent; existing records are left as they are (idempotent, race-safe)."""
        data = ClusterData(
            service_url=service_url,
            broker_service_url=broker_service_url,
            service_url_tls=service_url_tls,
            broker_service_url_tls=broker_service_url_tls,
        )
        try:
            await self.create_cluster(cluster, data)
        except AlreadyExists:
            pass
        try:
            await self.create_tenant("public", TenantInfo(allowed_clusters=[cluster]))
        except AlreadyExists:
            pass
        try:
            await self.create_namespace("public/default")
        except AlreadyExists:
            pass

    # --- validation ---------------------------------------------------------------------------

    @staticmethod
    def _persistent_base(topic: str | TopicName) -> TopicName:
        name = _topic(topic)
        if name.domain not in _PARTITIONABLE:
            raise NotAllowed(f"{name} is a scalable topic; those are not partitioned")
        if name.partition is not None:
            raise InvalidArgument(f"{name} is a partition, not a partitioned topic")
        return name

    @staticmethod
    def _check_partitions(partitions: int) -> None:
        if (
            not isinstance(partitions, int)
            or isinstance(partitions, bool)
            or not 1 <= partitions <= limits.PARTITIONS_PER_TOPIC_MAX
        ):
            raise InvalidArgument(
                f"partitions {partitions!r} outside [1, {limits.PARTITIONS_PER_TOPIC_MAX}]"
            )

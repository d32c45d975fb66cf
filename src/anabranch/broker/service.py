"""BrokerService: the broker's topics, their loading, and the shared services handlers use.

A topic is loaded once (concurrent ``get_topic`` calls share one load) and stays loaded
until deleted or the service closes; at most ``config.max_topics_per_broker`` are loaded
(one more is refused with ResourceLimitReached). Loading checks the namespace exists,
registers the topic when auto-creation is allowed (``config.allow_auto_topic_creation``,
the namespace's policy, and ``config.max_topics_per_namespace`` not reached: see
:meth:`BrokerService.check_exists`, which writes nothing), opens its managed ledger
(which fences any previous owner) and restores the dedup state and subscriptions. A
partitioned topic is N independent topics ``<name>-partition-<i>``; clients route
between them.

Non-persistent topics (``non-persistent://``, :mod:`anabranch.broker.nonpersistent`)
live in memory only: :meth:`BrokerService.get_non_persistent_topic` creates one on first
use (auto-creation rules apply; a partition of a partitioned one always exists), nothing
is registered or stored, they count under ``max_topics_per_broker``, in cluster mode this
broker claims them like any topic, and a periodic sweep unloads idle ones.
:meth:`BrokerService.get_any_topic` is what producers attach through.

Scalable topics: the service owns this broker's one
:class:`~anabranch.scalable.service.ScalableTopicService` (``scalable``; the admin app and
the binary sessions share it, and its segment operations act on the topics loaded here,
see :mod:`anabranch.broker.segment_ops`), the
:class:`~anabranch.scalable.dag_watch.DagWatcher` that feeds DAG-watch sessions, and the
:class:`~anabranch.broker.scalable_commands.ScalableEndpoint` that holds those sessions and
the registered stream consumers. ``segment_broker_url`` says which broker serves a segment
(this one in standalone; cluster mode replaces it). A child segment loaded with
deduplication on is seeded from its parents' seal snapshots (``.../sealed/{id}``), so a
retried sequence id the parent persisted stays a duplicate.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(service: BrokerService) -> None:
    ...     topic = await service.get_topic("persistent://public/default/t", create=True)
    ...     assert topic in service.loaded_topics()
    ...     print(topic.name)
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             await demo(broker.service)
    >>> asyncio.run(main())
    persistent://public/default/t
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol
from urllib.parse import quote

from anabranch import limits
from anabranch.broker.authorization import Authorizer
from anabranch.broker.autoscale import broker_autoscaler
from anabranch.broker.cluster.ownership import ClusterOwnership
from anabranch.broker.compaction import Compactions
from anabranch.broker.config import BrokerConfig
from anabranch.broker.dispatch_throttling import dispatch_rates_of, put_rates_in_force
from anabranch.broker.metrics import BrokerCounters
from anabranch.broker.nonpersistent import NonPersistentTopic
from anabranch.broker.offload import Offloader
from anabranch.broker.policies import ROOT as POLICIES_ROOT
from anabranch.broker.policies import NamespacePolicies, Policies
from anabranch.broker.publish_buffer import PublishBuffer
from anabranch.broker.publish_throttling import publish_rate_of, put_in_force
from anabranch.broker.retention import RetentionSweeps, retention_of
from anabranch.broker.scalable_commands import ScalableEndpoint
from anabranch.broker.schema import SchemaRegistry
from anabranch.broker.segment_ops import BrokerSegmentOps
from anabranch.broker.subscribe_throttling import put_in_force as put_subscribe_rate
from anabranch.broker.subscribe_throttling import subscribe_rate_of
from anabranch.broker.subscription import Subscription
from anabranch.broker.topic import PersistentTopic
from anabranch.broker.topic_limits import TopicLimits
from anabranch.broker.topic_policies import TopicPolicies, TopicPolicyStore
from anabranch.clock import Clock, SystemClock
from anabranch.core.names import SegmentName, TopicDomain, TopicName, parse_name
from anabranch.core.schema_compat import Strategy
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import (
    Closed,
    InvalidArgument,
    LedgerFenced,
    NonPersistentUnsupported,
    NotAllowed,
    NotFound,
    ResourceLimitReached,
    ScalableTopicsDisabled,
)
from anabranch.metadata.api import Check, MetadataStore
from anabranch.metadata.ownership_fence import OwnershipFence
from anabranch.metadata.record_cache import RecordCache
from anabranch.scalable.dag_watch import DagWatcher
from anabranch.scalable.paths import TopicPaths
from anabranch.scalable.segment_ops import decode_dedup_snapshot
from anabranch.scalable.service import ScalableTopicService
from anabranch.security.authentication import AuthenticationService
from anabranch.security.broker_client import BrokerClientCredentials
from anabranch.storage.api import ManagedLedgerConfig, ManagedLedgerFactory
from anabranch.supervisor import Fatal
from anabranch.transactions.coordinator import TransactionCoordinator
from anabranch.transactions.keys import TransactionKeys
from anabranch.transactions.metadata_buffer import MetadataTransactionBuffer
from anabranch.transactions.metadata_pending_ack import MetadataPendingAckStore
from anabranch.transactions.outcomes import TxnOutcomes

log = logging.getLogger(__name__)

PRODUCER_NAME_COUNTER_PREFIX = "/counters/producer-name-"

SegmentBrokerResolver = Callable[[SegmentName], Awaitable[str]]
"""``segment -> pulsar:// URL`` of the broker serving it (the DAG's ``segment_brokers``)."""


def canonical_topic(text: str) -> TopicName | SegmentName:
    """Parse a client-supplied topic name (InvalidArgument if invalid).

    Example:
        >>> str(canonical_topic("my-topic"))
        'persistent://public/default/my-topic'
    """
    return parse_name(text)


def managed_ledger_name(name: TopicName | SegmentName) -> str:
    """The managed ledger of a topic, partition or segment (upstream's layout).

    Example:
        >>> managed_ledger_name(TopicName.parse("persistent://t/ns/x-partition-1"))
        't/ns/persistent/x-partition-1'
    """
    if isinstance(name, SegmentName):
        t = name.topic
        return f"{t.tenant}/{t.namespace}/segment/{t.local_name}/{name.descriptor}"
    return f"{name.tenant}/{name.namespace}/{name.domain.value}/{name.full_local_name}"


class OwnershipGate(Protocol):
    """Cluster mode's say on which topics this broker may serve (``broker/cluster``)."""

    async def claim(self, topic: str) -> None:
        """Return once this broker owns ``topic``; NotOwner when another broker does."""
        ...

    def serving(self, topic: str) -> bool:
        """Whether this broker owns ``topic`` right now (no I/O: checked on every SEND)."""
        ...

    def fence(self, topic: str) -> Check:
        """The condition this broker's metadata writes for ``topic`` carry: it fails once
        another broker owns ``topic``. NotOwner if this broker does not own it."""
        ...


class BrokerService:
    """Topics and the services shared by every connection of one broker."""

    def __init__(
        self,
        config: BrokerConfig,
        store: MetadataStore,
        ledgers: ManagedLedgerFactory,
        clock: Clock | None = None,
        policies: Policies | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.ledgers = ledgers
        self.clock: Clock = clock or SystemClock()
        self.policies = policies or Policies(store)
        self.schemas = SchemaRegistry(
            store, self._schema_strategy, versions_max=config.schema_versions_max
        )
        self.authorizer = Authorizer(
            self.policies, config.superuser_roles, enforced=config.authorization_enabled
        )
        self.authentication = AuthenticationService.from_config(config)
        """Checks CONNECT and HTTP credentials; None while authentication is disabled."""
        self.broker_client = BrokerClientCredentials.from_config(config)
        """What this broker presents to other brokers (cluster calls and probes)."""
        self.fatal = Fatal()
        """Set when an essential background loop keeps dying: the process exits non-zero."""
        self.policy_cache = RecordCache(store, POLICIES_ROOT + "/", on_give_up=self.fatal.fail)
        """Namespace and topic policies and partitioned metadata, as producers, consumers
        and lookups read them: from memory, kept fresh by a watch (started by ``start``)."""
        self.policies.cache = self.policy_cache
        self.topic_policies = TopicPolicyStore(store, self.policy_cache)
        self.advertised_url = f"pulsar://{config.advertised_address}:{config.port}"
        self.http_url = f"http://{config.advertised_address}:{config.http_port}"
        self.advertised_url_tls: str | None = None
        """``pulsar+ssl://`` URL of the TLS listener (None without one)."""
        self.http_url_tls: str | None = None
        """``https://`` URL of the admin API's TLS listener (None without one)."""
        self.peer_tls_urls: dict[str, str] = {}
        """Other brokers' ``pulsar://`` -> ``pulsar+ssl://`` URLs (cluster registry)."""
        self.scalable_endpoint = ScalableEndpoint(self)
        self.scalable = ScalableTopicService(
            store,
            BrokerSegmentOps(self),
            self.clock,
            self.http_url,
            pulsar_url=self.advertised_url,
            # The controller's leadership session: a dead leader's topics get a new
            # controller after about this long, like the topics it owned.
            session_ttl_s=config.session_ttl_s,
            grace_period_ms=round(config.consumer_grace_period_s * 1000),
            on_assignment=self.scalable_endpoint.deliver_assignment,
            on_give_up=self.fatal.fail,
        )
        self.autoscaler = broker_autoscaler(self)
        """Load-driven split and merge of the scalable topics this broker's controllers lead."""
        self.dag_watcher = DagWatcher(store, self.clock)
        self.segment_broker_url: SegmentBrokerResolver = self._local_segment_broker
        """Which broker serves a segment; cluster mode replaces this function."""
        self._topics: dict[str, PersistentTopic] = {}
        self._loading: dict[str, asyncio.Task[PersistentTopic]] = {}
        self._deleting: dict[str, asyncio.Future[None]] = {}
        """Topics being deleted: a load of the name waits for the deletion to end, so it
        never opens a ledger that is being deleted."""
        self._np_topics: dict[str, NonPersistentTopic] = {}
        """Loaded ``non-persistent://`` topics (memory only; they count in the topic cap)."""
        self._np_incarnation = 0
        self._broker_index = 0
        self._producer_counter = itertools.count()
        self._closed = False
        self._background: set[asyncio.Task[bool]] = set()
        self.counters = BrokerCounters()
        """Broker-wide counters for /metrics; the server and sessions bump them."""
        self.publish_buffer = PublishBuffer(config.max_message_publish_buffer_bytes)
        """Bytes of unanswered SENDs over every connection (``broker/publish_buffer.py``)."""
        self.sweeps = RetentionSweeps(self)
        """Retention, message TTL, backlog quotas and segment pruning (periodic)."""
        self.compactions = Compactions(self)
        """Topic compaction: per-topic runs and the periodic threshold check."""
        self.offloader = Offloader(self)
        """Tiered storage: offload policies and the manual offload trigger."""
        self.ownership: OwnershipGate | None = None
        """Set in cluster mode: topics are loaded only once this broker owns them."""
        self.txn_outcomes: TxnOutcomes | None = None
        self.txn_coordinator: TransactionCoordinator | None = None
        self.txn_keys: TransactionKeys | None = None
        if config.transactions_enabled:
            self.txn_outcomes = TxnOutcomes(store, self.clock, on_give_up=self.fatal.fail)
            # The coordinator wakes this broker's participants right after its CAS (the
            # fast path); other brokers' participants learn it from their header watch.
            self.txn_coordinator = TransactionCoordinator(
                store,
                self.clock,
                partitions=config.transaction_partitions,
                owner_id=self.http_url,
                on_final=self.txn_outcomes.wake,
                on_give_up=self.fatal.fail,
                commit_cleanup=self.txn_outcomes.commit_cleanup,
            )
            self.txn_outcomes.local_header = self.txn_coordinator.open_header
            # Transaction keys (the key-fencing PIP): epochs per owner&key, fenced here
            # and, through its watch, on every other broker.
            self.txn_keys = TransactionKeys(store, self.clock, self.txn_coordinator)

    @property
    def protocol_errors(self) -> int:
        """Connections closed for a protocol error (bad frames, misplaced commands)."""
        return self.counters.bad_frames + self.counters.protocol_errors

    async def start(self) -> None:
        """Take a cluster-unique number for generated producer names: dedup is keyed on
        producer names, so a restarted broker must never hand out an old one."""
        path = await self.store.create_sequential(PRODUCER_NAME_COUNTER_PREFIX, b"")
        self._broker_index = int(path.rsplit("-", 1)[1])
        if self.config.policy_cache_enabled:
            await self.policy_cache.start()
        self.sweeps.start()
        self.compactions.start()
        self.autoscaler.start()
        self.offloader.start()
        if self.txn_outcomes is not None and self.txn_coordinator is not None:
            await self.txn_outcomes.start()
            await self.txn_coordinator.start()
            if self.txn_keys is not None:
                await self.txn_keys.start()

    def set_addresses(
        self,
        *,
        pulsar_url: str | None = None,
        http_url: str | None = None,
        pulsar_url_tls: str | None = None,
        http_url_tls: str | None = None,
    ) -> None:
        """The bound addresses (known once the servers listen); controllers created later
        advertise them as the leader's address. ``pulsar_url_tls`` is the ``pulsar+ssl://``
        URL lookups also answer with (``brokerServiceUrlTls``)."""
        if pulsar_url_tls is not None:
            self.advertised_url_tls = pulsar_url_tls
        if http_url_tls is not None:
            self.http_url_tls = http_url_tls
        if pulsar_url is not None:
            self.advertised_url = pulsar_url
            self.scalable.pulsar_url = pulsar_url
        if http_url is not None:
            self.http_url = http_url
            self.scalable.broker_url = http_url

    async def _local_segment_broker(self, segment: SegmentName) -> str:
        return self.advertised_url

    def tls_url_for(self, pulsar_url: str) -> str | None:
        """The ``pulsar+ssl://`` URL of the broker advertised as ``pulsar_url``: ours for
        our own URL, else what the cluster registry says (None: no TLS listener known)."""
        if pulsar_url == self.advertised_url:
            return self.advertised_url_tls
        if pulsar_url.startswith("pulsar+ssl://"):
            return pulsar_url
        return self.peer_tls_urls.get(pulsar_url)

    def new_producer_name(self) -> str:
        """``<cluster>-<broker index>-<n>``, unique across restarts.

        Example:
            >>> # service.new_producer_name() -> 'standalone-3-0'
        """
        return f"{self.config.cluster_name}-{self._broker_index}-{next(self._producer_counter)}"

    # --- topics ---------------------------------------------------------------------------

    async def get_topic(self, name: str, *, create: bool) -> PersistentTopic:
        """The loaded topic ``name``; NotFound if absent and not ``create`` (or auto-creation
        is off); InvalidArgument for an invalid name, before anything is written."""
        parsed = canonical_topic(name)
        if isinstance(parsed, TopicName) and parsed.domain is TopicDomain.TOPIC:
            raise NotAllowed(
                f"{parsed} is a scalable topic (PIP-460): a v4 client cannot produce to or "
                "consume from it; use a client with scalable-topic support"
            )
        if isinstance(parsed, TopicName) and not parsed.is_persistent:
            raise NonPersistentUnsupported(f"this operation on {parsed}")
        key = str(parsed)
        if self.ownership is not None:
            if not self.topic_in_use(key):
                # Before the claim: a topic that cannot load here, or does not exist (and
                # will not be created), leaves no ownership record behind.
                self._check_topic_cap()
                if isinstance(parsed, TopicName):
                    await self.check_exists(parsed, create=create)
            await self.ownership.claim(key)
        topic = self._topics.get(key)
        while topic is None and key in self._deleting:
            await asyncio.shield(self._deleting[key])
            topic = self._topics.get(key)
        if topic is not None:
            return topic
        if self._closed:
            raise Closed("the broker is shutting down")
        task = self._loading.get(key)
        if task is None:
            self._check_topic_cap()
            task = asyncio.ensure_future(self._load(parsed, create))
            self._loading[key] = task

            def loaded(done: asyncio.Future[PersistentTopic]) -> None:
                self._loading.pop(key, None)
                # Retrieved here: every caller may have been cancelled (their connection
                # closed), and a failed load must not be logged as a lost exception.
                if not done.cancelled():
                    done.exception()

            task.add_done_callback(loaded)
        return await asyncio.shield(task)

    async def get_any_topic(
        self, name: str, *, create: bool
    ) -> PersistentTopic | NonPersistentTopic:
        """:meth:`get_topic`, or :meth:`get_non_persistent_topic` for a
        ``non-persistent://`` name (what producers and consumers attach to)."""
        parsed = canonical_topic(name)
        if isinstance(parsed, TopicName) and not parsed.is_persistent:
            return await self.get_non_persistent_topic(parsed, create=create)
        return await self.get_topic(name, create=create)

    async def get_non_persistent_topic(
        self, name: str | TopicName, *, create: bool
    ) -> NonPersistentTopic:
        """The loaded non-persistent topic ``name``, created in memory when ``create`` and
        auto-creation allow it (nothing is written anywhere, but in cluster mode this
        broker must own it first); NotFound otherwise."""
        parsed = name if isinstance(name, TopicName) else canonical_topic(name)
        if not isinstance(parsed, TopicName) or parsed.is_persistent:
            raise InvalidArgument(f"{parsed} is not a non-persistent:// topic")
        key = str(parsed)
        if self.ownership is not None:
            if not self.topic_in_use(key):
                self._check_topic_cap()
                if create:
                    await self._check_non_persistent(parsed, create=create)
                else:
                    # It exists only where it is loaded: the claim below answers NotOwner
                    # (a redirect) when another broker has it; unowned, it is nowhere,
                    # and a read must not claim it.
                    await self._namespace_policies(f"{parsed.tenant}/{parsed.namespace}", key)
                    if (
                        isinstance(self.ownership, ClusterOwnership)
                        and await self.ownership.owner(key) is None
                        and not await self._implicitly_exists(parsed)
                    ):
                        raise NotFound(f"topic {key}")
            await self.ownership.claim(key)
        topic = self._np_topics.get(key)
        if topic is not None:
            return topic
        if self._closed:
            raise Closed("the broker is shutting down")
        self._check_topic_cap()
        await self._check_non_persistent(parsed, create=create)
        topic = self._np_topics.get(key)  # another caller created it meanwhile
        if topic is None:
            if self._closed:
                raise Closed("the broker is shutting down")
            self._check_topic_cap()
            # Ids grow across reloads of the name (clients may compare them).
            self._np_incarnation = max(self._np_incarnation + 1, self.clock.wall_ms())
            topic = NonPersistentTopic(key, clock=self.clock, incarnation=self._np_incarnation)
            self._np_topics[key] = topic
            log.info("loaded non-persistent topic %s", key)
            await self.put_policies_in_force(topic)
        return topic

    async def _check_non_persistent(self, name: TopicName, *, create: bool) -> None:
        ns_policies = await self._namespace_policies(f"{name.tenant}/{name.namespace}", str(name))
        if str(name) in self._np_topics:
            return
        if await self._implicitly_exists(name):
            return  # a partition of a partitioned non-persistent topic
        auto = self.config.allow_auto_topic_creation and ns_policies.allow_auto_topic_creation
        if not (create and auto):
            self.counters.topics_not_auto_created += 1
            raise NotFound(f"topic {name}")

    def loaded_non_persistent_topics(self) -> list[NonPersistentTopic]:
        """Non-persistent topics loaded on this broker now."""
        return list(self._np_topics.values())

    def loaded_non_persistent_topic(self, name: str) -> NonPersistentTopic | None:
        """The non-persistent topic if it is loaded here."""
        return self._np_topics.get(str(canonical_topic(name)))

    async def sweep_idle_non_persistent(self) -> int:
        """Unload the non-persistent topics without producers and subscriptions since
        ``limits.NON_PERSISTENT_IDLE_S`` (seen idle by an earlier sweep); how many."""
        now = self.clock.monotonic()
        due = []
        for topic in self._np_topics.values():
            if topic.in_use or topic.subscriptions:
                topic.idle_since = None
            elif topic.idle_since is None:
                topic.idle_since = now
            elif now - topic.idle_since >= limits.NON_PERSISTENT_IDLE_S:
                due.append(topic)
        for topic in due:
            if self._np_topics.get(topic.name) is topic and not topic.in_use:
                del self._np_topics[topic.name]
                await topic.close()
        if due:
            log.info("unloaded %d idle non-persistent topics", len(due))
        return len(due)

    async def delete_non_persistent_topic(self, name: str) -> None:
        """Close and forget a loaded non-persistent topic (there is nothing stored)."""
        key = str(canonical_topic(name))
        topic = self._np_topics.pop(key, None)
        if topic is None:
            raise NotFound(f"topic {key}")
        await topic.close()

    async def _load(self, name: TopicName | SegmentName, create: bool) -> PersistentTopic:
        key = str(name)
        ns_text = (
            f"{name.topic.tenant}/{name.topic.namespace}"
            if isinstance(name, SegmentName)
            else f"{name.tenant}/{name.namespace}"
        )
        # Fresh reads: deduplication and retention are fixed for as long as the topic stays
        # loaded, and a topic deleted through another broker must be registered again.
        ns_policies = await self._namespace_policies(ns_text, key, fresh=True)
        if not isinstance(name, SegmentName) and not await self.policies.topic_exists(
            key, fresh=True
        ):
            await self.check_exists(name, create=create)
            await self.policies.register_topic(key)
        retention = retention_of(self.config, ns_policies)
        ml_config = ManagedLedgerConfig(
            fsync=self.config.fsync,
            cursor_persist_interval_ms=self.config.cursor_persist_interval_ms,
            ledger_entries_max=self.config.managed_ledger_max_entries_per_ledger,
            ledger_bytes_max=self.config.managed_ledger_max_size_per_ledger_bytes,
            ledger_age_ms=max(
                round(self.config.managed_ledger_max_ledger_rollover_time_s * 1000), 1
            ),
            retention_ms=retention.time_ms,
            retention_bytes=retention.size_bytes,
        )
        ledger = await self.ledgers.open(managed_ledger_name(name), ml_config)
        topic = PersistentTopic(
            key,
            ledger,
            store=self.store,
            clock=self.clock,
            dedup_enabled=ns_policies.deduplication_enabled,
            quota_hold_max_s=self.config.backlog_quota_hold_max_s,
        )
        try:
            if self.ownership is not None:  # what its metadata writes carry (cluster mode)
                topic.ownership_fence = OwnershipFence(self.ownership.fence(key), key)
            if self.txn_outcomes is not None:
                await self._join_transactions(topic)
            await topic.load()
            if isinstance(name, SegmentName) and topic.dedup is not None:
                topic.seed_dedup(await self._parent_seal_marks(name))
            if isinstance(name, SegmentName):
                topic.on_drained = self.scalable.segment_drained
            topic.on_storage_failure = self._storage_failed
            await self.put_policies_in_force(topic, ns_policies)
        except BaseException:
            await ledger.close()
            raise
        if self._closed:
            await topic.close()
            raise Closed("the broker is shutting down")
        self._topics[key] = topic
        log.info("loaded topic %s (dedup %s)", key, "on" if topic.dedup is not None else "off")
        return topic

    async def _join_transactions(self, topic: PersistentTopic) -> None:
        """Make ``topic`` and its durable subscriptions transaction participants, after
        recovering what the metadata store says about their open transactions."""
        outcomes = self.txn_outcomes
        assert outcomes is not None
        fence = topic.ownership_fence
        buffer = MetadataTransactionBuffer(
            topic.name,
            topic.ledger,
            self.store,
            outcomes,
            self.clock,
            on_change=topic.transaction_state_changed,
            fence=fence,
        )
        await buffer.recover()
        topic.transaction_buffer = buffer

        def pending_acks(sub: Subscription) -> MetadataPendingAckStore:
            return MetadataPendingAckStore(
                topic.name,
                sub.name,
                sub.cursor,
                self.store,
                outcomes,
                self.clock,
                on_committed=sub.txn_acks_committed,
                on_aborted=sub.txn_acks_aborted,
                fence=fence,
            )

        topic.pending_ack_factory = pending_acks

    async def _parent_seal_marks(self, segment: SegmentName) -> list[dict[str, int]]:
        """The dedup marks its parents had when sealed (none before the layout names it)."""
        paths = TopicPaths(segment.topic)
        record = await self.store.get(paths.layout)
        if record is None:
            return []
        node = SegmentLayout.from_json(record.value).segments.get(segment.segment_id)
        marks = []
        for parent in node.parent_ids if node is not None else ():
            sealed = await self.store.get(paths.sealed(parent))
            if sealed is not None:
                marks.append(decode_dedup_snapshot(sealed.value))
        return marks

    async def _namespace_policies(
        self, ns_text: str, key: str, *, fresh: bool = False
    ) -> NamespacePolicies:
        try:
            return await self.policies.namespace_policies(ns_text, fresh=fresh)
        except NotFound:
            raise NotFound(f"namespace {ns_text} of topic {key}") from None

    async def check_scalable_enabled(self, topic: TopicName) -> None:
        """Raise ScalableTopicsDisabled unless scalable topics are on for ``topic``: its
        namespace's ``scalableTopicEnabled`` policy, else the broker's setting.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from anabranch.testing.broker import InProcessBroker
            >>> async def demo(service: BrokerService) -> None:
            ...     name = TopicName.parse("topic://public/default/x")
            ...     try:
            ...         await service.check_scalable_enabled(name)
            ...     except ScalableTopicsDisabled as err:
            ...         print(type(err).__name__)
            >>> async def main(**config: object) -> None:
            ...     with tempfile.TemporaryDirectory() as tmp:
            ...         async with InProcessBroker(Path(tmp), **config) as broker:
            ...             await demo(broker.service)
            >>> asyncio.run(main())                               # on by default: no error
            >>> asyncio.run(main(scalable_topic_enabled=False))
            ScalableTopicsDisabled
        """
        ns = f"{topic.tenant}/{topic.namespace}"
        policy = (await self._namespace_policies(ns, str(topic))).scalable_topic_enabled
        if policy is False:
            raise ScalableTopicsDisabled(str(topic), f"namespace {ns}")
        if policy is None and not self.config.scalable_topic_enabled:
            raise ScalableTopicsDisabled(str(topic), "this broker")

    async def check_exists(self, name: TopicName, *, create: bool) -> bool:
        """Whether ``name`` exists (True) or would be auto-created by a load with
        ``create`` (False); otherwise NotFound (auto-creation off) or NotAllowed (its
        namespace is at ``max_topics_per_namespace``). Reads only: a lookup of a name
        that does not exist writes nothing to the metadata store.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from anabranch.testing.broker import InProcessBroker
            >>> async def demo(service: BrokerService) -> None:
            ...     name = TopicName.parse("persistent://public/default/new")
            ...     print(await service.check_exists(name, create=True))
            ...     await service.get_topic(str(name), create=True)
            ...     print(await service.check_exists(name, create=True))
            >>> async def main() -> None:
            ...     with tempfile.TemporaryDirectory() as tmp:
            ...         async with InProcessBroker(Path(tmp)) as broker:
            ...             await demo(broker.service)
            >>> asyncio.run(main())
            False
            True
        """
        key = str(name)
        ns_policies = await self._namespace_policies(f"{name.tenant}/{name.namespace}", key)
        if await self.policies.topic_exists(key) or await self._implicitly_exists(name):
            return True
        auto = self.config.allow_auto_topic_creation and ns_policies.allow_auto_topic_creation
        if not (create and auto):
            self.counters.topics_not_auto_created += 1
            raise NotFound(f"topic {key}")
        cap = self.config.max_topics_per_namespace
        if cap and len(await self.policies.list_topics(name.namespace_name, name.domain)) >= cap:
            self.counters.topics_not_auto_created += 1
            raise NotAllowed(
                f"topic {key} not created: namespace {name.namespace_name} holds"
                f" max_topics_per_namespace ({cap}) topics"
            )
        return False

    def _check_topic_cap(self) -> None:
        cap = self.config.max_topics_per_broker
        if len(self._topics) + len(self._loading) + len(self._np_topics) >= cap:
            self.counters.topics_refused += 1
            raise ResourceLimitReached("topics loaded on this broker", cap)

    def topic_in_use(self, name: str) -> bool:
        """Whether ``name`` (canonical) is loaded or being loaded here."""
        return name in self._topics or name in self._loading or name in self._np_topics

    async def _implicitly_exists(self, name: TopicName) -> bool:
        # A partition of a partitioned topic exists with its parent; a partitioned topic's
        # base name and partitions past its count are not topics at all.
        partitions = await self.policies.get_partitions(str(name.base))
        if partitions == 0:
            return False
        if name.partition is None:
            raise NotAllowed(f"{name} is partitioned: produce to and consume from its partitions")
        if name.partition >= partitions:
            raise NotFound(f"topic {name} (it has {partitions} partitions)")
        return True

    def loaded_topics(self) -> list[PersistentTopic]:
        """Topics loaded on this broker now."""
        return list(self._topics.values())

    async def put_policies_in_force(
        self,
        topic: PersistentTopic | NonPersistentTopic,
        namespace: NamespacePolicies | None = None,
    ) -> None:
        """Give a topic just loaded its rates and caps (:meth:`apply_policies`; the sweep
        keeps them up to date). ``namespace``: its policies, when already read."""
        try:
            namespace, overrides = await self.policy_levels(canonical_topic(topic.name), namespace)
        except NotFound:
            return  # its namespace is being deleted: nothing to publish to for long
        self.apply_policies(topic, namespace, overrides)

    def apply_policies(
        self,
        topic: PersistentTopic | NonPersistentTopic,
        namespace: NamespacePolicies,
        overrides: TopicPolicies | None,
    ) -> None:
        """Put what a loaded topic applies continuously in force, from the policies given:
        its publish rate (``broker/publish_throttling.py``) and, on a persistent topic,
        its dispatch rates (``broker/dispatch_throttling.py``), its subscribe rate
        (``broker/subscribe_throttling.py``) and its subscriptions' caps
        on unacknowledged messages (``broker/topic_limits.py``; consumers keep the cap
        they subscribed with)."""
        now = self.clock.monotonic()
        put_in_force(topic, publish_rate_of(self.config, namespace, overrides), now)
        if isinstance(topic, PersistentTopic):
            rates = dispatch_rates_of(self.config, namespace, overrides)
            put_rates_in_force(topic, rates, now)
            put_subscribe_rate(topic, subscribe_rate_of(self.config, namespace, overrides))
            level = namespace if overrides is None else overrides.over(namespace)
            caps = TopicLimits.resolve(level, self.config)
            for subscription in topic.subscriptions.values():
                subscription.dispatcher.set_unacked_caps(caps)

    def loaded_topic(self, name: str) -> PersistentTopic | None:
        """The topic if it is loaded here, without loading it."""
        return self._topics.get(str(canonical_topic(name)))

    async def unload_topic(self, name: str) -> bool:
        """Close a loaded topic without deleting anything (its clients reconnect and look
        it up again); False when it was not loaded here."""
        transient = self._np_topics.pop(name, None)
        if transient is not None:
            await transient.close()  # what it held is lost, as on upstream's unload
            log.info("unloaded non-persistent topic %s", name)
            return True
        task = self._loading.get(name)
        if task is not None:
            await asyncio.wait([task])
        topic = self._topics.pop(name, None)
        if topic is None:
            return False
        await topic.close()
        log.info("unloaded topic %s", name)
        return True

    def _storage_failed(self, topic: PersistentTopic) -> None:
        # Only the instance that failed: a late failure must not unload its reload.
        if self._topics.get(topic.name) is topic:
            log.warning("%s: the disk failed an append; unloading to recover", topic.name)
            self.unload_in_background(topic.name)

    def unload_in_background(self, name: str) -> None:
        """Unload ``name`` from a callback that cannot await (e.g. a fenced append)."""
        task = asyncio.ensure_future(self.unload_topic(name))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def policy_levels(
        self, name: TopicName | SegmentName, namespace: NamespacePolicies | None = None
    ) -> tuple[NamespacePolicies, TopicPolicies]:
        """The namespace's policies and the topic's own (a segment's: its scalable topic's),
        read together: on etcd each read is a round trip. ``namespace``: already read."""
        topic = name.topic if isinstance(name, SegmentName) else name
        overrides = self.topic_policies.get(topic)
        if namespace is not None:
            return namespace, await overrides
        return await asyncio.gather(
            self.policies.namespace_policies(f"{topic.tenant}/{topic.namespace}"), overrides
        )

    async def topic_limits(self, name: TopicName | SegmentName) -> TopicLimits:
        """The producer, consumer and subscription caps in force on ``name``: its topic
        policy's, else its namespace's, else this broker's (``broker/topic_limits.py``)."""
        namespace, overrides = await self.policy_levels(name)
        return TopicLimits.resolve(overrides.over(namespace), self.config)

    async def _schema_strategy(self, topic: TopicName) -> Strategy:
        # Topic policy, then the namespace's, then the broker's default (as Pulsar).
        namespace, overrides = await self.policy_levels(topic)
        strategy = Strategy.parse(overrides.over(namespace).schema_compatibility_strategy)
        if strategy is Strategy.UNDEFINED:
            return Strategy.parse(self.config.schema_compatibility_strategy)
        return strategy

    async def delete_topic(self, name: str, *, loaded: PersistentTopic | None = None) -> None:
        """Close and delete a topic's ledger, subscriptions and registration (``loaded``:
        the instance, already taken out of the loaded map); also a topic whose replicated
        ledger was lost (its stream deleted behind our back), which never loads again: its
        metadata goes, so the name can start afresh. Loads of the name wait meanwhile."""
        topic = loaded
        if topic is None:
            try:
                topic = await self.get_topic(name, create=False)
            except LedgerFenced:
                parsed = canonical_topic(name)
                delete_lost = getattr(self.ledgers, "delete_lost", None)
                if delete_lost is None or not await delete_lost(managed_ledger_name(parsed)):
                    raise
                log.warning("%s: deleted; its ledger's storage was gone", name)
                await self._forget_topic(parsed)
                return
            if self._topics.get(topic.name) is topic:
                del self._topics[topic.name]
            elif topic.name in self._deleting:  # another delete took it: that one finishes
                await asyncio.shield(self._deleting[topic.name])
                return
        done = asyncio.get_running_loop().create_future()
        self._deleting[topic.name] = done
        try:
            compaction = self.compactions.of(topic)
            await topic.close()
            await compaction.delete()
            parsed = canonical_topic(topic.name)
            ledger = await self.ledgers.open(managed_ledger_name(parsed))
            await ledger.delete()
            await self._forget_topic(parsed)
        finally:
            del self._deleting[topic.name]
            done.set_result(None)

    async def _forget_topic(self, parsed: TopicName | SegmentName) -> None:
        """Delete what the metadata store keeps of a deleted topic."""
        ledger_name = managed_ledger_name(parsed)
        await self.store.delete(f"/dedup-snapshots/{quote(ledger_name, safe='')}")
        if not isinstance(parsed, SegmentName):  # segments are never registered
            await self.policies.unregister_topic(str(parsed))
            if parsed.partition is None:  # a partitioned topic's are its parent's
                await self.topic_policies.delete(parsed)
                await self.schemas.delete(parsed, force=True)

    async def delete_unused_topic(self, topic: PersistentTopic, unused: Callable[[], bool]) -> bool:
        """Delete ``topic`` as :meth:`delete_topic` does if it is still this broker's
        loaded instance and ``unused()`` holds: both judged with no await before it leaves
        the loaded map, so no producer or consumer can attach in between (one arriving
        later waits for the deletion and gets a new topic). True when deleted."""
        if self._topics.get(topic.name) is not topic or not unused():
            return False
        del self._topics[topic.name]
        await self.delete_topic(topic.name, loaded=topic)
        return True

    async def close(self) -> None:
        """Close the scalable-topic controllers and watch sessions, then every topic:
        in-flight appends finish, dedup snapshots are written."""
        self._closed = True
        await self.sweeps.close()
        await self.compactions.close()
        await self.autoscaler.close()
        await self.offloader.close()
        if self.txn_keys is not None:
            await self.txn_keys.close()
        if self.txn_coordinator is not None:
            await self.txn_coordinator.close()
        for step in (self.scalable_endpoint.close, self.dag_watcher.close, self.scalable.close):
            try:
                await step()
            except Exception:
                log.exception("closing the scalable-topic services failed")
        for task in list(self._loading.values()):
            await asyncio.wait([task])
        transients, self._np_topics = list(self._np_topics.values()), {}
        for transient in transients:
            await transient.close()
        topics, self._topics = list(self._topics.values()), {}
        for topic in topics:
            try:
                await topic.close()
            except Exception:
                log.exception("closing topic %s failed", topic.name)
        if self.txn_outcomes is not None:
            await self.txn_outcomes.close()
        await self.policy_cache.close()

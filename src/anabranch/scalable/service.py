"""ScalableTopicService: the per-broker entry point to scalable topics (PIP-468).

It creates a :class:`~anabranch.scalable.controller.ScalableTopicController` per topic on
first use (each one joins that topic's leader election under this broker's metadata
session), answers reads from the metadata store directly (any broker can), and sends
mutations to the local controller. When the local controller is not the leader, a
mutation raises :class:`~anabranch.errors.NotLeader` carrying the leader's HTTP URL, which
the admin layer turns into HTTP 307; :meth:`ScalableTopicService.leader_address` gives the
leader's pulsar URL too (the binary protocol's redirect).

One instance per broker, owned by the ``BrokerService``: the admin app and the binary
sessions share it, so a split seals a segment through the topic the broker has loaded.

Example:
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.scalable.segment_ops import StorageSegmentOps
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo(store, ops, clock) -> None:
    ...     service = ScalableTopicService(store, ops, clock, "http://127.0.0.1:8080",
    ...                                    pulsar_url="pulsar://127.0.0.1:6650")
    ...     await service.start()
    ...     await service.create("topic://public/default/orders", 2)
    ...     layout = await service.get_metadata("topic://public/default/orders")
    ...     print([s.hash_range.to_hex() for s in layout.active_segments()])
    ...     print(await service.list_topics("public/default"))
    ...     await service.close()
    >>> async def main() -> None:
    ...     store = MemoryMetadataStore()
    ...     ops = StorageSegmentOps(MemoryManagedLedgerFactory())
    ...     await demo(store, ops, SystemClock())
    ...     await ops.close()
    ...     await store.close()
    >>> asyncio.run(main())
    ['0000-7fff', '8000-ffff']
    ['topic://public/default/orders']
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from anabranch import failpoints, limits
from anabranch.clock import Clock
from anabranch.core.assignment import PushAssignment, SubscriptionAssignment
from anabranch.core.assignment_stats import assignment_stats
from anabranch.core.names import NamespaceName, SegmentName, TopicDomain, TopicName
from anabranch.core.segment_layout import SegmentLayout, segment_name
from anabranch.errors import Closed, InvalidArgument, MetadataError, NotFound, NotLeader
from anabranch.metadata.api import Check, MetadataStore, Session
from anabranch.scalable.controller import ScalableCounters, ScalableTopicController
from anabranch.scalable.paths import LeaderAddress, TopicPaths, namespace_path
from anabranch.scalable.segment_ops import SegmentOps
from anabranch.supervisor import GiveUp, Supervised

log = logging.getLogger(__name__)

TopicAssignmentListener = Callable[[TopicName, str, PushAssignment], None]
"""``(topic, subscription, push)``: deliver an assignment to a connected consumer."""


def scalable_topic_name(text: str | TopicName) -> TopicName:
    """Parse a scalable topic name; short forms get the ``topic://`` domain.

    Example:
        >>> str(scalable_topic_name("public/default/orders"))
        'topic://public/default/orders'
    """
    name = text if isinstance(text, TopicName) else TopicName.parse(text, TopicDomain.TOPIC)
    if name.domain is not TopicDomain.TOPIC:
        raise InvalidArgument(f"{name} is not a scalable topic:// name")
    return name


class ScalableTopicService:
    """Controllers of this broker, one per scalable topic it has touched."""

    def __init__(
        self,
        store: MetadataStore,
        ops: SegmentOps,
        clock: Clock,
        broker_url: str,
        *,
        pulsar_url: str = "",
        session: Session | None = None,
        session_ttl_s: float = limits.SCALABLE_SESSION_TTL_S,
        grace_period_ms: int = limits.SCALABLE_CONSUMER_GRACE_PERIOD_MS,
        drain_poll_interval_s: float = limits.SCALABLE_DRAIN_POLL_INTERVAL_S,
        on_assignment: TopicAssignmentListener | None = None,
        on_give_up: GiveUp | None = None,
    ) -> None:
        self._on_give_up = on_give_up
        self.store = store
        self.ops = ops
        self.clock = clock
        self.broker_url = broker_url
        """This broker's HTTP URL (admin redirects); set before the first controller."""
        self.pulsar_url = pulsar_url
        """This broker's ``pulsar://`` URL (binary redirects and the DAG)."""
        self.grace_period_ms = grace_period_ms
        self.drain_poll_interval_s = drain_poll_interval_s
        self.counters = ScalableCounters()
        self._on_assignment = on_assignment
        self._session = session
        self._own_session = session is None
        self._session_ttl_s = session_ttl_s
        self._guard: Supervised | None = None
        self._controllers: dict[TopicName, ScalableTopicController] = {}
        self._lock = asyncio.Lock()
        self._closed = False

    async def start(self) -> None:
        """Open this broker's metadata session unless one was given, and guard it."""
        if self._session is None:
            self._session = await self.store.open_session(self._session_ttl_s)
        if self._guard is None:
            self._guard = Supervised(
                "scalable-session-guard", self._guard_session, on_give_up=self._on_give_up
            ).start()

    @property
    def session(self) -> Session | None:
        """The session the controllers campaign under (a new one after each expiry)."""
        return self._session

    async def _guard_session(self) -> None:
        """Open a new session whenever ours expires and make every controller rejoin.

        A session expires while the broker is paused, partitioned from the store or too
        busy to keep it alive; the broker itself lives on and must lead again one day.
        """
        while not self._closed:
            session = self._session
            # Expiry is a deadline passing on the clock (no event fires for it): poll.
            while session is not None and not session.expired and not self._closed:  # noqa: ASYNC110
                await asyncio.sleep(limits.SCALABLE_SESSION_POLL_S)
            if self._closed or failpoints.enabled(failpoints.NO_RECAMPAIGN):
                return
            log.warning("the scalable-topic controllers' metadata session expired: rejoining")
            fresh = await self._reopen_session()
            if fresh is None:
                return
            self._session = fresh
            self._own_session = True
            self.counters.sessions_renewed += 1
            async with self._lock:
                controllers = list(self._controllers.values())
            for controller in controllers:
                try:
                    await controller.rejoin(fresh)
                except Exception:
                    log.exception("%s: rejoining the election failed", controller.topic)

    async def _reopen_session(self) -> Session | None:
        while not self._closed:
            try:
                return await self.store.open_session(self._session_ttl_s)
            except (MetadataError, Closed) as err:
                log.warning("cannot open a metadata session yet: %s", err)
                await asyncio.sleep(limits.SCALABLE_SESSION_RETRY_S)
        return None

    async def controller(self, topic: str | TopicName) -> ScalableTopicController:
        """The started local controller of ``topic`` (created on first use)."""
        name = scalable_topic_name(topic)
        if self._closed:
            raise Closed("scalable topic service is closed")
        async with self._lock:
            controller = self._controllers.get(name)
            if controller is None:
                if self._session is None or self._guard is None:
                    await self.start()
                assert self._session is not None
                controller = ScalableTopicController(
                    self.store,
                    name,
                    self.ops,
                    self.clock,
                    self._session,
                    broker_url=self.broker_url,
                    pulsar_url=self.pulsar_url,
                    counters=self.counters,
                    grace_period_ms=self.grace_period_ms,
                    on_assignment=functools.partial(self._deliver, name),
                    drain_poll_interval_s=self.drain_poll_interval_s,
                    on_retired=self._retired,
                )
                await controller.start()
                self._controllers[name] = controller
            return controller

    def _retired(self, controller: ScalableTopicController) -> None:
        """A follower saw its topic deleted: the next request makes a new controller."""
        if self._controllers.get(controller.topic) is controller:
            del self._controllers[controller.topic]

    def _deliver(self, topic: TopicName, subscription: str, push: PushAssignment) -> None:
        self.counters.assignment_changes += 1
        if self._on_assignment is not None:
            self._on_assignment(topic, subscription, push)

    def segment_drained(self, segment: str, subscription: str) -> None:
        """A sealed segment's subscription acknowledged everything on this broker: wake
        the topic's local controller (if it leads here) to hand out the children now,
        instead of at its next drain poll. Other brokers' controllers poll."""
        try:
            name = SegmentName.parse(segment)
        except InvalidArgument:
            return
        controller = self._controllers.get(name.topic)
        if controller is not None:
            controller.wake_drains(subscription)

    def local_controllers(self) -> list[ScalableTopicController]:
        """The controllers running on this broker (leaders or followers)."""
        return list(self._controllers.values())

    def assignment(self, topic: TopicName, subscription: str) -> SubscriptionAssignment | None:
        """The local leader's assignment state of ``subscription`` (None if not leading it)."""
        controller = self._controllers.get(topic)
        return controller.assignment(subscription) if controller is not None else None

    def leads(self, topic: TopicName) -> bool:
        """Whether this broker's controller of ``topic`` is the leader now."""
        controller = self._controllers.get(topic)
        return controller is not None and controller.is_leader

    def assignment_stats(self, topic: TopicName, subscriptions: list[str]) -> dict[str, Any]:
        """Each subscription's assignment state (``core/assignment_stats``) from the local
        controller leader; ``{"leader": False}`` per subscription elsewhere (the state lives
        on the leader: ``controllerBrokerUrl`` names it)."""
        controller = self._controllers.get(topic)
        out: dict[str, Any] = {}
        for sub in subscriptions:
            state = controller.assignment(sub) if controller is not None else None
            if state is None or controller is None or not controller.is_leader:
                out[sub] = {"leader": False}
            else:
                now_ms = int(self.clock.monotonic() * 1000)
                out[sub] = {"leader": True, **assignment_stats(state, now_ms)}
        return out

    async def _leader(self, topic: str | TopicName) -> ScalableTopicController:
        controller = await self.controller(topic)
        if not controller.is_leader:
            raise NotLeader(str(controller.topic), controller.leader_url)
        return controller

    async def _existing_leader(self, topic: str | TopicName) -> ScalableTopicController:
        """The leader of a topic that exists: NotFound before any controller is made.

        A controller lives until its topic is deleted and holds a ``controller`` record in
        the namespace, so one made for a name without a topic would leak memory, a
        record and an autoscaler round per request, and list the name as a topic.
        """
        name = scalable_topic_name(topic)
        if name not in self._controllers:
            await self.get_metadata(name)
        return await self._leader(name)

    async def _forget_if_absent(self, name: TopicName) -> None:
        """Close and drop the controller of ``name`` when it has no topic (a failed create)."""
        async with self._lock:
            controller = self._controllers.get(name)
            if controller is None or await self.store.get(TopicPaths(name).layout) is not None:
                return
            # A follower that saw no topic may have retired itself during the read.
            if self._controllers.get(name) is controller:
                del self._controllers[name]
        await controller.close()

    # --- reads (any broker) -----------------------------------------------------------------

    async def get_metadata(self, topic: str | TopicName) -> SegmentLayout:
        """The stored layout (NotFound if the topic does not exist)."""
        name = scalable_topic_name(topic)
        record = await self.store.get(TopicPaths(name).layout)
        if record is None:
            raise NotFound(str(name))
        return SegmentLayout.from_json(record.value)

    async def list_topics(self, namespace: str | NamespaceName) -> list[str]:
        """``topic://`` names of the namespace's scalable topics, sorted."""
        ns = namespace if isinstance(namespace, NamespaceName) else NamespaceName.parse(namespace)
        children = await self.store.list_children(namespace_path(ns))
        return [f"topic://{ns.tenant}/{ns.namespace}/{child}" for child in children]

    async def list_subscriptions(self, topic: str | TopicName) -> list[str]:
        """Names of the topic's subscriptions."""
        name = scalable_topic_name(topic)
        await self.get_metadata(name)
        return await self.store.list_children(TopicPaths(name).subscriptions)

    async def leader_address(self, topic: str | TopicName) -> LeaderAddress | None:
        """The controller leader's HTTP and pulsar URLs (None while there is none)."""
        record = await self.store.get(TopicPaths(scalable_topic_name(topic)).controller)
        return LeaderAddress.decode(record.value) if record is not None else None

    async def leader_url(self, topic: str | TopicName) -> str | None:
        """The controller leader's HTTP URL (None while there is none)."""
        address = await self.leader_address(topic)
        return address.http if address is not None else None

    async def stats(self, topic: str | TopicName) -> dict[str, Any]:
        """Layout summary, subscriptions and per-segment backlog, for the admin API."""
        name = scalable_topic_name(topic)
        layout = await self.get_metadata(name)
        subscriptions = await self.list_subscriptions(name)
        segments: dict[str, Any] = {}
        for segment in layout.active_segments():
            seg = segment_name(name, segment)
            segments[str(seg)] = {
                "segmentId": segment.segment_id,
                "backlog": {sub: await self.ops.segment_backlog(seg, sub) for sub in subscriptions},
            }
        return {
            "epoch": layout.epoch,
            "activeSegments": len(layout.active_segments()),
            "sealedSegments": len(layout.sealed_segments()),
            "subscriptions": subscriptions,
            "segments": segments,
            "controllerBrokerUrl": await self.leader_url(name),
        }

    # --- mutations (the leader only) --------------------------------------------------------

    async def create(
        self, topic: str | TopicName, num_initial_segments: int, *, guard: Sequence[Check] = ()
    ) -> SegmentLayout:
        """Create a scalable topic with ``num_initial_segments`` segments (``guard``: see
        :meth:`ScalableTopicController.create`)."""
        name = scalable_topic_name(topic)
        try:
            return await (await self._leader(name)).create(num_initial_segments, guard=guard)
        except BaseException:
            await asyncio.shield(self._forget_if_absent(name))
            raise

    async def delete(self, topic: str | TopicName) -> None:
        """Delete a scalable topic, its segments and metadata."""
        name = scalable_topic_name(topic)
        controller = await self._existing_leader(name)
        await controller.delete()
        async with self._lock:
            if self._controllers.get(name) is controller:
                del self._controllers[name]

    async def split(self, topic: str | TopicName, segment_id: int) -> SegmentLayout:
        """Split one active segment."""
        return await (await self._existing_leader(topic)).split(segment_id)

    async def merge(self, topic: str | TopicName, first_id: int, second_id: int) -> SegmentLayout:
        """Merge two adjacent active segments."""
        return await (await self._existing_leader(topic)).merge(first_id, second_id)

    async def create_subscription(self, topic: str | TopicName, subscription: str) -> None:
        """Create a subscription (cursors at EARLIEST on every active segment)."""
        await (await self._existing_leader(topic)).create_subscription(subscription)

    async def delete_subscription(self, topic: str | TopicName, subscription: str) -> None:
        """Delete a subscription and its cursors."""
        await (await self._existing_leader(topic)).delete_subscription(subscription)

    async def close(self) -> None:
        """Close every controller (stepping down) and our own session. Idempotent."""
        self._closed = True
        if self._guard is not None:
            await self._guard.stop()
        async with self._lock:
            controllers, self._controllers = list(self._controllers.values()), {}
        for controller in controllers:
            try:
                await controller.close()
            except Exception:
                log.exception("closing the controller of %s failed", controller.topic)
        if self._own_session and self._session is not None:
            await self._session.close()

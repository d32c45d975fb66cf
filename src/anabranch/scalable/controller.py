"""The per-topic scalable-topic controller (PIP-468): leadership, layout changes, consumers.

Theory of operation
-------------------
*Leadership.* Every broker that touches a scalable topic runs a
:class:`ScalableTopicController` for it; they race to create the ephemeral key
``/topics/{t}/{ns}/{topic}/controller`` (value: the broker's HTTP and pulsar URLs as
JSON, :class:`~anabranch.scalable.paths.LeaderAddress`) under their broker's
metadata session. The winner is the leader; the others watch the key and race again when
it is deleted (its session expired or it stepped down). Being elected is not proof of the
right to write (STYLE #6): the key's ``create_revision`` is the fencing token, and every
write of the leader is one atomic commit that starts with
``Check(controller, expected_create_revision=token)``. A deposed leader's write fails and
surfaces as :class:`~anabranch.errors.NotLeader`; the layout record is additionally
written with a compare-and-set on its own version.

*Changes, in PIP-468's order.* A split or merge is computed on the current layout first
(so an invalid request raises a typed error before anything is written), then:

    1. record the intent at ``.../pending-op`` (fenced, must not exist);
    2. discover subscriptions: the ``.../subscriptions/*`` records plus the parents' cursors;
    3. create the child segment topics with every subscription's cursor at EARLIEST, so no
       message written to a child can be missed by a subscription;
    4. terminate (seal) the parents; each returns its producers' dedup snapshot;
    5. one fenced commit: the sealed parents' snapshots at ``.../sealed/{id}`` (children
       seed their dedup state from them), the new layout (CAS on its version), and the
       deletion of the intent;
    6. notify: DAG watchers see the layout record change; the leader feeds the new layout
       to its subscription coordinators.

Every step is idempotent, and the intent carries everything needed to recompute the same
new layout (operation, segment ids, the layout epoch it applies to, its ``now_ms``). A new
leader that finds an intent at start-up finishes it (steps 2-6); if the layout already
moved past the intent's epoch the intent is stale and only deleted. Operations of one
controller run one at a time under a lock.

*Consumers.* The leader keeps one :class:`SubscriptionCoordinator` per subscription
(the pure :mod:`~anabranch.core.assignment` state machine and its shell). Sessions are
persisted under ``.../subscriptions/{sub}/consumers/{name}``; a new leader restores them
all as disconnected with a fresh grace period, so consumers have time to find it.

Example:
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.scalable.segment_ops import StorageSegmentOps
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo(store, ops, clock, session) -> None:
    ...     topic = TopicName.parse("topic://public/default/orders")
    ...     controller = ScalableTopicController(store, topic, ops, clock, session,
    ...                                          broker_url="pulsar://b1:6650")
    ...     await controller.start()
    ...     await controller.create(2)
    ...     layout = await controller.split(0)     # segments 2, 3 replace 0
    ...     active = layout.active_segments()      # in hash order
    ...     print(layout.epoch, [(s.segment_id, s.hash_range.to_hex()) for s in active])
    ...     await controller.close()
    >>> async def main() -> None:
    ...     store = MemoryMetadataStore()
    ...     ops = StorageSegmentOps(MemoryManagedLedgerFactory())
    ...     await demo(store, ops, SystemClock(), await store.open_session(10.0))
    ...     await ops.close()
    ...     await store.close()
    >>> asyncio.run(main())
    1 [(2, '0000-3fff'), (3, '4000-7fff'), (1, '8000-ffff')]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from anabranch import limits
from anabranch.clock import Clock
from anabranch.core.assignment import (
    ConsumerDisconnected,
    ConsumerRegistered,
    ConsumerUnregistered,
    Instruction,
    LayoutChanged,
    PushAssignment,
    SubscriptionAssignment,
)
from anabranch.core.assignment_stats import subscription_type
from anabranch.core.names import SegmentName, TopicName, validate_component
from anabranch.core.segment_layout import SegmentLayout, segment_name
from anabranch.errors import (
    AlreadyExists,
    BadVersion,
    Closed,
    Compacted,
    InvalidArgument,
    NotAllowed,
    NotFound,
    NotLeader,
    ResourceLimitReached,
    SessionExpired,
    ValueTooLarge,
)
from anabranch.metadata.api import (
    MUST_NOT_EXIST,
    Check,
    CommitResult,
    Delete,
    EventKind,
    MetadataStore,
    Op,
    Put,
    Session,
)
from anabranch.scalable.paths import LeaderAddress, TopicPaths
from anabranch.scalable.segment_ops import SegmentOps
from anabranch.scalable.subscription_coordinator import (
    AssignmentListener,
    SubscriptionCoordinator,
)
from anabranch.transactions.records import aborted_prefix

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingOp:
    """A split or merge in progress: enough to recompute the exact same new layout."""

    op: str
    """``"split"`` or ``"merge"``."""
    segment_ids: tuple[int, ...]
    epoch: int
    """The layout epoch the change applies to."""
    now_ms: int

    def apply(self, layout: SegmentLayout) -> SegmentLayout:
        """The layout after this change (raises the layout's typed errors if illegal).

        Example:
            >>> PendingOp("split", (0,), 0, 5).apply(SegmentLayout.initial(1, 0)).epoch
            1
        """
        if self.op == "split" and len(self.segment_ids) == 1:
            return layout.split(self.segment_ids[0], self.now_ms)
        if self.op == "merge" and len(self.segment_ids) == 2:
            return layout.merge(self.segment_ids[0], self.segment_ids[1], self.now_ms)
        raise InvalidArgument(f"unknown pending operation {self!r}")

    def to_json(self) -> bytes:
        doc = {"op": self.op, "segmentIds": list(self.segment_ids), "epoch": self.epoch}
        return json.dumps({**doc, "nowMs": self.now_ms}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> PendingOp:
        doc = json.loads(data)
        return cls(doc["op"], tuple(doc["segmentIds"]), doc["epoch"], doc["nowMs"])


@dataclass
class ScalableCounters:
    """Plain-int counters of the controllers of one broker (read by ``/metrics``)."""

    splits: int = 0
    merges: int = 0
    prunes: int = 0
    """Prunes of drained sealed segments out of the DAG (PIP-468 pruneSegment)."""
    leader_elections: int = 0
    """Controller leaderships this broker acquired (a fail-over elects a new one)."""
    assignment_changes: int = 0
    """Assignment pushes to consumers (a changed share, a (re)registration or a new epoch)."""
    sessions_renewed: int = 0
    """Metadata sessions this broker's controllers lost and replaced (pause, partition)."""


STREAM = "STREAM"
CHECKPOINT = "CHECKPOINT"
KEY_SHARED_STREAM = "STREAM_KEY_SHARED"
"""Subscription kinds (the wire's ``ScalableConsumerType``; a STREAM subscription in
Key_Shared dispatch mode is its own kind), kept in the subscription record."""


def subscription_kind(record: bytes) -> str:
    """The kind of a subscription record (STREAM if unreadable).

    >>> subscription_kind(b'{"type": "STREAM_KEY_SHARED"}'), subscription_kind(b"?")
    ('STREAM_KEY_SHARED', 'STREAM')
    """
    try:
        kind = json.loads(record).get("type", STREAM)
    except (ValueError, AttributeError):
        return STREAM
    return kind if kind in (CHECKPOINT, KEY_SHARED_STREAM) else STREAM


def _ignore_assignment(subscription: str, push: PushAssignment) -> None:
    log.debug("assignment of %s not delivered (no listener): %s", subscription, push)


class ScalableTopicController:
    """One scalable topic's controller on this broker (see the module docstring)."""

    def __init__(
        self,
        store: MetadataStore,
        topic: TopicName,
        ops: SegmentOps,
        clock: Clock,
        session: Session,
        *,
        broker_url: str = "",
        pulsar_url: str = "",
        counters: ScalableCounters | None = None,
        grace_period_ms: int = limits.SCALABLE_CONSUMER_GRACE_PERIOD_MS,
        on_assignment: AssignmentListener | None = None,
        drain_poll_interval_s: float = limits.SCALABLE_DRAIN_POLL_INTERVAL_S,
        on_retired: Callable[[ScalableTopicController], None] | None = None,
    ) -> None:
        self.store = store
        self.topic = topic
        self.paths = TopicPaths(topic)
        self.ops = ops
        self.clock = clock
        self.session = session
        self.broker_url = broker_url
        self.pulsar_url = pulsar_url
        self.counters = counters or ScalableCounters()
        self.grace_period_ms = grace_period_ms
        self._on_assignment = on_assignment or _ignore_assignment
        self._poll_interval_s = drain_poll_interval_s
        self._token: int | None = None  # create_revision of our controller key
        self._leader: LeaderAddress | None = None
        self._watch_from: int | None = None
        self._lock = asyncio.Lock()
        self._layout: SegmentLayout | None = None
        self._layout_version = 0
        self._coordinators: dict[str, SubscriptionCoordinator] = {}
        self._campaign: asyncio.Task[None] | None = None
        self._resume: asyncio.Task[None] | None = None
        self._elected = asyncio.Event()
        self._leadership_listeners: set[Callable[[TopicName], None]] = set()
        self._closed = False
        self._on_retired = on_retired
        self.retired = False
        """The topic was deleted while this controller followed: it stopped campaigning."""

    # --- leadership -----------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Whether this controller holds the leadership (as far as it knows: writes fence)."""
        return self._token is not None

    @property
    def leader_url(self) -> str | None:
        """The leader's HTTP URL as last seen (ours when leading): where admin mutations go."""
        return self._leader.http if self._leader is not None else None

    @property
    def leader_address(self) -> LeaderAddress | None:
        """The leader's HTTP and pulsar URLs as last seen (None while there is none)."""
        return self._leader

    @property
    def address(self) -> LeaderAddress:
        """This broker's addresses, the value it writes when it wins the election."""
        return LeaderAddress(self.broker_url, self.pulsar_url)

    async def start(self) -> None:
        """Run one election round now, then keep campaigning in the background."""
        if self._campaign is not None:
            return
        await self._try_acquire(first=True)
        self._campaign = asyncio.create_task(self._campaign_loop())

    async def wait_leader(self) -> None:
        """Return once this controller is the leader (and has recovered the topic)."""
        while not self.is_leader or not self._elected.is_set():
            if self._closed:
                raise Closed(f"controller of {self.topic} is closed")
            self._elected.clear()
            await self._elected.wait()

    async def rejoin(self, session: Session) -> None:
        """Campaign again under ``session``: the broker's previous session expired.

        A broker paused past its session TTL comes back with a dead session: its key (if
        it led) is gone, and a put under that session can never succeed again. Without a
        new session it would answer every request with "no leader" forever, and once every
        broker had been paused once, no broker could lead (issue 19).
        """
        if self._closed:
            return
        if self._campaign is not None:
            self._campaign.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._campaign
        await self._lost_leadership()
        self.session = session
        self._watch_from = None
        self._campaign = asyncio.create_task(self._campaign_loop())

    async def _try_acquire(self, *, first: bool = False) -> None:
        """One attempt: take the key if it is free, else learn who holds it. Past the
        ``first`` (a request here, maybe a create), a free key over a topic without a
        layout means the leader deleted the topic: this controller retires instead."""
        path = self.paths.controller
        while True:
            if self.session.expired:
                # Checked first: while another leader holds the key we would never put, and
                # would not notice that we can no longer campaign (the service rejoins us).
                raise SessionExpired(self.session.id)
            page = await self.store.list_range(path, path + "\x00")
            if page.records:
                record = page.records[0]
                self._watch_from = page.revision + 1
                if record.stat.session_id == self.session.id:
                    # Our own session holds it (this controller was re-created): keep it.
                    await self._became_leader(record.stat.create_revision)
                    return
                holder = LeaderAddress.decode(record.value)
                if self._is_stale_self(holder):
                    # A previous incarnation of this broker (same addresses, which only one
                    # live process can be bound to) died holding it: do not wait for its
                    # session to expire. The Check makes this a no-op if it changed meanwhile.
                    log.info("%s: removing the controller key of a dead predecessor", self.topic)
                    with contextlib.suppress(BadVersion):
                        guard = Check(path, expected_create_revision=record.stat.create_revision)
                        await self.store.commit([guard, Delete(path)])
                    continue
                self._leader = holder
                return
            if not first and await self.store.get(self.paths.layout) is None:
                self._retire()
                return
            try:
                stat = await self.store.put(
                    path, self.address.encode(), MUST_NOT_EXIST, session=self.session
                )
            except BadVersion:
                continue  # someone else won this round: read who
            self._watch_from = stat.mod_revision + 1
            await self._became_leader(stat.create_revision)
            return

    def _retire(self) -> None:
        """Stop following a deleted topic: campaigning on, this controller would lead it
        (and list it again) once the deleting leader stepped down, and would stay in
        memory, watching its key, on every broker that ever served the topic."""
        log.info("%s: the topic is gone; its controller here retires", self.topic)
        self.retired = True
        self._closed = True
        self._elected.set()
        if self._on_retired is not None:
            self._on_retired(self)

    def _is_stale_self(self, holder: LeaderAddress) -> bool:
        return bool(self.broker_url and self.pulsar_url) and holder == self.address

    async def _became_leader(self, token: int) -> None:
        self._token = token
        self._leader = self.address
        self.counters.leader_elections += 1
        log.info("%s: elected controller leader (token %d)", self.topic, token)
        async with self._lock:
            await self._recover()
        self._elected.set()

    async def _campaign_loop(self) -> None:
        """Watch the controller key; race for it whenever it is deleted."""
        while not self._closed:
            try:
                if self._watch_from is None:
                    await self._try_acquire()
                    if self._closed:
                        return
                watch = self.store.watch(self.paths.controller, start_revision=self._watch_from)
                try:
                    async for event in watch:
                        self._watch_from = event.revision + 1
                        if event.kind is EventKind.DELETE:
                            await self._lost_leadership()
                            await self._try_acquire()
                            if self._closed:
                                return
                        elif self._token is None:
                            self._leader = LeaderAddress.decode(event.value)
                finally:
                    await watch.close()
            except Compacted:
                self._watch_from = None  # re-read the key, then watch from there
            except (Closed, SessionExpired, asyncio.CancelledError):
                await self._lost_leadership()
                return
            except Exception:
                log.exception("%s: controller election loop failed; retrying", self.topic)
                self._watch_from = None
                await self.clock.sleep(limits.SCALABLE_WATCH_RETRY_S)

    async def _lost_leadership(self) -> None:
        if self._token is None and not self._coordinators:
            self._leader = None
            return
        # (Coordinators left with no token: a fenced commit found us deposed first.)
        log.info("%s: controller leadership lost", self.topic)
        self._token = None
        self._leader = None
        self._elected.clear()
        if self._resume is not None and self._resume is not asyncio.current_task():
            self._resume.cancel()  # finishing a pending change is the leader's work
        await self._stop_coordinators()
        for listener in list(self._leadership_listeners):
            try:
                listener(self.topic)
            except Exception:
                log.exception("%s: a leadership listener failed", self.topic)

    def add_leadership_listener(self, listener: Callable[[TopicName], None]) -> None:
        """Call ``listener(topic)`` whenever this controller stops leading (idempotent per
        listener): the broker ends the consumer registrations it served as the controller,
        so their clients register with the new leader instead of waiting on this one."""
        self._leadership_listeners.add(listener)

    async def _commit(self, ops: Sequence[Op]) -> CommitResult:
        """A commit fenced by our leadership token; NotLeader if we were deposed."""
        token = self._token
        if token is None:
            raise NotLeader(str(self.topic), self.leader_url)
        guard = Check(self.paths.controller, expected_create_revision=token)
        try:
            return await self.store.commit([guard, *ops])
        except BadVersion as err:
            if err.path != self.paths.controller:
                raise
            self._token = None
            record = await self.store.get(self.paths.controller)
            self._leader = LeaderAddress.decode(record.value) if record is not None else None
            raise NotLeader(str(self.topic), self.leader_url) from None

    def _require_leader(self) -> None:
        if self._closed:
            raise Closed(f"controller of {self.topic} is closed")
        if self._token is None:
            raise NotLeader(str(self.topic), self.leader_url)

    # --- layout ---------------------------------------------------------------------------

    async def _read_layout(self) -> tuple[SegmentLayout, int]:
        record = await self.store.get(self.paths.layout)
        if record is None:
            raise NotFound(str(self.topic))
        layout = SegmentLayout.from_json(record.value)
        self._layout, self._layout_version = layout, record.stat.version
        return layout, record.stat.version

    async def get_layout(self) -> SegmentLayout:
        """The current layout as stored (NotFound if the topic does not exist)."""
        layout, _ = await self._read_layout()
        return layout

    @property
    def layout(self) -> SegmentLayout | None:
        """The layout as this controller last read or wrote it (no I/O; for metrics)."""
        return self._layout

    def _segment(self, layout: SegmentLayout, segment_id: int) -> SegmentName:
        return segment_name(self.topic, layout.segment(segment_id))

    async def create(
        self,
        num_initial_segments: int,
        properties: dict[str, str] | None = None,
        *,
        guard: Sequence[Check] = (),
    ) -> SegmentLayout:
        """Create the topic: its segment topics, then its layout (AlreadyExists if present).

        ``guard`` goes into the layout's commit (the namespace exists and is not being
        deleted); when one of its checks fails, nothing is created: NotFound.

        Example:
            >>> # layout = await controller.create(4)  -> segments 0..3, epoch 0
        """
        async with self._lock:
            self._require_leader()
            layout = SegmentLayout.initial(num_initial_segments, self.clock.wall_ms(), properties)
            if await self.store.get(self.paths.layout) is not None:
                raise AlreadyExists(str(self.topic))
            for segment in layout.active_segments():
                await self.ops.create_segment(segment_name(self.topic, segment), [])
            put = Put(self.paths.layout, layout.to_json(), MUST_NOT_EXIST)
            try:
                result = await self._commit([put, *guard])
            except BadVersion as err:
                if err.path != self.paths.layout:
                    raise NotFound(f"namespace of {self.topic} (absent or being deleted)") from None
                raise AlreadyExists(str(self.topic)) from None
            stat = result.results[1]
            assert stat is not None and not isinstance(stat, bool)
            self._layout, self._layout_version = layout, stat.version
            return layout

    async def split(self, segment_id: int) -> SegmentLayout:
        """Split active segment ``segment_id`` at its midpoint (PIP-468 order)."""
        async with self._lock:
            self._require_leader()
            await self._finish_pending()
            layout, _ = await self._read_layout()
            intent = PendingOp("split", (segment_id,), layout.epoch, self.clock.wall_ms())
            return await self._change(layout, intent)

    async def merge(self, first_id: int, second_id: int) -> SegmentLayout:
        """Merge two adjacent active segments into one (PIP-468 order)."""
        async with self._lock:
            self._require_leader()
            await self._finish_pending()
            layout, _ = await self._read_layout()
            intent = PendingOp("merge", (first_id, second_id), layout.epoch, self.clock.wall_ms())
            return await self._change(layout, intent)

    async def prune(self, segment_ids: Sequence[int]) -> SegmentLayout:
        """Remove drained sealed root segments from the DAG (PIP-468 ``pruneSegment``),
        then delete their data. The caller (the broker's retention sweep) decides which
        with :func:`anabranch.core.retention.prunable_segments`.

        One fenced commit writes the new layout (CAS on its version; the epoch advances,
        the children of a pruned block become roots), deletes the pruned segments' seal
        snapshots and records each at ``.../pruned/{id}``; DAG watchers see the layout
        change, coordinators get the new layout (a pruned segment counts as drained). Then
        :meth:`finish_prunes` deletes each pruned segment topic (its ledgers, cursors and
        dedup snapshot) and its aborted-transaction records, and only then its record: a
        failure or crash there leaves the record, and the next call finishes the deletion.
        The layout never names a segment whose data is gone.

        Example:
            >>> # layout = await controller.prune([0])    # after split(0) and a drain
        """
        async with self._lock:
            self._require_leader()
            await self._finish_pending()
            layout, version = await self._read_layout()
            new_layout = layout
            removed: list[int] = []
            for segment_id in segment_ids:
                if segment_id in new_layout.segments and segment_id not in removed:
                    removed.extend(new_layout.prune_block(segment_id))
                    new_layout = new_layout.prune(segment_id)
            if not removed:
                return layout
            ops: list[Op] = [Put(self.paths.layout, new_layout.to_json(), version)]
            for segment_id in removed:
                name = str(self._segment(layout, segment_id))
                ops.append(Put(self.paths.pruned(segment_id), name.encode()))
                if await self.store.get(self.paths.sealed(segment_id)) is not None:
                    ops.append(Delete(self.paths.sealed(segment_id)))
            result = await self._commit(ops)
            stat = result.results[1]
            assert stat is not None and not isinstance(stat, bool)
            self._layout, self._layout_version = new_layout, stat.version
            self.counters.prunes += 1
            log.info("%s: pruned %s, epoch %d", self.topic, removed, new_layout.epoch)
            for coordinator in list(self._coordinators.values()):
                await coordinator.handle(LayoutChanged(new_layout))
        await self.finish_prunes()
        return new_layout

    async def finish_prunes(self) -> int:
        """Delete the data of pruned segments still recorded at ``.../pruned/{id}``
        (see :meth:`prune`); returns how many were finished. A failure is logged and the
        record stays for the next call."""
        done = 0
        for child in await self.store.list_children(self.paths.pruned_root):
            path = f"{self.paths.pruned_root}/{child}"
            record = await self.store.get(path)
            if record is None:
                continue
            try:
                name = SegmentName.parse(record.value.decode())
                await self.ops.delete_segment(name)
                page = await self.store.list_prefix(aborted_prefix(str(name)))
                for aborted in page.records:
                    await self.store.delete(aborted.path)
                await self._commit([Delete(path, record.stat.version)])
                done += 1
            except (NotLeader, Closed):
                raise
            except Exception:
                log.exception("%s: deleting pruned segment %s failed", self.topic, child)
        return done

    async def _change(self, layout: SegmentLayout, intent: PendingOp) -> SegmentLayout:
        new_layout = intent.apply(layout)  # an illegal change raises here, before any write
        # _execute seals the parents before it writes the layout: a layout the store would
        # refuse must be refused here, or the topic is left with a sealed ACTIVE segment and
        # an intent that can never finish.
        if len(new_layout.segments) > limits.SCALABLE_SEGMENTS_MAX:
            raise ResourceLimitReached(
                f"segments in the layout of {self.topic} (sealed ones stay until retention "
                "prunes them)",
                limits.SCALABLE_SEGMENTS_MAX,
            )
        size = len(new_layout.to_json())
        if size > limits.METADATA_VALUE_BYTES_MAX:
            raise ValueTooLarge(
                f"the new layout of {self.topic}", size, limits.METADATA_VALUE_BYTES_MAX
            )
        try:
            await self._commit([Put(self.paths.pending_op, intent.to_json(), MUST_NOT_EXIST)])
        except BadVersion:
            raise NotAllowed(f"{self.topic} has a split or merge in progress") from None
        try:
            return await self._execute(intent)
        except (InvalidArgument, NotAllowed, NotLeader, Closed):
            raise
        except Exception:
            # A segment operation failed (its owner died, the store blinked): the intent
            # stays, and is finished in the background, so the topic is never stuck "in
            # progress" waiting for a leadership change (issue 19).
            self._resume_pending_later()
            raise

    async def _finish_pending(self) -> None:
        """Finish a change a failed request (or a previous leader) left half done; under
        ``_lock``. Raises what the change's segment operations raise (retriable)."""
        record = await self.store.get(self.paths.pending_op)
        if record is None:
            return
        intent = PendingOp.from_json(record.value)
        log.info("%s: finishing the pending %s of %s", self.topic, intent.op, intent.segment_ids)
        try:
            await self._execute(intent)
        except (InvalidArgument, NotAllowed) as err:
            log.warning("%s: pending %s could not be applied: %s", self.topic, intent.op, err)

    def _resume_pending_later(self) -> None:
        if self._resume is None or self._resume.done():
            self._resume = asyncio.create_task(self._resume_pending())

    async def _resume_pending(self) -> None:
        """Retry the pending change with backoff until it is done or we no longer lead."""
        delay = limits.SCALABLE_PENDING_RETRY_MIN_S
        while not self._closed and self._token is not None:
            await self.clock.sleep(delay)
            try:
                async with self._lock:
                    if self._token is None:
                        return
                    await self._finish_pending()
                return
            except (NotLeader, Closed):
                return
            except Exception as err:
                log.warning("%s: the pending change failed again: %s", self.topic, err)
                delay = min(delay * 2, limits.SCALABLE_PENDING_RETRY_MAX_S)

    async def _execute(self, intent: PendingOp) -> SegmentLayout:
        """Steps 2-6 of a change; safe to repeat after a crash at any point."""
        layout, version = await self._read_layout()
        if layout.epoch != intent.epoch:
            log.info("%s: stale %s intent (epoch %d) dropped", self.topic, intent.op, layout.epoch)
            await self._commit([Delete(self.paths.pending_op)])
            return layout
        try:
            new_layout = intent.apply(layout)
        except (InvalidArgument, NotAllowed):
            await self._commit([Delete(self.paths.pending_op)])
            raise
        parents = intent.segment_ids
        children = new_layout.segment(parents[0]).child_ids
        subscriptions = await self._discover_subscriptions(layout, parents)
        for child in children:
            await self.ops.create_segment(self._segment(new_layout, child), subscriptions)
        ops: list[Op] = []
        snapshots: list[bytes] = []
        for parent in parents:
            snapshot = await self.ops.terminate_segment(self._segment(layout, parent))
            snapshots.append(snapshot)
            ops.append(Put(self.paths.sealed(parent), snapshot))
        for child in children:
            # Before the layout names the children, so no producer reaches them unseeded.
            await self.ops.seed_dedup(self._segment(new_layout, child), snapshots)
        ops.append(Put(self.paths.layout, new_layout.to_json(), version))
        ops.append(Delete(self.paths.pending_op))
        result = await self._commit(ops)
        stat = result.results[len(parents) + 1]
        assert stat is not None and not isinstance(stat, bool)
        self._layout, self._layout_version = new_layout, stat.version
        if intent.op == "split":
            self.counters.splits += 1
        else:
            self.counters.merges += 1
        log.info("%s: %s of %s done, epoch %d", self.topic, intent.op, parents, new_layout.epoch)
        for coordinator in list(self._coordinators.values()):
            await coordinator.handle(LayoutChanged(new_layout))
        return new_layout

    async def _discover_subscriptions(
        self, layout: SegmentLayout, parents: Sequence[int]
    ) -> list[str]:
        names = set(await self.store.list_children(self.paths.subscriptions))
        for parent in parents:
            names.update(await self.ops.segment_subscriptions(self._segment(layout, parent)))
        return sorted(names)

    async def _recover(self) -> None:
        """A new leader: finish a half-done change, then restore consumer sessions."""
        if await self.store.get(self.paths.layout) is not None:
            try:
                await self._finish_pending()
            except (NotLeader, Closed):
                raise
            except Exception as err:
                # Consumers need their coordinators now; the change is retried meanwhile.
                log.warning("%s: the pending change failed: %s", self.topic, err)
                self._resume_pending_later()
        try:
            layout, _ = await self._read_layout()
        except NotFound:
            return
        for name in await self.store.list_children(self.paths.subscriptions):
            consumers = await self.store.list_children(self.paths.consumers(name))
            record = await self.store.get(self.paths.subscription(name))
            kind = subscription_kind(record.value) if record is not None else STREAM
            state, instructions = SubscriptionAssignment.restore(
                name,
                layout,
                consumers,
                now_ms=self._now_ms(),
                grace_period_ms=self.grace_period_ms,
                ordered=kind != CHECKPOINT,
                fan_out=kind == KEY_SHARED_STREAM,
            )
            await self._add_coordinator(state, instructions)

    # --- subscriptions and consumers --------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self.clock.monotonic() * 1000)

    async def _add_coordinator(
        self, state: SubscriptionAssignment, instructions: list[Instruction]
    ) -> None:
        topic_layout = state.layout

        async def backlog(segment_id: int, subscription: str) -> int:
            layout = self._layout or topic_layout
            segment = layout.segments.get(segment_id)
            if segment is None:
                return 0
            return await self.ops.segment_backlog(segment_name(self.topic, segment), subscription)

        coordinator = SubscriptionCoordinator(
            state,
            paths=self.paths,
            commit=self._commit,
            backlog=backlog,
            clock=self.clock,
            on_assignment=self._on_assignment,
            drain_poll_interval_s=self._poll_interval_s,
        )
        self._coordinators[state.subscription] = coordinator
        await coordinator.start(instructions)

    async def _stop_coordinators(self) -> None:
        coordinators, self._coordinators = list(self._coordinators.values()), {}
        for coordinator in coordinators:
            await coordinator.close()

    def wake_drains(self, subscription: str) -> None:
        """A sealed segment of ``subscription`` may have drained: look now, not at the
        next poll (no-op unless this controller leads the subscription)."""
        coordinator = self._coordinators.get(subscription)
        if coordinator is not None:
            coordinator.wake()

    def assignment(self, subscription: str) -> SubscriptionAssignment | None:
        """The leader's current assignment state of ``subscription`` (None if unknown)."""
        coordinator = self._coordinators.get(subscription)
        return coordinator.state if coordinator is not None else None

    async def create_subscription(self, name: str) -> None:
        """Create a subscription: a cursor at EARLIEST on every segment of the DAG (sealed
        ones too, so a subscription created after a split replays the sealed backlog, and a
        sealed segment's backlog is never mistaken for 0), then its record (AlreadyExists
        if the record exists)."""
        validate_component("subscription", name)
        async with self._lock:
            self._require_leader()
            await self._create_subscription(name)

    async def _create_subscription(self, name: str, kind: str = STREAM) -> None:
        layout, _ = await self._read_layout()
        if await self.store.get(self.paths.subscription(name)) is not None:
            raise AlreadyExists(f"{self.topic} subscription {name}")
        if kind != CHECKPOINT:  # a checkpoint group keeps its positions itself: no cursors
            for segment in layout:
                await self.ops.create_segment(segment_name(self.topic, segment), [name])
        record = json.dumps({"createdAtMs": self.clock.wall_ms(), "type": kind}).encode()
        try:
            await self._commit([Put(self.paths.subscription(name), record, MUST_NOT_EXIST)])
        except BadVersion:
            raise AlreadyExists(f"{self.topic} subscription {name}") from None
        state, instructions = SubscriptionAssignment.create(
            name,
            layout,
            self.grace_period_ms,
            ordered=kind != CHECKPOINT,
            fan_out=kind == KEY_SHARED_STREAM,
        )
        await self._add_coordinator(state, instructions)

    async def delete_subscription(self, name: str) -> None:
        """Delete a subscription: its cursors on every segment, sessions and record."""
        validate_component("subscription", name)
        async with self._lock:
            self._require_leader()
            if await self.store.get(self.paths.subscription(name)) is None:
                raise NotFound(f"{self.topic} subscription {name}")
            coordinator = self._coordinators.pop(name, None)
            if coordinator is not None:
                await coordinator.close()
            layout, _ = await self._read_layout()
            for segment in layout:
                await self.ops.remove_subscription(segment_name(self.topic, segment), name)
            for consumer in await self.store.list_children(self.paths.consumers(name)):
                await self._commit([Delete(self.paths.consumer(name, consumer))])
            await self._commit([Delete(self.paths.subscription(name))])

    async def _coordinator(self, subscription: str, kind: str = STREAM) -> SubscriptionCoordinator:
        self._require_leader()
        coordinator = self._coordinators.get(subscription)
        if coordinator is None:
            async with self._lock:
                coordinator = self._coordinators.get(subscription)
                if coordinator is None:
                    # Subscribing to a missing subscription creates it, as in Pulsar.
                    await self._create_subscription(subscription, kind)
                    coordinator = self._coordinators[subscription]
        other = subscription_type(coordinator.state)
        if other != kind and CHECKPOINT not in (other, kind) and not coordinator.state.sessions:
            # A stream subscription nobody consumes takes the dispatch mode of its next
            # consumer, as a Pulsar subscription without consumers takes the next type.
            await coordinator.set_fan_out(kind == KEY_SHARED_STREAM)
            record = json.dumps({"createdAtMs": self.clock.wall_ms(), "type": kind}).encode()
            await self._commit([Put(self.paths.subscription(subscription), record)])
            other = kind
        if other != kind:
            raise NotAllowed(
                f"{self.topic} subscription {subscription} is a {other} subscription, not {kind}"
            )
        return coordinator

    async def register_consumer(
        self,
        subscription: str,
        consumer: str,
        consumer_id: int | None = None,
        *,
        kind: str = STREAM,
    ) -> tuple[int, ...]:
        """Register (or re-register) a consumer; returns its segment ids. Every consumer
        whose share changed also gets a push through ``on_assignment``.

        ``kind`` is ``"STREAM"`` (per-segment cursors; a child is assigned once its
        ancestors are drained for the subscription, or with them to the one consumer
        holding them all; drained sealed segments retire),
        ``"STREAM_KEY_SHARED"`` (the same, and consumers beyond the segment count share
        segments by key hash) or
        ``"CHECKPOINT"`` (a consumer group of checkpoint readers: no cursors, every segment
        of the DAG is dealt, the readers order parents before children themselves). A
        subscription keeps the kind it was created with (NotAllowed otherwise)."""
        coordinator = await self._coordinator(subscription, kind)
        await coordinator.handle(ConsumerRegistered(consumer, self._now_ms(), consumer_id))
        return coordinator.state.assignment.get(consumer, ())

    async def disconnect_consumer(
        self, subscription: str, consumer: str, consumer_id: int | None = None
    ) -> None:
        """The consumer's connection dropped: it keeps its share for the grace period."""
        coordinator = self._coordinators.get(subscription)
        if coordinator is not None:
            await coordinator.handle(ConsumerDisconnected(consumer, self._now_ms(), consumer_id))

    async def unregister_consumer(
        self, subscription: str, consumer: str, consumer_id: int | None = None
    ) -> None:
        """The consumer closed on purpose: its share is dealt out now."""
        coordinator = self._coordinators.get(subscription)
        if coordinator is not None:
            await coordinator.handle(ConsumerUnregistered(consumer, consumer_id))

    # --- topic deletion and shutdown ------------------------------------------------------

    async def delete(self) -> None:
        """Delete the topic: every segment topic, then every metadata key, then step down."""
        async with self._lock:
            self._require_leader()
            layout, version = await self._read_layout()
            await self._stop_coordinators()
            # Marks the topic as going away: only now may a segment owner delete the data
            # of segments the layout still lists as active (its guard reads this key).
            await self._commit([Put(self.paths.deleting, b"")])
            await self.finish_prunes()
            for segment in layout:
                await self.ops.delete_segment(segment_name(self.topic, segment))
            page = await self.store.list_prefix(self.paths.layout + "/")
            for record in page.records:
                if record.path != self.paths.controller:
                    await self._commit([Delete(record.path)])
            await self._commit([Delete(self.paths.layout, version)])
            self._layout = None
        await self.close()

    async def close(self) -> None:
        """Stop campaigning and step down (deleting our key if we still hold it)."""
        if self._closed:
            return
        self._closed = True
        self._elected.set()
        token = self._token  # read first: the cancelled campaign forgets it
        if self._campaign is not None:
            self._campaign.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._campaign
        await self._lost_leadership()
        if token is not None and not self.session.expired:
            with contextlib.suppress(BadVersion, Closed, SessionExpired):
                await self.store.commit(
                    [
                        Check(self.paths.controller, expected_create_revision=token),
                        Delete(self.paths.controller),
                    ]
                )

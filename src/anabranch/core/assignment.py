"""Segment → consumer assignment of one subscription (PIP-468's SubscriptionCoordinator).

Theory of operation
-------------------
A STREAM (or CHECKPOINT) subscription on a scalable topic gives each segment to exactly one
consumer, so a segment is read in order. :class:`SubscriptionAssignment` is the pure state
of that decision for one subscription: the layout, the consumer sessions, which sealed
segments are drained *for this subscription*, and the resulting assignment. Events go in
through :meth:`SubscriptionAssignment.handle`; a new state and a list of instructions come
out. The async shell (``scalable/``) performs the instructions (write/delete the session
node, push the assignment on the consumer's connection, poll segment backlogs, arm a
timer) and feeds results back as events. Nothing here reads a clock: time is ``now_ms``.

*Assignable segments.* A sealed segment that is drained (its backlog for this subscription
reached 0; it can never get more messages) is *retired* and never assigned again. With
``ordered=True`` (STREAM), a segment is assignable only when it is not retired and *every*
ancestor is drained: a child waits for its parents, and also for a grandparent that still
has backlog behind an empty middle generation. Because the segments containing one hash
form a chain root → ... → active, at most one assignable segment contains any hash: a key
is never readable from two generations at once, which is the parent-before-child
guarantee. (A hash can be in none for a while: a merge child waits for both parents.) Sealed segments with backlog are assignable too (DAG replay for a new EARLIEST
subscription). With ``ordered=False`` (CHECKPOINT, or unknown type) every non-retired
segment is assignable.

*Carried segments* (ordered, not fan-out). A segment whose undrained ancestors are all
held by one consumer is *carried*: it goes to that consumer too, before they drain. The
consumer itself then keeps parent before child: it subscribes to the segment only once
every ancestor it holds has handed out its last message (REACHED_END_OF_TOPIC; see
``client/stream_consumer.py``), and its cumulative acks cover everything delivered
before. Without this, a consumer that acknowledges every N messages (or in batches)
stalls after a split: the last messages of the sealed parent stay unacknowledged
because nothing after them arrives, and nothing arrives because the parent is not
drained. Several consumers never share a hash across generations: a child of ancestors
held by different consumers waits for the plain rule above.

*Deterministic assignment.* Assignable segments sorted by (range start, range end, id) are
dealt round-robin to the sessions sorted by name. With ``fan_out=True`` (a STREAM
subscription in Key_Shared dispatch mode, PIP-460 "Scaling Reads beyond the Segment
Count") and more sessions than assignable segments, session ``i`` gets segment
``i mod n``: every consumer holds one segment, and the consumers of one segment share it by
key hash (the segment's broker runs Key_Shared dispatch among them, so a key's messages
still go to one consumer at a time, in order). With as many segments as sessions or more,
the deal is the plain one. The assignment is a pure function of
(layout, drained, session names), so a new leader computes the same one and it need not be
persisted. Disconnected sessions inside their grace period keep their share, but nothing
is pushed to them until they reconnect.

*Sessions.* A session outlives its connection: on a drop it becomes DISCONNECTED with a
deadline ``now + grace_period_ms``. Reconnecting before the deadline (same name, any new
``consumer_id``) keeps the assignment with no rebalance; a :class:`Tick` at or after the
deadline evicts the session, deletes its node and rebalances. A new leader restores every
persisted session as DISCONNECTED with a *fresh* deadline (:meth:`restore`).

Session transitions (anything not listed changes nothing; see also layout events below):

    | session      | event                                   | next         | instructions                        |
    |--------------|-----------------------------------------|--------------|-------------------------------------|
    | none         | ConsumerRegistered                      | CONNECTED    | PersistSession, rebalance, Push all |
    | CONNECTED    | ConsumerRegistered (reconnect/new id)   | CONNECTED    | Push its current assignment         |
    | DISCONNECTED | ConsumerRegistered, now < deadline      | CONNECTED    | Push its current assignment         |
    | DISCONNECTED | ConsumerRegistered, now >= deadline     | CONNECTED    | evict, PersistSession, rebalance    |
    | CONNECTED    | ConsumerDisconnected (its id or None)   | DISCONNECTED | ScheduleTick(now + grace)           |
    | CONNECTED    | ConsumerDisconnected (stale id)         | CONNECTED    | none: an old connection's close     |
    | DISCONNECTED | ConsumerDisconnected                    | DISCONNECTED | none: the first deadline stands     |
    | DISCONNECTED | Tick, now >= deadline                   | none         | DeleteSession, rebalance            |
    | any          | ConsumerUnregistered (its id or None)   | none         | DeleteSession, rebalance            |
    | any          | ConsumerUnregistered (stale id)         | unchanged    | none: the consumer already rejoined |
    | none         | ConsumerDisconnected / Unregistered     | none         | none: late event for an evicted one |

    | layout event                               | effect                                         |
    |--------------------------------------------|------------------------------------------------|
    | LayoutChanged, epoch > current             | new layout, rebalance, Push to every CONNECTED |
    |                                            | consumer (changed or not), PollDrain if changed|
    | LayoutChanged, epoch <= current            | none: a stale or repeated watch event          |
    | SegmentDrained, sealed and not yet drained | retire it, rebalance, PollDrain                |
    | SegmentDrained, already drained or unknown | none (a pruned segment counts as drained)      |
    | SegmentDrained, ACTIVE segment             | NotAllowed raised, state unchanged             |

A rebalance pushes :class:`PushAssignment` to every CONNECTED consumer whose segment list
changed; a new layout epoch is pushed to every CONNECTED consumer, so a consumer whose last
assignment's epoch stays behind the DAG it watches knows its controller stopped serving it
and registers again. Example:

    >>> from anabranch.core.segment_layout import SegmentLayout
    >>> state, _ = SubscriptionAssignment.create("billing", SegmentLayout.initial(2, 0), 60_000)
    >>> state, out = state.handle(ConsumerRegistered("w1", now_ms=0, consumer_id=1))
    >>> out
    [PersistSession(subscription='billing', consumer='w1'), PushAssignment(consumer='w1', consumer_id=1, segments=(0, 1), epoch=0)]
    >>> state, out = state.handle(LayoutChanged(state.layout.split(0, now_ms=5)))
    >>> out  # w1 holds sealed 0, so it is carried 0's children 2 and 3 (see above)
    [PushAssignment(consumer='w1', consumer_id=1, segments=(0, 1, 2, 3), epoch=1), PollDrain(subscription='billing', segment_ids=(0,))]
    >>> state, out = state.handle(SegmentDrained(0))
    >>> out[0]
    PushAssignment(consumer='w1', consumer_id=1, segments=(2, 3, 1), epoch=1)
    >>> state, _ = state.handle(ConsumerRegistered("w2", now_ms=6, consumer_id=2))
    >>> state, _ = state.handle(LayoutChanged(state.layout.split(3, now_ms=7)))
    >>> dict(state.assignment)  # 3's children 4, 5 go to w2, which holds sealed 3
    {'w1': (2, 1), 'w2': (3, 4, 5)}
"""  # noqa: E501

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from anabranch.core.names import validate_component
from anabranch.core.segment_layout import Segment, SegmentLayout
from anabranch.errors import InvalidArgument, NotAllowed

# --- events ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConsumerRegistered:
    """A consumer subscribed (or re-subscribed) under ``name`` on connection ``consumer_id``."""

    name: str
    now_ms: int
    consumer_id: int | None = None


@dataclass(frozen=True, slots=True)
class ConsumerDisconnected:
    """The connection of ``name`` dropped; ``consumer_id`` None matches any connection."""

    name: str
    now_ms: int
    consumer_id: int | None = None


@dataclass(frozen=True, slots=True)
class ConsumerUnregistered:
    """``name`` closed its consumer on purpose; its session ends without a grace period."""

    name: str
    consumer_id: int | None = None


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed; sessions whose grace deadline is at or before ``now_ms`` are evicted."""

    now_ms: int


@dataclass(frozen=True, slots=True)
class LayoutChanged:
    """The topic's layout changed (a metadata watch or the controller's own CAS)."""

    layout: SegmentLayout


@dataclass(frozen=True, slots=True)
class SegmentDrained:
    """Sealed segment ``segment_id`` has no backlog left for this subscription."""

    segment_id: int


Event = (
    ConsumerRegistered
    | ConsumerDisconnected
    | ConsumerUnregistered
    | Tick
    | LayoutChanged
    | SegmentDrained
)

# --- instructions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PersistSession:
    """Create the durable session node ``.../subscriptions/{sub}/consumers/{consumer}``."""

    subscription: str
    consumer: str


@dataclass(frozen=True, slots=True)
class DeleteSession:
    """Delete the durable session node of ``consumer``."""

    subscription: str
    consumer: str


@dataclass(frozen=True, slots=True)
class PushAssignment:
    """Send ``segments`` (in deal order) to ``consumer`` on connection ``consumer_id``."""

    consumer: str
    consumer_id: int | None
    segments: tuple[int, ...]
    epoch: int


@dataclass(frozen=True, slots=True)
class PollDrain:
    """Watch the backlog of these sealed, undrained segments; report SegmentDrained at 0.

    Replaces any earlier PollDrain of the subscription (an empty tuple: stop polling).
    """

    subscription: str
    segment_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ScheduleTick:
    """Deliver a :class:`Tick` at (or after) ``at_ms``: a grace deadline is pending."""

    at_ms: int


Instruction = PersistSession | DeleteSession | PushAssignment | PollDrain | ScheduleTick

# --- state ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConsumerSession:
    """One consumer's session: CONNECTED (``deadline_ms`` None) or in its grace period."""

    name: str
    consumer_id: int | None
    deadline_ms: int | None = None

    @property
    def connected(self) -> bool:
        """Whether the consumer has a live connection."""
        return self.deadline_ms is None


@dataclass(frozen=True)
class SubscriptionAssignment:
    """The assignment state of one subscription; see the module docstring.

    Build with :meth:`create` (a live subscription) or :meth:`restore` (a new leader).
    """

    subscription: str
    layout: SegmentLayout
    grace_period_ms: int
    ordered: bool = True
    sessions: Mapping[str, ConsumerSession] = dataclasses.field(default_factory=dict)
    drained: frozenset[int] = frozenset()
    assignment: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    fan_out: bool = False
    """Consumers beyond the assignable segment count share segments (see the module doc)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sessions", MappingProxyType(dict(self.sessions)))
        object.__setattr__(self, "assignment", MappingProxyType(dict(self.assignment)))

    # --- construction -----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        subscription: str,
        layout: SegmentLayout,
        grace_period_ms: int,
        ordered: bool = True,
        *,
        fan_out: bool = False,
    ) -> tuple[SubscriptionAssignment, list[Instruction]]:
        """A subscription with no consumers yet; instructions say which drains to poll."""
        return cls.restore(
            subscription,
            layout,
            (),
            now_ms=0,
            grace_period_ms=grace_period_ms,
            ordered=ordered,
            fan_out=fan_out,
        )

    @classmethod
    def restore(
        cls,
        subscription: str,
        layout: SegmentLayout,
        consumer_names: Iterable[str],
        *,
        now_ms: int,
        grace_period_ms: int,
        ordered: bool = True,
        drained: Iterable[int] = (),
        fan_out: bool = False,
    ) -> tuple[SubscriptionAssignment, list[Instruction]]:
        """A new leader's state: every persisted session DISCONNECTED with a fresh deadline.

        Example:
            >>> from anabranch.core.segment_layout import SegmentLayout
            >>> s, out = SubscriptionAssignment.restore("s", SegmentLayout.initial(2, 0),
            ...                                         ["b", "a"], now_ms=100, grace_period_ms=50)
            >>> (dict(s.assignment), out)
            ({'a': (0,), 'b': (1,)}, [ScheduleTick(at_ms=150)])
        """
        validate_component("subscription", subscription)
        if not isinstance(grace_period_ms, int) or grace_period_ms < 0:
            raise InvalidArgument(f"grace period {grace_period_ms!r} ms is not a non-negative int")
        deadline = now_ms + grace_period_ms
        sessions = {}
        for name in consumer_names:
            validate_component("consumer", name)
            sessions[name] = ConsumerSession(name, None, deadline)
        sealed = {s.segment_id for s in layout.sealed_segments()}
        empty = cls(subscription, layout, grace_period_ms, ordered, fan_out=fan_out)
        state = dataclasses.replace(empty, sessions=sessions, drained=frozenset(drained) & sealed)
        state = dataclasses.replace(state, assignment=state._compute())
        out: list[Instruction] = []
        if sessions:
            out.append(ScheduleTick(deadline))
        if state.pending_drains():
            out.append(PollDrain(subscription, state.pending_drains()))
        return state, out

    # --- queries ------------------------------------------------------------------------

    def assignable_segments(self) -> tuple[Segment, ...]:
        """Segments that must be owned by a consumer, in deal order (range, then id)."""
        open_ = self._ancestors_drained()
        return tuple(
            s
            for s in sorted(
                self.layout.segments.values(),
                key=lambda s: (s.hash_range.start, s.hash_range.end, s.segment_id),
            )
            if s.segment_id not in self.drained and (not self.ordered or open_[s.segment_id])
        )

    def pending_drains(self) -> tuple[int, ...]:
        """Sealed segments not yet drained: the shell polls their backlog."""
        return tuple(
            sorted(
                s.segment_id
                for s in self.layout.sealed_segments()
                if s.segment_id not in self.drained
            )
        )

    def owner_of(self, segment_id: int) -> str | None:
        """The consumer that owns ``segment_id`` (None if unassigned; the first by name
        when several share it in fan-out mode)."""
        owners = self.owners_of(segment_id)
        return owners[0] if owners else None

    def owners_of(self, segment_id: int) -> tuple[str, ...]:
        """The consumers holding ``segment_id``, by name (several only in fan-out mode).

        Example:
            >>> from anabranch.core.segment_layout import SegmentLayout
            >>> s, _ = SubscriptionAssignment.restore("s", SegmentLayout.initial(1, 0),
            ...     ["a", "b", "c"], now_ms=0, grace_period_ms=10, fan_out=True)
            >>> s.owners_of(0)
            ('a', 'b', 'c')
        """
        return tuple(sorted(n for n, ids in self.assignment.items() if segment_id in ids))

    def next_deadline_ms(self) -> int | None:
        """The earliest grace deadline, or None when every session is connected."""
        deadlines = [s.deadline_ms for s in self.sessions.values() if s.deadline_ms is not None]
        return min(deadlines, default=None)

    def _ancestors_drained(self) -> dict[int, bool]:
        """segment id → whether every ancestor (transitively) is drained."""
        result: dict[int, bool] = {}
        # Parents are always created at an earlier epoch, so creation order is topological.
        for s in sorted(self.layout.segments.values(), key=lambda s: s.created_at_epoch):
            result[s.segment_id] = all(
                p not in self.layout.segments or (p in self.drained and result[p])
                for p in s.parent_ids
            )
        return result

    def _compute(self) -> dict[str, tuple[int, ...]]:
        names = sorted(self.sessions)
        dealt: dict[str, list[int]] = {name: [] for name in names}
        segments = self.assignable_segments()
        if names and segments and self.fan_out and len(names) > len(segments):
            for i, name in enumerate(names):
                dealt[name].append(segments[i % len(segments)].segment_id)
        elif names:
            for i, segment in enumerate(segments):
                dealt[names[i % len(names)]].append(segment.segment_id)
            if self.ordered and not self.fan_out:  # fan-out: individual acks, no vector
                self._carry(dealt)
        return {name: tuple(ids) for name, ids in dealt.items()}

    def _carry(self, dealt: dict[str, list[int]]) -> None:
        """Add to ``dealt`` the carried segments (module docstring), parents first."""
        owner = {segment_id: name for name, ids in dealt.items() for segment_id in ids}
        for segment in sorted(
            self.layout.segments.values(), key=lambda s: (s.created_at_epoch, s.segment_id)
        ):
            segment_id = segment.segment_id
            if segment_id in owner or segment_id in self.drained:
                continue
            holders = {owner.get(a) for a in self.layout.ancestors(segment_id) - self.drained}
            name = holders.pop() if len(holders) == 1 else None
            if name is not None:
                dealt[name].append(segment_id)
                owner[segment_id] = name

    # --- transitions ----------------------------------------------------------------------

    def handle(self, event: Event) -> tuple[SubscriptionAssignment, list[Instruction]]:
        """Apply one event; return the new state and the instructions for the shell."""
        match event:
            case ConsumerRegistered():
                return self._on_registered(event)
            case ConsumerDisconnected():
                return self._on_disconnected(event)
            case ConsumerUnregistered():
                return self._on_unregistered(event)
            case Tick():
                return self._on_tick(event)
            case LayoutChanged():
                return self._on_layout(event)
            case SegmentDrained():
                return self._on_drained(event)
        raise InvalidArgument(f"unknown assignment event {event!r}")

    def _on_registered(
        self, event: ConsumerRegistered
    ) -> tuple[SubscriptionAssignment, list[Instruction]]:
        validate_component("consumer", event.name)
        # Deadlines due by now are applied first, even if their Tick has not arrived yet:
        # a consumer that comes back after its deadline is a newcomer, not a reconnect.
        expired = self._expired(event.now_ms)
        session = ConsumerSession(event.name, event.consumer_id)
        if event.name in self.sessions and not expired:
            # A reconnect: same share, no rebalance; only this consumer hears about it.
            state = dataclasses.replace(self, sessions={**self.sessions, event.name: session})
            return state, [self._push(session, state.assignment[event.name])]
        remaining = {k: v for k, v in self.sessions.items() if k not in expired}
        out: list[Instruction] = [DeleteSession(self.subscription, n) for n in expired]
        if event.name not in remaining:
            out.append(PersistSession(self.subscription, event.name))
        state, pushes = self._rebalanced(sessions={**remaining, event.name: session})
        if not any(isinstance(p, PushAssignment) and p.consumer == event.name for p in pushes):
            # A new connection always needs an answer, even with an unchanged or empty share.
            pushes.append(state._push(session, state.assignment[event.name]))
        return state, out + pushes

    def _on_disconnected(
        self, event: ConsumerDisconnected
    ) -> tuple[SubscriptionAssignment, list[Instruction]]:
        session = self.sessions.get(event.name)
        if session is None or not session.connected or _stale(session, event.consumer_id):
            return self, []
        deadline = event.now_ms + self.grace_period_ms
        sessions = {**self.sessions, event.name: dataclasses.replace(session, deadline_ms=deadline)}
        return dataclasses.replace(self, sessions=sessions), [ScheduleTick(deadline)]

    def _on_unregistered(
        self, event: ConsumerUnregistered
    ) -> tuple[SubscriptionAssignment, list[Instruction]]:
        session = self.sessions.get(event.name)
        if session is None or _stale(session, event.consumer_id):
            return self, []
        sessions = {k: v for k, v in self.sessions.items() if k != event.name}
        state, pushes = self._rebalanced(sessions=sessions)
        return state, [DeleteSession(self.subscription, event.name), *pushes]

    def _expired(self, now_ms: int) -> list[str]:
        return sorted(
            name
            for name, s in self.sessions.items()
            if s.deadline_ms is not None and s.deadline_ms <= now_ms
        )

    def _on_tick(self, event: Tick) -> tuple[SubscriptionAssignment, list[Instruction]]:
        expired = self._expired(event.now_ms)
        if not expired:
            return self, []
        sessions = {k: v for k, v in self.sessions.items() if k not in expired}
        state, pushes = self._rebalanced(sessions=sessions)
        out: list[Instruction] = [DeleteSession(self.subscription, name) for name in expired]
        return state, out + pushes

    def _on_layout(self, event: LayoutChanged) -> tuple[SubscriptionAssignment, list[Instruction]]:
        if event.layout.epoch <= self.layout.epoch:
            return self, []
        # Forget drains of segments that were pruned: they count as drained by absence.
        drained = frozenset(i for i in self.drained if i in event.layout.segments)
        state, out = self._rebalanced(layout=event.layout, drained=drained)
        # Every connected consumer hears of the new epoch, its share changed or not: an
        # assignment whose epoch stays behind the DAG it watches is how a consumer tells
        # that this controller stopped serving it (a paused or deposed leader).
        told = {i.consumer for i in out if isinstance(i, PushAssignment)}
        news: list[Instruction] = [
            state._push(session, state.assignment[name])
            for name, session in sorted(state.sessions.items())
            if session.connected and name not in told
        ]
        pushes = [i for i in out if isinstance(i, PushAssignment)]
        return state, [*pushes, *news, *(i for i in out if not isinstance(i, PushAssignment))]

    def _on_drained(
        self, event: SegmentDrained
    ) -> tuple[SubscriptionAssignment, list[Instruction]]:
        segment = self.layout.segments.get(event.segment_id)
        if segment is None or event.segment_id in self.drained:
            return self, []
        if segment.is_active:
            raise NotAllowed(
                f"segment {event.segment_id} is ACTIVE in epoch {self.layout.epoch}: "
                "only a sealed segment can be drained"
            )
        return self._rebalanced(drained=self.drained | {event.segment_id})

    # --- helpers --------------------------------------------------------------------------

    def _rebalanced(
        self,
        *,
        sessions: Mapping[str, ConsumerSession] | None = None,
        layout: SegmentLayout | None = None,
        drained: frozenset[int] | None = None,
    ) -> tuple[SubscriptionAssignment, list[Instruction]]:
        """Recompute the assignment after a change; push only what changed."""
        state = dataclasses.replace(
            self,
            sessions=self.sessions if sessions is None else sessions,
            layout=self.layout if layout is None else layout,
            drained=self.drained if drained is None else drained,
        )
        state = dataclasses.replace(state, assignment=state._compute())
        out: list[Instruction] = []
        for name, segments in state.assignment.items():
            session = state.sessions[name]
            if session.connected and self.assignment.get(name) != segments:
                out.append(state._push(session, segments))
        if state.pending_drains() != self.pending_drains():
            out.append(PollDrain(self.subscription, state.pending_drains()))
        return state, out

    def _push(self, session: ConsumerSession, segments: tuple[int, ...]) -> PushAssignment:
        return PushAssignment(session.name, session.consumer_id, segments, self.layout.epoch)

    # --- invariants -----------------------------------------------------------------------

    def validate(self) -> None:
        """Check the invariants; raise InvalidArgument naming the first broken one.

        - the layout is valid; drained segments are sealed segments of the layout;
        - each session is stored under its name; ``grace_period_ms`` is non-negative;
        - the assignment has one entry per session, and (with any session) every
          assignable segment is assigned to exactly one session (fan-out with more
          sessions than segments: to at least one, and each session holds exactly one),
          nothing else is;
        - no retired segment is assigned; (ordered) a segment with undrained ancestors
          only to the one consumer that holds all of them (carried); no hash is in two
          assignable segments (ordered);
        - the assignment equals the deterministic deal (what a new leader would compute).
        """
        self.layout.validate()
        _check(self.grace_period_ms >= 0, f"grace period {self.grace_period_ms} is negative")
        for segment_id in self.drained:
            segment = self.layout.segments.get(segment_id)
            _check(
                segment is not None and not segment.is_active,
                f"drained segment {segment_id} is not a sealed segment of the layout",
            )
        for name, session in self.sessions.items():
            _check(session.name == name, f"session {session.name!r} stored under {name!r}")
        _check(
            set(self.assignment) == set(self.sessions),
            f"assignment names {sorted(self.assignment)} != sessions {sorted(self.sessions)}",
        )
        assigned = [i for ids in self.assignment.values() for i in ids]
        assignable = self.assignable_segments()
        if self.fan_out and len(self.sessions) > len(assignable) > 0:
            _check(
                all(len(ids) == 1 for ids in self.assignment.values()),
                f"a fan-out consumer holds other than one segment: {dict(self.assignment)}",
            )
        else:
            _check(len(assigned) == len(set(assigned)), f"a segment is assigned twice: {assigned}")
        expected = {s.segment_id for s in assignable} if self.sessions else set()
        _check(
            expected <= set(assigned),
            f"assigned {sorted(assigned)} but assignable {sorted(expected)}",
        )
        for segment_id in set(assigned):
            undrained = self.layout.ancestors(segment_id) - self.drained
            holders = set(self.owners_of(segment_id))
            _check(segment_id not in self.drained, f"retired segment {segment_id} is assigned")
            carried = (
                self.ordered
                and bool(undrained)
                and len(holders) == 1
                and all(set(self.owners_of(a)) == holders for a in undrained)
            )
            _check(
                segment_id in expected or carried,
                f"segment {segment_id} is assigned before ancestors "
                f"{sorted(undrained)} are drained, and not with them",
            )
        if self.ordered:
            self._validate_one_generation_per_hash(assignable)
        _check(self.assignment == self._compute(), "assignment is not the deterministic deal")

    def _validate_one_generation_per_hash(self, assignable: tuple[Segment, ...]) -> None:
        # Assignable ranges never overlap: a hash is never open in two generations. (A gap
        # is legal: a merge child waits for both parents, so a drained parent's keys pause.)
        next_free = 0
        for segment in sorted(assignable, key=lambda s: s.hash_range.start):
            _check(
                segment.hash_range.start >= next_free,
                f"hash {segment.hash_range.start:#06x} is open in two generations",
            )
            next_free = segment.hash_range.end + 1


def _stale(session: ConsumerSession, consumer_id: int | None) -> bool:
    """Whether an event from connection ``consumer_id`` is older than the session's own."""
    return (
        consumer_id is not None
        and session.consumer_id is not None
        and consumer_id != session.consumer_id
    )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgument(f"invalid assignment state: {message}")

"""The async shell around :class:`~anabranch.core.assignment.SubscriptionAssignment`.

One :class:`SubscriptionCoordinator` per subscription of a scalable topic, owned by the
controller leader. Events (a consumer registers, drops, leaves; the layout changes; a
sealed segment drains; a grace deadline passes) go through :meth:`handle` one at a time;
the pure state machine returns instructions, which this shell performs:

    | instruction     | performed as                                                    |
    |-----------------|-----------------------------------------------------------------|
    | PersistSession  | fenced put of ``.../subscriptions/{sub}/consumers/{name}``       |
    | DeleteSession   | fenced delete of that node                                      |
    | PushAssignment  | the ``on_assignment`` callback (the broker writes it to the wire)|
    | PollDrain       | a poller reads those segments' backlog every poll interval (at   |
    |                 | once on :meth:`wake`: the segment's broker saw an ack drain it)  |
    |                 | and feeds ``SegmentDrained`` when it reaches 0                    |
    | ScheduleTick    | one timer armed at the earliest grace deadline feeds ``Tick``     |

Time is the injected clock's monotonic milliseconds, so a test's ``ManualClock`` drives
grace periods and polls. Metadata writes go through the controller's fenced ``commit``:
a deposed leader cannot persist or delete sessions.

Example (as the controller builds one, on a memory store; the push is printed):
    >>> from anabranch.core.assignment import ConsumerRegistered
    >>> from anabranch.core.names import TopicName
    >>> from anabranch.core.segment_layout import SegmentLayout
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.testing.clock import ManualClock
    >>> async def demo(coordinator: SubscriptionCoordinator) -> None:
    ...     await coordinator.handle(ConsumerRegistered("w1", coordinator.now_ms(), 7))
    >>> async def backlog(segment_id: int, subscription: str) -> int:
    ...     return 0
    >>> async def main() -> None:
    ...     store = MemoryMetadataStore()
    ...     paths = TopicPaths(TopicName.parse("topic://public/default/orders"))
    ...     layout = SegmentLayout.initial(2, now_ms=0)
    ...     state, first = SubscriptionAssignment.create("billing", layout, grace_period_ms=30_000)
    ...     coordinator = SubscriptionCoordinator(
    ...         state, paths=paths, commit=store.commit, backlog=backlog, clock=ManualClock(),
    ...         on_assignment=lambda sub, push: print(sub, push), drain_poll_interval_s=1.0)
    ...     await coordinator.start(first)
    ...     await demo(coordinator)
    ...     print(await store.list_children(paths.consumers("billing")))  # its session
    ...     await coordinator.close()
    ...     await store.close()
    >>> asyncio.run(main())
    billing PushAssignment(consumer='w1', consumer_id=7, segments=(0, 1), epoch=0)
    ['w1']
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Sequence

from anabranch.clock import Clock
from anabranch.core.assignment import (
    DeleteSession,
    Event,
    Instruction,
    PersistSession,
    PollDrain,
    PushAssignment,
    ScheduleTick,
    SegmentDrained,
    SubscriptionAssignment,
    Tick,
)
from anabranch.errors import MetadataUnavailable
from anabranch.metadata.api import CommitResult, Delete, Op, Put
from anabranch.scalable.paths import TopicPaths

log = logging.getLogger(__name__)

AssignmentListener = Callable[[str, PushAssignment], None]
"""``(subscription, push)``: deliver an assignment to a connected consumer."""

Committer = Callable[[Sequence[Op]], Awaitable[CommitResult]]
BacklogReader = Callable[[int, str], Awaitable[int]]
"""``(segment_id, subscription) -> backlog``."""


class SubscriptionCoordinator:
    """Performs one subscription's assignment instructions (see the module docstring)."""

    def __init__(
        self,
        state: SubscriptionAssignment,
        *,
        paths: TopicPaths,
        commit: Committer,
        backlog: BacklogReader,
        clock: Clock,
        on_assignment: AssignmentListener,
        drain_poll_interval_s: float,
    ) -> None:
        self.state = state
        self._paths = paths
        self._commit = commit
        self._backlog = backlog
        self._clock = clock
        self._on_assignment = on_assignment
        self._poll_interval_s = drain_poll_interval_s
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None
        self._timer_at_ms: int | None = None
        self._poller: asyncio.Task[None] | None = None
        self._pending_drains: tuple[int, ...] = ()
        self._wake = asyncio.Event()
        self._closed = False

    @property
    def subscription(self) -> str:
        return self.state.subscription

    def now_ms(self) -> int:
        """The coordinator's notion of now: monotonic milliseconds of the injected clock."""
        return int(self._clock.monotonic() * 1000)

    async def start(self, instructions: list[Instruction]) -> None:
        """Perform the instructions the state was created or restored with."""
        async with self._lock:
            await self._perform(instructions)

    async def handle(self, event: Event) -> list[Instruction]:
        """Apply one event and perform what it asks; returns the instructions performed."""
        async with self._lock:
            if self._closed:
                return []
            self.state, instructions = self.state.handle(event)
            await self._perform(instructions)
            return instructions

    async def set_fan_out(self, fan_out: bool) -> None:
        """Switch the Key_Shared dispatch mode of a subscription with no sessions."""
        async with self._lock:
            if not self.state.sessions:
                self.state = dataclasses.replace(self.state, fan_out=fan_out)

    async def _perform(self, instructions: list[Instruction]) -> None:
        for instruction in instructions:
            match instruction:
                case PersistSession(subscription, consumer):
                    value = json.dumps({"registeredAtMs": self._clock.wall_ms()}).encode()
                    await self._commit([Put(self._paths.consumer(subscription, consumer), value)])
                case DeleteSession(subscription, consumer):
                    await self._commit([Delete(self._paths.consumer(subscription, consumer))])
                case PushAssignment():
                    try:
                        self._on_assignment(self.subscription, instruction)
                    except Exception:
                        # A broken connection must not stop the other consumers' pushes.
                        log.exception("pushing an assignment of %s failed", self.subscription)
                case PollDrain(_, segment_ids):
                    # Unordered (checkpoint) subscriptions have no cursors to drain: their
                    # sealed segments stay assigned, the readers order them themselves.
                    self._set_drains(segment_ids if self.state.ordered else ())
                case ScheduleTick():
                    pass  # the timer below always follows the state's earliest deadline
        self._arm_timer()

    # --- grace-period timer -----------------------------------------------------------------

    def _arm_timer(self) -> None:
        deadline = self.state.next_deadline_ms()
        # The firing timer itself calls this (through handle): it is finishing, not armed.
        timer = self._timer
        alive = timer is not None and not timer.done() and timer is not asyncio.current_task()
        if alive and deadline == self._timer_at_ms:
            return
        if alive and timer is not None:
            timer.cancel()
        self._timer, self._timer_at_ms = None, deadline
        if deadline is not None and not self._closed:
            self._timer = asyncio.create_task(self._fire_at(deadline))

    async def _fire_at(self, deadline_ms: int) -> None:
        await self._clock.sleep(max(0, deadline_ms - self.now_ms()) / 1000)
        try:
            await self.handle(Tick(self.now_ms()))
        except Exception:
            log.exception("grace-period tick of %s failed", self.subscription)

    # --- drain polling ----------------------------------------------------------------------

    def _set_drains(self, segment_ids: tuple[int, ...]) -> None:
        self._pending_drains = segment_ids
        if segment_ids and (self._poller is None or self._poller.done()) and not self._closed:
            self._poller = asyncio.create_task(self._poll_drains())

    def wake(self) -> None:
        """Poll the pending drains now (a segment's owner saw its backlog reach 0)."""
        self._wake.set()

    async def _poll_drains(self) -> None:
        while self._pending_drains and not self._closed:
            self._wake.clear()
            polled = self._pending_drains
            for segment_id in polled:
                try:
                    backlog = await self._backlog(segment_id, self.subscription)
                    if backlog == 0:
                        await self.handle(SegmentDrained(segment_id))
                except MetadataUnavailable as err:
                    # The store or the segment's owner out of reach for a moment: the
                    # next poll asks again; no traceback per poll.
                    log.warning("drain poll of segment %d deferred: %s", segment_id, err)
                except Exception:
                    log.exception("drain poll of segment %d failed", segment_id)
            if self._pending_drains and self._pending_drains == polled:
                # Nothing moved: wait for the poll interval or a wake-up (the segment's
                # broker saw the drain). When something did, the segments it made pending
                # are polled at once: they are often drained already.
                await self._sleep_or_wake()

    async def _sleep_or_wake(self) -> None:
        sleep = asyncio.ensure_future(self._clock.sleep(self._poll_interval_s))
        woke = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({sleep, woke}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleep, woke):
                task.cancel()

    async def close(self) -> None:
        """Stop the timer and the poller; later events are ignored. Idempotent."""
        self._closed = True
        tasks = [t for t in (self._timer, self._poller) if t is not None]
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        for task in tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


__all__ = ["AssignmentListener", "ScheduleTick", "SubscriptionCoordinator"]

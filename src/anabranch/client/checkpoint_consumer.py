"""The checkpoint consumer: an unmanaged reader over a scalable topic's whole segment DAG.

Theory of operation
-------------------
Nothing is stored on the broker: the application owns the position, a
:class:`~anabranch.client.checkpoint.Checkpoint` it takes with :meth:`checkpoint` and passes
back as ``start`` to resume (after a restart, on another machine, after splits and merges).

- Per segment, one non-durable exclusive reader (a plain ``Consumer`` with
  ``durable=False``), started just after the segment's position.
- **Parent-before-child**: a segment is opened only once every ancestor is *complete* --
  the broker reported the end of the sealed segment (REACHED_END_OF_TOPIC) and the
  application received every message of it. Readers of different open segments feed one
  inbox, so keys of different ranges interleave, but one key's messages arrive in order
  across splits and merges, exactly once.
- A background task follows the DAG session and opens segments as they become readable
  (new children, or children of a segment that just completed); complete readers close.
- ``Checkpoint.latest()`` resolves when the consumer starts: sealed segments count as
  complete and each active segment's current last message (GET_LAST_MESSAGE_ID) becomes
  its position; anything at or before it is skipped.

**Consumer group** (optional, ``consumer_group=name``): the member registers with the
topic's controller as a CHECKPOINT consumer (no cursors are created) and reads only the
segments the controller deals it, following reassignments. Parent-before-child then
holds within each member's own segments only: a child whose parent belongs to another
member is read at once. A member's checkpoint holds its own progress and the start
position of every other segment; :meth:`Checkpoint.merge` of all members' checkpoints is
the group's position, which a restarted group resumes from. A segment that moves between
members is read again from the new owner's position (at-least-once across rebalances).

:meth:`checkpoint` is a snapshot: the layout epoch the consumer follows and, for every
segment of that layout, *complete*, the id of the last message handed to the application,
or its start position if nothing was read yet.

Example (with a client)::

    reader = await client.create_checkpoint_consumer(topic, start=Checkpoint.earliest())
    msg = await reader.receive(timeout=1.0)
    saved = reader.checkpoint().to_bytes()
    await reader.close()
    reader = await client.create_checkpoint_consumer(topic, start=Checkpoint.from_bytes(saved))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from anabranch.client.checkpoint import Checkpoint, SegmentPosition, readable_segments
from anabranch.client.connection import ConnectionPool
from anabranch.client.consumer import ConsumerOptions, InitialPosition
from anabranch.client.controller_registration import ControllerRegistration
from anabranch.client.dag_session import DagSession
from anabranch.client.message import Message
from anabranch.client.message_id import MessageId
from anabranch.client.queue_consumer import LayoutSource, SegmentConsumer, in_segment
from anabranch.client.segment_consumers import CountingInbox, close_all, stop_task, wake_or_change
from anabranch.core.segment_layout import Segment, SegmentLayout, segment_name
from anabranch.errors import AnabranchError, Closed, InvalidArgument
from anabranch.limits import CONSUMER_RECEIVER_QUEUE_MESSAGES
from anabranch.protocol._generated import pulsar_api_pb2 as pb

log = logging.getLogger(__name__)

OPEN_RETRY_S = 0.5
"""Pause before retrying to open segments after a failure (e.g. a broker restarting)."""


class CheckpointConsumer:
    """Reads every segment of a scalable topic in DAG order (see the module docstring)."""

    def __init__(
        self,
        pool: ConnectionPool,
        source: LayoutSource,
        start: Checkpoint,
        *,
        consumer_name: str | None = None,
        receiver_queue_size: int = CONSUMER_RECEIVER_QUEUE_MESSAGES,
        consumer_group: str | None = None,
    ) -> None:
        self._pool = pool
        self._source = source
        self.topic = str(source.topic)
        self.start = start
        self.consumer_name = consumer_name or f"checkpoint-{uuid.uuid4().hex[:10]}"
        self._receiver_queue_size = receiver_queue_size
        self._inbox = CountingInbox()
        self._layout: SegmentLayout = source.layout
        self._positions: dict[int, SegmentPosition | None] = {}
        self._readers: dict[int, SegmentConsumer] = {}
        self._by_consumer_id: dict[int, SegmentConsumer] = {}
        self._pump: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._closed = False
        self.consumer_group = consumer_group
        self._assigned: frozenset[int] | None = None
        self._registration: ControllerRegistration | None = None
        if consumer_group is not None:
            if not isinstance(source, DagSession):
                raise InvalidArgument("a consumer group needs a DAG session (its controller)")
            self._registration = ControllerRegistration(
                pool, source, consumer_group, self.consumer_name, pb.CHECKPOINT, self._on_assignment
            )

    def __repr__(self) -> str:
        return f"CheckpointConsumer({self.topic!r})"

    @property
    def open_segments(self) -> list[int]:
        """Ids of the segments being read now."""
        return sorted(self._readers)

    @property
    def assigned_segments(self) -> list[int] | None:
        """In a consumer group, the segments the controller gave this member; else None."""
        return None if self._assigned is None else sorted(self._assigned)

    @property
    def complete_segments(self) -> list[int]:
        """Ids of the segments read to their end."""
        return sorted(s for s, p in self._positions.items() if p is not None and p.complete)

    # --- segments --------------------------------------------------------------------------

    async def _start(self) -> None:
        try:
            if self._registration is not None:
                await self._registration.start()
            async with self._lock:
                layout = self._source.layout
                self._adopt(layout, self.start.start_positions(layout))
                await self._open_ready()
        except BaseException:
            await self.close()
            raise
        self._pump = asyncio.get_running_loop().create_task(self._run())

    def _adopt(self, layout: SegmentLayout, starts: dict[int, SegmentPosition | None]) -> None:
        """Follow ``layout``: new segments start as ``starts`` says (else earliest)."""
        self._layout = layout
        for seg in layout:
            if seg.segment_id not in self._positions:
                self._positions[seg.segment_id] = starts.get(
                    seg.segment_id, SegmentPosition.start()
                )
        for seg_id in [s for s in self._positions if s not in layout.segments]:
            del self._positions[seg_id]  # pruned from the DAG: nothing left to read

    def _complete(self) -> set[int]:
        return {s for s, p in self._positions.items() if p is not None and p.complete}

    def _on_assignment(self, assignment: pb.ScalableConsumerAssignment) -> None:
        self._assigned = frozenset(int(s.segment_id) for s in assignment.segments)
        self._wake.set()

    def _mine(self, segment_id: int) -> bool:
        return segment_id in self._layout.segments and (
            self._assigned is None or segment_id in self._assigned
        )

    async def _open_ready(self) -> None:
        gate = self._complete()
        if self._assigned is not None:
            # Another member's segments are its own business: do not wait for them.
            gate |= {s for s in self._layout.segments if s not in self._assigned}
        ready = [
            seg
            for seg in readable_segments(self._layout, gate, opened=self._readers)
            if self._mine(seg.segment_id)
        ]
        if ready:
            await asyncio.gather(*(self._open(seg) for seg in ready))
        for seg_id in [s for s in self._readers if not self._mine(s)]:
            await self._close_reader(seg_id)

    async def _open(self, seg: Segment) -> None:
        position = self._positions[seg.segment_id]
        latest = position is None
        if latest:
            start, inclusive = MessageId.latest(), False
        else:
            assert position is not None
            start, inclusive = _reader_start(position.after)
        options = ConsumerOptions(
            consumer_name=self.consumer_name,
            initial_position=InitialPosition.EARLIEST,
            receiver_queue_size=self._receiver_queue_size,
        )
        reader = SegmentConsumer(
            seg.segment_id,
            self._on_segment_end,
            self._pool,
            str(segment_name(self._source.topic, seg)),
            f"{self.consumer_name}-{seg.segment_id}",
            options,
            inbox=self._inbox,
            durable=False,
            start_message_id=start,
            start_inclusive=inclusive,
        )
        self._readers[seg.segment_id] = reader
        self._by_consumer_id[reader._id] = reader
        try:
            await reader._start()
            if latest:
                last, _ = await reader.drain_state()
                self._positions[seg.segment_id] = SegmentPosition.after_id(last)
        except BaseException:
            self._readers.pop(seg.segment_id, None)
            self._by_consumer_id.pop(reader._id, None)
            with contextlib.suppress(AnabranchError):
                await reader.close()
            raise

    async def _close_reader(self, seg_id: int) -> None:
        reader = self._readers.pop(seg_id, None)
        if reader is not None:
            self._by_consumer_id.pop(reader._id, None)
            gone = reader._id
            self._inbox.remove_where(lambda m: m._consumer_id == gone)
            with contextlib.suppress(AnabranchError):
                await reader.close()

    def _on_segment_end(self, reader: SegmentConsumer) -> None:
        self._wake.set()

    def _finish_drained(self) -> list[int]:
        """Mark open segments complete whose end was reported and fully received."""
        done = []
        for seg_id, reader in self._readers.items():
            if reader.reached_end_of_topic and not self._inbox.queued(reader._id):
                self._positions[seg_id] = SegmentPosition.done()
                done.append(seg_id)
        return done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        change: asyncio.Task[SegmentLayout] | None = None
        retry_s: float | None = None
        try:
            while not self._closed:
                if change is None:
                    change = loop.create_task(self._source.wait_for_change(self._layout.epoch))
                await wake_or_change(change, self._wake, retry_s)
                async with self._lock:
                    if change.done():
                        finished, change = change, None
                        self._adopt(finished.result(), {})  # Closed ends the pump
                    for seg_id in self._finish_drained():
                        await self._close_reader(seg_id)
                    try:
                        await self._open_ready()
                        retry_s = None
                    except AnabranchError as err:
                        log.warning("%s: opening segments failed (retrying): %s", self, err)
                        retry_s = OPEN_RETRY_S
        except (Closed, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("%s: DAG follower failed", self)
        finally:
            if change is not None:
                change.cancel()

    # --- reading ---------------------------------------------------------------------------

    async def receive(self, timeout: float | None = None) -> Message | None:  # noqa: ASYNC109 (fixed API)
        """The next message in DAG order, or None after ``timeout`` seconds."""
        if self._closed:
            raise Closed(f"{self} is closed")
        deadline = self._inbox.deadline(timeout)
        while (got := await self._inbox.get_owned(deadline, self._by_consumer_id)) is not None:
            raw, reader = got
            reader._on_dequeued(raw)
            if reader.reached_end_of_topic and not self._inbox.queued(reader._id):
                self._wake.set()  # the segment may be complete: open its children
            position = self._positions.get(reader.segment_id)
            if position is None or not position.admits(raw.message_id):
                continue  # before the start (a resumed batch, or a just-resolved latest)
            self._positions[reader.segment_id] = SegmentPosition.after_id(raw.message_id)
            return in_segment(raw, reader.segment_id, self.topic)
        return None

    async def seek(self, position: Checkpoint) -> None:
        """Read from ``position`` next: every reader restarts there; what is queued and not
        yet received is dropped.

        Example::

            await reader.seek(Checkpoint.earliest())     # replay the whole DAG
        """
        if self._closed:
            raise Closed(f"{self} is closed")
        async with self._lock:
            for seg_id in list(self._readers):
                await self._close_reader(seg_id)
            self.start = position
            self._positions.clear()
            layout = self._source.layout
            self._adopt(layout, position.start_positions(layout))
            await self._open_ready()

    def checkpoint(self) -> Checkpoint:
        """Where this consumer is now (see the module docstring); never blocks."""
        positions = {
            seg: SegmentPosition.start() if pos is None else pos
            for seg, pos in self._positions.items()
        }
        return Checkpoint.of(self._layout.epoch, positions)

    async def close(self) -> None:
        """Close every reader and the DAG session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._inbox.shutdown()
        if self._registration is not None:
            await self._registration.close()
        pump, self._pump = self._pump, None
        await stop_task(pump)
        await close_all(self._readers, self._by_consumer_id)
        await self._source.close()


def _reader_start(after: MessageId) -> tuple[MessageId, bool]:
    """(start id, inclusive) so that the broker sends everything after ``after``.

    Inside a batch the whole entry comes again (the consumer skips what was read); an
    ``after`` without a stored entry (earliest, or an empty ledger) reads from the start.

    Example:
        >>> _reader_start(MessageId(4, 7, 2))
        (MessageId(ledger_id=4, entry_id=7, batch_index=-1, partition=-1, segment_id=None), True)
    """
    if after.ledger_id < 0 or after.entry_id < 0:
        return MessageId.earliest(), False
    if after.batch_index >= 0:
        return MessageId(after.ledger_id, after.entry_id), True
    return MessageId(after.ledger_id, after.entry_id), False

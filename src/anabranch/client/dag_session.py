"""Client side of a scalable topic's DAG watch (commands 70-72).

Theory of operation
-------------------
A :class:`DagSession` sends ``SCALABLE_TOPIC_LOOKUP{session_id, topic, create_if_missing}``
on a connection to the service URL (any broker serves a watch) and waits for the first
``SCALABLE_TOPIC_UPDATE``: an error there (bad name, missing topic with auto-creation off)
fails :meth:`DagSession.open`. Later updates carry the full DAG after every layout change;
the session keeps the newest one (an update with a lower epoch than the one held is
ignored) and wakes everyone waiting in :meth:`DagSession.wait_for_change`.

When the connection drops, the broker forgets the session; the client reconnects with
backoff and opens a *new* session (a fresh session id), whose first update replaces the
layout. While reconnecting, :attr:`DagSession.layout` is the last one received, which is
what producers and consumers keep using (a stale layout only costs a retry: a sealed
segment answers ``TopicTerminated``).

The session satisfies the ``LayoutSource`` protocol the queue and checkpoint consumers
take (``topic``, ``layout``, ``wait_for_change``, ``close``) and also exposes the DAG's
``controller_url`` (where stream consumers register) and ``segment_brokers``.

Example (with a client)::

    session = await DagSession.open(pool, scalable_topic_name("topic://public/default/o"))
    print(session.layout.epoch, [s.segment_id for s in session.layout.active_segments()])
    layout = await session.wait_for_change(session.layout.epoch)   # the next split/merge
    await session.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from anabranch.client._reconnect import TERMINAL_ERRORS
from anabranch.client.backoff import Backoff
from anabranch.client.connection import ClientConnection, ConnectionPool
from anabranch.client.errors import ConnectionClosed, OperationTimeout, from_server_error
from anabranch.core.hash_range import HashRange
from anabranch.core.names import TopicDomain, TopicName, parse_name
from anabranch.core.segment_layout import NOT_SEALED, Segment, SegmentLayout, SegmentState
from anabranch.errors import AnabranchError, Closed, InvalidArgument
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame

log = logging.getLogger(__name__)
T = pb.BaseCommand

_SCHEME = "topic://"


def scalable_topic_name(text: str) -> TopicName:
    """The ``topic://`` name meant by ``text``: full names, ``topic://x`` and bare short
    names (``x``, ``t/ns/x``) all mean a scalable topic; other domains are refused.

    Example:
        >>> str(scalable_topic_name("topic://orders")), str(scalable_topic_name("t/ns/x"))
        ('topic://public/default/orders', 'topic://t/ns/x')
        >>> scalable_topic_name("persistent://public/default/x")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        anabranch.errors.InvalidArgument: 'persistent://public/default/x' is not a scalable ...
    """
    if isinstance(text, str) and text.startswith(_SCHEME) and "/" not in text[len(_SCHEME) :]:
        text = f"{_SCHEME}public/default/{text[len(_SCHEME) :]}"
    name = parse_name(text, TopicDomain.TOPIC)
    if not isinstance(name, TopicName) or name.domain is not TopicDomain.TOPIC:
        raise InvalidArgument(f"{text!r} is not a scalable topic:// name")
    return name


def is_scalable_name(text: str) -> bool:
    """Whether a name given to ``create_producer`` means a scalable topic.

    Example:
        >>> is_scalable_name("topic://orders"), is_scalable_name("orders")
        (True, False)
    """
    return isinstance(text, str) and text.startswith(_SCHEME)


def layout_from_dag(dag: pb.ScalableTopicDAG) -> SegmentLayout:
    """The :class:`SegmentLayout` of a wire DAG (links to pruned segments are kept as sent).

    Example:
        >>> dag = pb.ScalableTopicDAG(epoch=1)
        >>> _ = dag.segments.add(segment_id=0, hash_start=0, hash_end=0xFFFF, state=pb.SEALED,
        ...                      child_ids=[1, 2], created_at_epoch=0, created_at_ms=0,
        ...                      sealed_at_epoch=1, sealed_at_ms=5)
        >>> _ = dag.segments.add(segment_id=1, hash_start=0, hash_end=0x7FFF, state=pb.ACTIVE,
        ...                      parent_ids=[0], created_at_epoch=1, created_at_ms=5)
        >>> _ = dag.segments.add(segment_id=2, hash_start=0x8000, hash_end=0xFFFF,
        ...                      state=pb.ACTIVE, parent_ids=[0], created_at_epoch=1,
        ...                      created_at_ms=5)
        >>> layout = layout_from_dag(dag)
        >>> (layout.epoch, layout.next_segment_id, layout.find_active(0x9000).segment_id)
        (1, 3, 2)
    """
    segments: dict[int, Segment] = {}
    for info in dag.segments:
        sealed = info.state == pb.SEALED
        segments[int(info.segment_id)] = Segment(
            segment_id=int(info.segment_id),
            hash_range=HashRange(int(info.hash_start), int(info.hash_end)),
            state=SegmentState.SEALED if sealed else SegmentState.ACTIVE,
            parent_ids=tuple(int(i) for i in info.parent_ids),
            child_ids=tuple(int(i) for i in info.child_ids),
            created_at_epoch=int(info.created_at_epoch),
            sealed_at_epoch=int(info.sealed_at_epoch) if sealed else NOT_SEALED,
            created_at_ms=int(info.created_at_ms),
            sealed_at_ms=int(info.sealed_at_ms) if sealed else NOT_SEALED,
        )
    next_id = max(segments, default=-1) + 1
    layout = SegmentLayout(epoch=int(dag.epoch), next_segment_id=next_id, segments=segments)
    try:
        layout.validate()
    except InvalidArgument as err:
        # Pruned ancestors break the link checks only; routing needs the active tiling.
        covered = sorted((s.hash_range.start, s.hash_range.end) for s in layout.active_segments())
        if not covered or covered[0][0] != 0 or covered[-1][1] != 0xFFFF:
            raise
        log.debug("DAG of epoch %d accepted despite: %s", layout.epoch, err)
    return layout


class DagSession:
    """A DAG-watch session on one scalable topic (see the module docstring)."""

    def __init__(
        self, pool: ConnectionPool, topic: TopicName, *, create_if_missing: bool = True
    ) -> None:
        self._pool = pool
        self.topic = topic
        self._conn: ClientConnection | None = None
        self._closing = False
        self._reconnect_task: asyncio.Task[None] | None = None
        self._backoff = Backoff(random=pool.random)
        self.create_if_missing = create_if_missing
        self._session_id = 0
        self._layout: SegmentLayout | None = None
        self.controller_url: str | None = None
        self.segment_brokers: dict[int, str] = {}
        self.updates = 0
        self._first: asyncio.Future[None] | None = None
        self._changed = asyncio.Event()
        self._error: AnabranchError | None = None

    def __repr__(self) -> str:
        return f"DagSession({self.topic!r})"

    @staticmethod
    async def open(
        pool: ConnectionPool, topic: TopicName, *, create_if_missing: bool = True
    ) -> DagSession:
        """A session holding the topic's current DAG (the topic is created if missing and
        allowed); raises the broker's error (``NotFound``, ``InvalidArgument``) otherwise."""
        session = DagSession(pool, topic, create_if_missing=create_if_missing)
        await session._start()
        return session

    # --- LayoutSource ------------------------------------------------------------------------

    @property
    def layout(self) -> SegmentLayout:
        """The newest layout received."""
        if self._layout is None:
            raise Closed(f"{self} has no layout yet")
        return self._layout

    async def wait_for_change(self, epoch: int) -> SegmentLayout:
        """The first layout with an epoch above ``epoch`` (raises ``Closed`` once closed)."""
        while True:
            if self._layout is not None and self._layout.epoch > epoch:
                return self._layout
            if self._closing:
                raise self._error or Closed(f"{self} is closed")
            await self._changed.wait()

    async def wait_for_update(self, updates: int) -> None:
        """Return once more than ``updates`` updates were applied (any update, also one
        that only moved the controller)."""
        while self.updates <= updates:
            if self._closing:
                raise self._error or Closed(f"{self} is closed")
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # --- connection --------------------------------------------------------------------------

    async def _connect_once(self) -> None:
        conn = await self._pool.get()
        self._session_id = session_id = self._pool.new_handler_id()
        first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._first = first
        conn.register_watch(session_id, self)
        body = pb.CommandScalableTopicLookup(
            session_id=session_id, topic=str(self.topic), create_if_missing=self.create_if_missing
        )
        try:
            conn.send_command(
                pb.BaseCommand(type=T.SCALABLE_TOPIC_LOOKUP, scalableTopicLookup=body)
            )
            await asyncio.wait_for(first, conn.operation_timeout_s)
        except TimeoutError as err:
            conn.unregister_watch(session_id)
            raise OperationTimeout(f"{self}: no DAG from {conn.address}") from err
        except BaseException:
            conn.unregister_watch(session_id)
            raise
        if self._closing:
            conn.unregister_watch(session_id)
            raise Closed(f"{self} was closed while connecting")
        self._conn = conn

    async def _start(self) -> None:
        """First session; retriable errors are retried until the operation timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._pool.operation_timeout_s
        while True:
            try:
                await self._connect_once()
                self._backoff.reset()
                return
            except AnabranchError as err:
                delay = self._backoff.next()
                if not err.retriable or loop.time() + delay > deadline:
                    raise
                log.info("%s: retrying the lookup in %.2fs: %s", self, delay, err)
                await asyncio.sleep(delay)

    def on_connection_closed(self, conn: ClientConnection) -> None:
        """A drop before the first update fails that attempt; later ones reconnect."""
        if self._first is not None and not self._first.done():
            self._first.set_exception(ConnectionClosed(f"{self}: connection lost"))
        if conn is not self._conn:
            return
        self._conn = None
        if self._closing or self._pool.closed:
            return
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        # A new session on a new connection; its first update replaces the layout.
        while not self._closing and not self._pool.closed:
            await asyncio.sleep(self._backoff.next())
            if self._closing or self._pool.closed:
                return
            try:
                await self._connect_once()
            except TERMINAL_ERRORS as err:
                log.warning("%s: giving up: %s", self, err)
                self._closing = True
                self._error = err
                self._notify()
                return
            except (AnabranchError, OSError) as err:
                log.info("%s: reconnect failed: %s", self, err)
                continue
            self._backoff.reset()
            return

    def on_frame(self, frame: Frame) -> None:
        """SCALABLE_TOPIC_UPDATE: the first answer or a push."""
        body = frame.command.scalableTopicUpdate
        if int(body.session_id) != self._session_id:
            return  # a late update of a session this client already replaced
        first = self._first
        if body.HasField("error"):
            err = from_server_error(int(body.error), body.message)
            if first is not None and not first.done():
                first.set_exception(err)
            else:
                log.warning("%s: %s", self, err)
            return
        self._apply(body.dag)
        if first is not None and not first.done():
            first.set_result(None)

    def _apply(self, dag: pb.ScalableTopicDAG) -> None:
        try:
            layout = layout_from_dag(dag)
        except AnabranchError as err:
            log.warning("%s: ignoring an invalid DAG: %s", self, err)
            return
        if self._layout is not None and layout.epoch < self._layout.epoch:
            return  # older than what is held (a reconnect raced a push)
        self._layout = layout
        # A pulsar+ssl:// client goes to the brokers' TLS listeners (the *_url_tls fields).
        tls = self._pool.use_tls
        self.controller_url = (
            (tls and dag.controller_broker_url_tls) or dag.controller_broker_url or None
        )
        self.segment_brokers = {
            int(b.segment_id): (tls and b.broker_url_tls) or b.broker_url
            for b in dag.segment_brokers
        }
        self.updates += 1
        self._notify()

    async def close(self) -> None:
        """End the session (SCALABLE_TOPIC_CLOSE); waiters get ``Closed``. Idempotent."""
        if self._closing and self._conn is None:
            self._notify()
            return
        self._closing = True
        task, self._reconnect_task = self._reconnect_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.unregister_watch(self._session_id)
            body = pb.CommandScalableTopicClose(session_id=self._session_id)
            try:
                conn.send_command(
                    pb.BaseCommand(type=T.SCALABLE_TOPIC_CLOSE, scalableTopicClose=body)
                )
            except AnabranchError as err:
                log.debug("%s: close not sent: %s", self, err)
        self._notify()


__all__ = ["DagSession", "is_scalable_name", "layout_from_dag", "scalable_topic_name"]
